"""Serving state made once in the lifespan: the pooled HTTP client, the engines of every base model, adapter
loads (single-flight), the model cache, usage metering and the rate-limit/budget guard.

Routing: each base model has one or more engine base URLs. A request for an adapter goes to an engine that
already holds it (least in-flight among those); otherwise, and for base-model requests, to the engine with
the fewest requests in flight, ties broken round robin. An engine that refused a connection is tried last
for a few seconds.

Proxied requests go over `EngineClient`, a small HTTP/1.1 keep-alive client per engine (asyncio streams and
httptools): httpx's pool did work proportional to its open connections on every request, which was half of
the gateway's CPU under load. Adapter loads and unloads (rare) keep using httpx.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

from gateway.errors import APIError, ServiceUnavailable
from gateway.limits.guard import Guard
from gateway.settings import Settings
from gateway.singleflight import SingleFlight
from gateway.usage.buffer import UsageBuffer

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
DOWN_FOR_S = 5.0
DEFAULT_CONTEXT_LENGTH = 1_048_576
"""Context length of a base model with no `context_length` setting whose `config.json` the gateway cannot
read (the engines live elsewhere): generous, so only absurd `max_tokens` values are refused for it."""


def read_context_length(settings: Settings, base_model: str) -> int:
    """The context length of a base model: its `context_length` setting, else the `max_position_embeddings`
    of its `config.json`, else `DEFAULT_CONTEXT_LENGTH`."""
    entry = settings.base_models[base_model]
    if entry.context_length is not None:
        return entry.context_length
    try:
        config = json.loads((settings.base_model_path(base_model) / "config.json").read_text())
        value = config.get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        value = None
    return value if type(value) is int and value > 0 else DEFAULT_CONTEXT_LENGTH


def make_client() -> httpx.AsyncClient:
    """The one pooled client to the engines: HTTP/1.1 keep-alive, generous limits, a short connect timeout.

    No read timeout of note: generations may be long, and streams end when the engine ends them.
    `trust_env=False`: engines live on the private network, never behind an environment proxy.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=600.0, write=60.0, pool=10.0),
        limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500, keepalive_expiry=60.0),
        trust_env=False,
    )


# ---------------------------------------------------------------------------------------------- HTTP/1.1
class UpstreamUnreachable(Exception):
    """No connection to the engine could be made (refused, unreachable, or the connect timed out)."""


class UpstreamBroken(Exception):
    """The engine's connection failed after the request was sent, or its answer was not valid HTTP."""


class _Parse:
    """httptools callbacks for one response: status, headers, body pieces as they arrive."""

    __slots__ = ("headers", "headers_done", "body", "complete", "close")

    def __init__(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.headers_done = False
        self.body: list[bytes] = []
        self.complete = False
        self.close = False
        """The engine said `Connection: close` (or spoke HTTP/1.0): the connection is not reused."""

    def on_header(self, name: bytes, value: bytes) -> None:
        name = name.lower()
        if name == b"connection" and value.lower() == b"close":
            self.close = True
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        self.headers_done = True

    def on_body(self, body: bytes) -> None:
        self.body.append(body)

    def on_message_complete(self) -> None:
        self.complete = True


class _Conn:
    """One keep-alive connection to an engine."""

    __slots__ = ("reader", "writer")

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer

    def usable(self) -> bool:
        # An idle connection the engine closed has its EOF already fed to the reader.
        return not self.reader.at_eof() and not self.writer.is_closing()

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class UpstreamResponse:
    """An engine's answer: status and headers read; the body read with `read()` or streamed with
    `chunks()`. `aclose()` gives the connection back to its pool when the answer was read to the end."""

    __slots__ = ("status", "headers", "_conn", "_client", "_parser", "_parse", "_closed")

    def __init__(self, client: EngineClient, conn: _Conn, parser: Any, parse: _Parse) -> None:
        self.status: int = parser.get_status_code()
        self.headers = parse.headers
        self._client = client
        self._conn: _Conn | None = conn
        self._parser = parser
        self._parse = parse
        self._closed = False

    async def chunks(self) -> AsyncIterator[bytes]:
        """Body pieces as the engine sends them (de-chunked)."""
        parse = self._parse
        while True:
            if parse.body:
                pieces, parse.body = parse.body, []
                for piece in pieces:
                    yield piece
            if parse.complete:
                return
            await self._feed()

    async def read(self) -> bytes:
        """The whole body."""
        parse = self._parse
        while not parse.complete:
            await self._feed()
        body = b"".join(parse.body) if len(parse.body) != 1 else parse.body[0]
        parse.body = []
        return body

    async def _feed(self) -> None:
        conn = self._conn
        assert conn is not None, "response already closed"
        try:
            data = await conn.reader.read(65536)
        except OSError as exc:
            raise UpstreamBroken(f"connection lost: {exc}") from None
        if not data:
            if self._parse.headers_done and not _has_length(self._parse.headers):
                self._parse.complete = True  # a body delimited by the connection's end
                self._parser = None
                return
            raise UpstreamBroken("the engine closed the connection mid-answer")
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            raise UpstreamBroken(f"invalid HTTP from the engine: {exc}") from None

    async def aclose(self) -> None:
        """Release the connection: back to the pool when the answer is complete, closed otherwise."""
        if self._closed:
            return
        self._closed = True
        conn, self._conn = self._conn, None
        if conn is None:
            return
        if self._parse.complete and not self._parse.close and self._parser is not None:
            self._client.release(conn)
        else:
            conn.close()


def _has_length(headers: list[tuple[bytes, bytes]]) -> bool:
    return any(name in (b"content-length", b"transfer-encoding") for name, _ in headers)


class EngineClient:
    """A lean HTTP/1.1 keep-alive client to one engine: a deque of idle connections, the request written in
    one `write`, the answer parsed with httptools. Only what proxying needs: `POST` of a JSON body.
    """

    def __init__(
        self, url: str, *, connect_timeout_s: float = CONNECT_TIMEOUT_S, max_idle: int = 512
    ) -> None:
        parts = urlsplit(url)
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port or (443 if parts.scheme == "https" else 80)
        self.ssl = parts.scheme == "https"
        self.prefix = parts.path.rstrip("/")
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        host = self.host if ":" not in self.host else f"[{self.host}]"
        self._host_header = f"{host}:{self.port}".encode()
        self._idle: deque[_Conn] = deque()

    async def _connect(self) -> _Conn:
        try:
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.host, self.port, ssl=self.ssl or None, limit=1 << 20),
                self.connect_timeout_s,
            )
        except (OSError, TimeoutError) as exc:
            raise UpstreamUnreachable(str(exc) or type(exc).__name__) from None
        return _Conn(reader, writer)

    def release(self, conn: _Conn) -> None:
        if len(self._idle) < self.max_idle and conn.usable():
            self._idle.append(conn)
        else:
            conn.close()

    async def post(self, path: str, body: bytes) -> UpstreamResponse:
        """Send `POST path` with a JSON `body`; returns once the status line and headers arrived.

        Raises `UpstreamUnreachable` when no connection could be made, `UpstreamBroken` when the engine
        failed after the request was sent. A kept-alive connection the engine closed meanwhile is replaced
        by a fresh one, once, when it broke before any byte of an answer.
        """
        head = (
            b"POST %s HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
            % (
                (self.prefix + path).encode(),
                self._host_header,
                len(body),
            )
        )
        payload = head + body
        while True:
            reused = False
            conn: _Conn | None = None
            while self._idle:
                candidate = self._idle.pop()
                if candidate.usable():
                    conn, reused = candidate, True
                    break
                candidate.close()
            if conn is None:
                conn = await self._connect()
            try:
                return await self._exchange(conn, payload)
            except _StaleConnection:
                conn.close()
                if not reused:
                    raise UpstreamBroken("the engine closed the connection before answering") from None
            except BaseException:
                conn.close()
                raise

    async def _exchange(self, conn: _Conn, payload: bytes) -> UpstreamResponse:
        parse = _Parse()
        parser = httptools.HttpResponseParser(parse)
        first = True
        try:
            conn.writer.write(payload)
            while not parse.headers_done:
                data = await conn.reader.read(65536)
                if not data:
                    if first:
                        raise _StaleConnection
                    raise UpstreamBroken("the engine closed the connection mid-answer")
                first = False
                parser.feed_data(data)
            if parser.get_http_version() == "1.0":
                parse.close = True
        except (ConnectionResetError, BrokenPipeError) as exc:
            if first:
                raise _StaleConnection from None
            raise UpstreamBroken(f"connection lost: {exc}") from None
        except OSError as exc:
            raise UpstreamBroken(f"connection lost: {exc}") from None
        except httptools.HttpParserError as exc:
            raise UpstreamBroken(f"invalid HTTP from the engine: {exc}") from None
        return UpstreamResponse(self, conn, parser, parse)

    async def aclose(self) -> None:
        while self._idle:
            self._idle.pop().close()


class _StaleConnection(Exception):
    """A reused connection failed before any answer: the engine had closed it (retry on a fresh one)."""


@dataclass(eq=False)
class Upstream:
    """One engine base URL (without `/v1`)."""

    url: str
    in_flight: int = 0
    loaded: set[str] = field(default_factory=set)
    """Adapters this gateway knows the engine holds (loaded by it, or found loaded already)."""
    down_until: float = 0.0
    http: EngineClient = field(init=False, repr=False)
    """The keep-alive connections proxied requests use."""

    def __post_init__(self) -> None:
        self.http = EngineClient(self.url)

    def mark_down(self) -> None:
        self.down_until = time.monotonic() + DOWN_FOR_S


class UpstreamPool:
    """The engines serving one base model."""

    def __init__(self, base_model: str, urls: list[str]) -> None:
        self.base_model = base_model
        self.upstreams = [Upstream(u.rstrip("/")) for u in urls]
        self._turn = itertools.count()

    def candidates(self, adapter: str | None) -> list[Upstream]:
        """Engines in the order to try them for a request (for `adapter`, or the base model when None)."""
        n = len(self.upstreams)
        if n == 0:
            return []
        start = next(self._turn) % n
        rotated = self.upstreams[start:] + self.upstreams[:start]
        now = time.monotonic()
        return sorted(
            rotated,
            key=lambda u: (u.down_until > now, adapter is not None and adapter not in u.loaded, u.in_flight),
        )


@dataclass(frozen=True, slots=True)
class Target:
    """What a requested model id is served as."""

    model_id: str
    """The id the client asked for (and sees in answers)."""
    base_model: str
    """The base model whose engines serve it."""
    adapter_path: str | None = None
    """The LoRA adapter directory, or None for a base model."""

    @property
    def engine_model(self) -> str:
        """The name the engine knows: the base model's, or the adapter's (the model id itself)."""
        return self.base_model if self.adapter_path is None else self.model_id


class ModelCache:
    """Model lookups of the last few seconds, by (organisation, model id); no DB round trip on a hit."""

    def __init__(self, ttl_s: float = 10.0, negative_ttl_s: float = 1.0, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self._entries: dict[tuple[str, str], tuple[float, Target | None]] = {}

    def get(self, org_id: str, model_id: str) -> tuple[bool, Target | None]:
        """(hit, target): a hit may be a remembered miss (target None)."""
        hit = self._entries.get((org_id, model_id))
        if hit is None or hit[0] <= time.monotonic():
            return False, None
        return True, hit[1]

    def put(self, org_id: str, model_id: str, target: Target | None) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        ttl = self.ttl_s if target is not None else self.negative_ttl_s
        self._entries[(org_id, model_id)] = (time.monotonic() + ttl, target)

    def invalidate(self, model_id: str) -> None:
        """Forget `model_id` for every organisation (and its checkpoints, whose ids extend it)."""
        for key in [k for k in self._entries if k[1] == model_id or k[1].startswith(model_id + ":")]:
            self._entries.pop(key, None)


class AdapterLoadFailed(APIError):
    status = 500
    type = "server_error"
    default_code = "adapter_load_failed"


class ServingState:
    """Everything serving shares across requests; made in the lifespan, closed with `aclose()`."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.client = client if client is not None else make_client()
        self.pools = {name: UpstreamPool(name, cfg.upstreams) for name, cfg in settings.base_models.items()}
        self.models = ModelCache(ttl_s=max(settings.auth_cache_ttl_s, 1.0))
        self.usage = UsageBuffer(
            max_rows=settings.usage_buffer_rows,
            flush_rows=settings.usage_flush_rows,
            flush_interval_s=settings.usage_flush_interval_s,
        )
        """Completion metering: written in batches once `usage.start(pool)` ran (the gateway's lifespan)."""
        self.guard: Guard | None = None
        """Rate limits and budgets; None (nothing enforced) until the lifespan makes one."""
        self.load_count = 0
        """Adapter loads actually sent to engines (single-flight makes concurrent misses one load)."""
        self._loads: SingleFlight[tuple[str, str], None] = SingleFlight()
        self._context: dict[str, int] = {}

    def context_length(self, base_model: str) -> int:
        """Most tokens a request to `base_model` may ask for (`read_context_length`, read once)."""
        known = self._context.get(base_model)
        if known is None:
            known = self._context[base_model] = read_context_length(self.settings, base_model)
        return known

    async def aclose(self) -> None:
        await self.usage.aclose()
        await self.client.aclose()
        for pool in self.pools.values():
            for up in pool.upstreams:
                await up.http.aclose()

    def pool_for(self, base_model: str) -> UpstreamPool:
        pool = self.pools.get(base_model)
        if pool is None or not pool.upstreams:
            raise ServiceUnavailable(f"No inference engine is configured for model '{base_model}'.")
        return pool

    async def ensure_loaded(self, upstream: Upstream, target: Target) -> None:
        """Make sure `upstream` holds the adapter of `target`: one load per (engine, adapter) at a time.

        Raises `httpx.TransportError` when the engine cannot be reached, `AdapterLoadFailed` when it refuses.
        """
        if target.adapter_path is None or target.model_id in upstream.loaded:
            return
        await self._loads.run((upstream.url, target.model_id), lambda: self._load(upstream, target))

    async def _load(self, upstream: Upstream, target: Target) -> None:
        assert target.adapter_path is not None
        self.load_count += 1
        t0 = time.perf_counter()
        resp = await self.client.post(
            f"{upstream.url}/v1/load_lora_adapter",
            json={
                "lora_name": target.model_id,
                "lora_path": target.adapter_path,
                "base_model_name": target.base_model,
            },
        )
        if resp.status_code == 200 or (resp.status_code == 400 and "already" in resp.text.lower()):
            upstream.loaded.add(target.model_id)
            logger.info(
                "adapter %s on %s ready in %.2fs", target.model_id, upstream.url, time.perf_counter() - t0
            )
            return
        logger.warning("engine %s refused adapter %s: %s", upstream.url, target.model_id, resp.text[:300])
        raise AdapterLoadFailed(f"The inference engine could not load model '{target.model_id}'.")

    async def unload(self, upstream: Upstream, model_id: str) -> None:
        """Unload `model_id` from one engine (unknown there counts as done)."""
        upstream.loaded.discard(model_id)
        resp = await self.client.post(f"{upstream.url}/v1/unload_lora_adapter", json={"lora_name": model_id})
        if resp.status_code not in (200, 404):
            logger.warning("engine %s could not unload %s: %s", upstream.url, model_id, resp.text[:300])

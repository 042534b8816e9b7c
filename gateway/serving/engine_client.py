"""The HTTP clients to the inference engines.

Proxied requests go over `EngineClient`, a small HTTP/1.1 keep-alive client per engine (asyncio streams and
httptools): httpx's pool did work proportional to its open connections on every request, which was half of
the gateway's CPU under load. Adapter loads and unloads (rare) use one pooled httpx client (`make_client`).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlsplit

import httptools
import httpx

CONNECT_TIMEOUT_S = 2.0


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

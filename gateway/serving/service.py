"""Serving logic: which model a request names, which engine serves it, and the proxying itself.

The hot path makes no database query for a model seen in the last few seconds (`ModelCache`), holds no
lock, and does no blocking work: one orjson parse of the body, one of each SSE line. It speaks ASGI
directly (`complete` and `stream` send on the server's `send`): no response objects, no task per request
beyond the router's disconnect watch. Rate limits and the
budget are checked (Redis, one script each) before the upstream call and settled after it; usage is queued
for a batched write, never written on the request path.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import httpx
import orjson
from starlette.types import Send

from gateway.capture.recorder import Capture
from gateway.deps import Resources
from gateway.errors import APIError, ServiceUnavailable, UpstreamError
from gateway.limits.guard import Admission
from gateway.serving import targets
from gateway.serving.engine_client import UpstreamBroken, UpstreamResponse, UpstreamUnreachable
from gateway.serving.engine_errors import engine_error
from gateway.serving.engines import Target
from gateway.serving.protocol import ProxyRequest, StreamRewriter, error_event, rewrite_response
from gateway.serving.tokens import estimate_prompt_tokens, requested_max_tokens
from gateway.serving.upstreams import Upstream
from gateway.tenancy.keys import Principal

logger = logging.getLogger(__name__)

VERSION_HEADER = b"x-tunegate-model-version"
"""The header naming what served an answer (`Target.served_version`), as its `system_fingerprint` does."""


async def resolve(res: Resources, who: Principal, model_id: str, *, param: str = "model") -> Target:
    """The target of `model_id` for the caller, or 404 `model_not_found` (also for others' models)."""
    return await targets.resolve(
        res.settings, res.models, res.pool, who.organization_id, model_id, param=param
    )


async def forget_model(res: Resources, model_id: str, base_model: str, version: str | None) -> None:
    """A deleted model stops answering at once on this gateway (cache dropped) and its version leaves the
    engines once the requests running on it end (`Engines.unload_everywhere`; another model of the same
    content loads it again on its next request)."""
    res.models.invalidate(model_id)
    if version is not None:
        res.models.invalidate(version)
        await res.engines.unload_everywhere(version, base_model)


# ---------------------------------------------------------------------------------------------- proxy
def _adapter(target: Target) -> str | None:
    """The adapter version `target` runs on at the engines, or None for a base model."""
    return target.engine_model if target.adapter_path is not None else None


def _is_unknown_model(status: int, raw: bytes) -> bool:
    return status == 404 and b"model" in raw[:2000].lower()


RELOADS_AFTER_A_LOSS = 3
"""Times one request loads its adapter again on an engine that answers it does not hold it (restarted, or an
unload raced the load) before the engine's 404 reaches the client."""


async def _open(res: Resources, path: str, target: Target, body: bytes) -> tuple[Upstream, UpstreamResponse]:
    """Send the request to the best engine; the next one when an engine cannot be reached.

    Returns the engine (counting this request in flight until the caller's `Upstream.release`) and its
    response, status and headers read, with a status below 400; raises the engine's error otherwise (as
    `engine_errors.engine_error` maps it), or 503 when no engine answers.
    """
    adapter = _adapter(target)
    last: Exception | None = None
    metrics = res.engines.metrics
    for up in res.engines.pool_for(target.base_model).candidates(adapter):
        for attempt in range(1 + RELOADS_AFTER_A_LOSS):
            up.acquire(adapter)
            try:
                if adapter is not None:
                    if adapter in up.loaded:
                        metrics.hit(target.base_model)
                    else:
                        metrics.miss(target.base_model)
                        await res.engines.ensure_loaded(up, target)
                resp = await up.http.post(path, body)
            except (UpstreamUnreachable, httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout) as exc:
                up.release(adapter)
                up.mark_down()
                last = exc
                logger.warning("engine %s unreachable: %s", up.url, exc)
                break
            except (UpstreamBroken, httpx.HTTPError) as exc:
                up.release(adapter)
                logger.warning("engine %s failed: %s", up.url, exc)
                raise ServiceUnavailable(
                    f"The inference engine for model '{target.model_id}' failed: {type(exc).__name__}."
                ) from None
            except BaseException:
                up.release(adapter)
                raise
            if resp.status < 400:
                return up, resp
            up.release(adapter)
            try:
                raw = await resp.read()
            except UpstreamBroken:
                raw = b""
            finally:
                await resp.aclose()
            if adapter is not None and attempt < RELOADS_AFTER_A_LOSS and _is_unknown_model(resp.status, raw):
                # The engine lost the adapter (restart, eviction by name, another gateway unloaded it).
                up.loaded.discard(adapter)
                continue
            raise engine_error(resp.status, raw, model=target.model_id, path=path)
    logger.warning("no engine of %s reachable: %s", target.base_model, last)
    raise ServiceUnavailable(
        f"The inference engine for model '{target.model_id}' is unavailable. Please retry shortly.",
        headers={"retry-after": "1"},
    )


async def count_tokens(res: Resources, target: Target, body: bytes) -> int:
    """The prompt tokens of a `/tokenize` request body (a chat's messages and tools) on an engine of the
    target's base model (`target` names no adapter: every adapter of a base shares its tokenizer)."""
    up, resp = await _open(res, "/tokenize", target, body)
    try:
        raw = await resp.read()
    except UpstreamBroken as exc:
        raise ServiceUnavailable(f"The inference engine failed while counting tokens: {exc}") from None
    finally:
        up.release(None)
        await resp.aclose()
    count = orjson.loads(raw).get("count")
    if not isinstance(count, int):
        raise ServiceUnavailable("The inference engine answered no token count.")
    return count


async def _admit(res: Resources, who: Principal, proxy: ProxyRequest, target: Target) -> Admission | None:
    """Rate limits and budget before the upstream call (429 when over); None when nothing is enforced."""
    prompt = estimate_prompt_tokens(proxy.body)
    most = requested_max_tokens(proxy.body, res.settings.budget_default_max_tokens)
    return await res.guard.admit(who.organization_id, who.api_key_id, target.base_model, prompt, most)


def _meter(
    res: Resources,
    who: Principal,
    proxy: ProxyRequest,
    target: Target,
    admission: Admission | None,
    usage: dict[str, Any] | None,
    *,
    started: float,
    status: int,
) -> None:
    """After the answer: one usage row (batched, off the request path) and the guard settled, both in memory
    (nothing awaited, so a `finally` of a cancelled request runs it whole)."""
    rec = res.usage.record(
        who.organization_id,
        who.api_key_id,
        proxy.model,
        usage,
        base_model=target.base_model,
        started=started,
        status=status,
    )
    if admission is not None:
        res.guard.settle(admission, rec.prompt_tokens, rec.completion_tokens)


def _headers(admission: Admission | None, extra: list[tuple[bytes, bytes]]) -> list[tuple[bytes, bytes]]:
    if admission is None or not admission.headers:
        return extra
    return extra + [(k.encode(), v.encode()) for k, v in admission.headers.items()]


async def complete(
    res: Resources,
    send: Send,
    who: Principal,
    path: str,
    proxy: ProxyRequest,
    target: Target,
    capture: Capture | None = None,
) -> None:
    """A non-streamed completion, sent on `send`: the engine's JSON with `model` rewritten (and, captured,
    recorded: `capture`)."""
    started = time.time()
    admission = await _admit(res, who, proxy, target)
    status, usage = 499, None
    extra = capture.engine_fields() if capture is not None else None
    try:
        up, resp = await _open(res, path, target, proxy.upstream_body(target.engine_model, extra))
        try:
            raw = await resp.read()
        except UpstreamBroken as exc:
            logger.warning("answer from %s broke: %s", up.url, exc)
            raise ServiceUnavailable(f"The inference engine failed while answering: {exc}") from None
        finally:
            up.release(_adapter(target))
            await resp.aclose()
        captured = capture.response(raw, target.served_version, resp.status) if capture is not None else None
        if captured is None:
            out, usage = rewrite_response(raw, proxy.model, target.served_version)
        else:
            out, usage = captured
        status = resp.status
        head = [
            (b"content-type", b"application/json"),
            (b"content-length", b"%d" % len(out)),
            (VERSION_HEADER, target.served_version.encode()),
        ]
        await send({"type": "http.response.start", "status": status, "headers": _headers(admission, head)})
        await send({"type": "http.response.body", "body": out})
    except APIError as exc:
        status = exc.status
        raise
    finally:
        _meter(res, who, proxy, target, admission, usage, started=started, status=status)


SSE_HEADERS = [
    (b"content-type", b"text/event-stream; charset=utf-8"),
    (b"cache-control", b"no-cache"),
    (b"x-accel-buffering", b"no"),
]


async def stream(
    res: Resources,
    send: Send,
    who: Principal,
    path: str,
    proxy: ProxyRequest,
    target: Target,
    capture: Capture | None = None,
) -> None:
    """A streamed completion, sent on `send`: the first upstream chunk is read before the 200 is committed.

    Events are rewritten line by line but sent one upstream chunk at a time (one write per chunk). A captured
    stream (`capture`) is accumulated as it passes and recorded when it ends.
    """
    started = time.time()
    admission = await _admit(res, who, proxy, target)
    extra = capture.engine_fields() if capture is not None else None
    try:
        up, resp = await _open(res, path, target, proxy.upstream_body(target.engine_model, extra))
    except BaseException as exc:
        status = exc.status if isinstance(exc, APIError) else 499
        _meter(res, who, proxy, target, admission, None, started=started, status=status)
        raise
    rewriter = StreamRewriter(
        model=proxy.model,
        keep_usage=proxy.client_wants_usage,
        fingerprint=target.served_version,
        tap=capture.event if capture is not None else None,
    )
    pieces = resp.chunks()
    try:
        first = await anext(pieces, b"")
    except BaseException as exc:
        up.release(_adapter(target))
        await resp.aclose()
        _meter(res, who, proxy, target, admission, None, started=started, status=503)
        if isinstance(exc, UpstreamBroken):
            raise ServiceUnavailable(f"The inference engine failed before answering: {exc}") from None
        raise
    head = [*SSE_HEADERS, (VERSION_HEADER, target.served_version.encode())]
    await send({"type": "http.response.start", "status": 200, "headers": _headers(admission, head)})
    chunks = 0
    status = 499  # until the stream ends, the client may go away
    pending = b""
    try:
        piece = first
        while piece:
            lines = (pending + piece).split(b"\n")
            pending = lines.pop()
            out = []
            for line in lines:
                rewritten = rewriter.line(line[:-1] if line.endswith(b"\r") else line)
                if rewritten is not None:
                    chunks += rewritten.startswith(b"data: {")
                    out.append(rewritten)
            if out:
                out.append(b"")
                await send({"type": "http.response.body", "body": b"\n".join(out), "more_body": True})
            piece = await anext(pieces, b"")
        if pending:
            rewritten = rewriter.line(pending)
            if rewritten is not None:
                await send({"type": "http.response.body", "body": rewritten + b"\n", "more_body": True})
        status = 200
    except UpstreamBroken as exc:
        logger.warning("stream from %s broke: %s", up.url, exc)
        status = 502
        await send(
            {
                "type": "http.response.body",
                "body": b"\n"
                + error_event(
                    UpstreamError(
                        502,
                        f"The inference engine stream failed: {exc}",
                        type_="server_error",
                        param=None,
                        code="upstream_error",
                    )
                ),
                "more_body": True,
            }
        )
        rewriter.saw_done = True
    finally:
        if status == 499 and rewriter.saw_done:
            status = 200  # the client had the whole stream, `[DONE]` included, and left before its last bytes
        up.release(_adapter(target))
        await resp.aclose()
        usage = rewriter.usage
        if usage is None:
            # No usage chunk (the client left early or the stream broke): bill what was sent, about
            # one token per chunk, and the estimated prompt.
            usage = {"prompt_tokens": estimate_prompt_tokens(proxy.body), "completion_tokens": chunks}
        _meter(res, who, proxy, target, admission, usage, started=started, status=status)
        if capture is not None:
            capture.finish_stream(target.served_version, rewriter.usage, status)
    await send(
        {
            "type": "http.response.body",
            "body": b"" if rewriter.saw_done else b"\ndata: [DONE]\n\n",
            "more_body": False,
        }
    )

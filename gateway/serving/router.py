"""Routes `POST /v1/chat/completions` and `POST /v1/completions`: auth, resolve the model, proxy.

The hot path is a plain ASGI handler, `proxy_asgi`: the request middleware calls it for these two paths
before FastAPI's router (no routing, dependency solving, request or response objects per call), and the
FastAPI routes below delegate to it as well, so both ways answer the same. Errors get the same OpenAI
envelope the app's handlers give; a client that goes away cancels the request and its upstream call (watched
for once a request has run `WATCH_AFTER_S`).
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.deps import Resources
from gateway.errors import as_api_error, error_response
from gateway.serving import service
from gateway.serving.engine_errors import prompt_param
from gateway.serving.protocol import ProxyRequest
from gateway.tenancy.keys import bearer_token

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["serving"])

PROXY_PATHS = frozenset({"/v1/chat/completions", "/v1/completions"})
"""The paths `proxy_asgi` serves (for `POST`)."""
WATCH_AFTER_S = 0.05
"""A request still running after this long starts watching for its client going away (most answers come
sooner, and a task per request to watch would cost more than the rest of the proxying)."""


class _Exchange:
    """What the disconnect watch and the handler share about one request."""

    __slots__ = ("started", "finished", "disconnected")

    def __init__(self) -> None:
        self.started = False
        self.finished = False
        self.disconnected = False


async def _watch(receive: Receive, task: asyncio.Task[object], ex: _Exchange) -> None:
    """Cancel the handler's task when the client goes away before the answer is complete."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
    if not ex.finished:
        ex.disconnected = True
        task.cancel()


async def _read_body(receive: Receive) -> bytes:
    message = await receive()
    body = message.get("body", b"")
    while message.get("more_body", False):
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError("client disconnected")
        body += message.get("body", b"")
    return body


def _authorization(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            return str(value.decode("latin-1"))
    return None


async def proxy_asgi(scope: Scope, receive: Receive, send: Send) -> None:
    """Serve one proxied completion as an ASGI app (`scope["path"]` is one of `PROXY_PATHS`)."""
    ex = _Exchange()

    async def tracked_send(message: Message) -> None:
        ex.started = True
        await send(message)

    watcher: asyncio.Task[None] | None = None
    timer: asyncio.TimerHandle | None = None
    try:
        res: Resources = scope["app"].state.resources
        who = await res.auth.authenticate(bearer_token(_authorization(scope)))
        body = await _read_body(receive)
        handler = asyncio.current_task()
        assert handler is not None

        def watch() -> None:
            nonlocal watcher
            if not ex.finished:
                watcher = asyncio.create_task(_watch(receive, handler, ex))

        timer = asyncio.get_running_loop().call_later(WATCH_AFTER_S, watch)
        proxy = ProxyRequest.parse(body)
        target = await service.resolve(res, who, proxy.model)
        limits = res.engines.limits(target.base_model)
        proxy.check_max_tokens(limits.context_length)
        proxy.check_prompt(limits.context_length, limits.max_prompt_chars, prompt_param(scope["path"]))
        capture = None
        if who.organization_id in res.capture.policies.orgs or who.episode_id is not None:
            capture = await res.capture.begin(scope, who, proxy, target)  # the lookup where capture is off
        if proxy.stream:
            await service.stream(res, tracked_send, who, scope["path"], proxy, target, capture)
        else:
            await service.complete(res, tracked_send, who, scope["path"], proxy, target, capture)
    except asyncio.CancelledError:
        if not ex.disconnected:
            raise
        task = asyncio.current_task()
        if task is not None:
            task.uncancel()
        logger.debug("client left %s before the answer was complete", scope["path"])
    except Exception as exc:
        if ex.started:
            raise
        await error_response(as_api_error(exc, "POST", scope["path"]))(scope, receive, send)
    finally:
        ex.finished = True
        if timer is not None:
            timer.cancel()
        if watcher is not None and not watcher.done():
            watcher.cancel()


class _Proxied(Response):
    """A response that is `proxy_asgi` itself (for the FastAPI routes, which have not read the body)."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await proxy_asgi(scope, receive, send)


@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    return _Proxied()


@router.post("/completions", response_model=None)
async def completions(request: Request) -> Response:
    return _Proxied()

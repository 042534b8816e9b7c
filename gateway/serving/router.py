"""Routes `POST /v1/chat/completions` and `POST /v1/completions`: auth, resolve the model, proxy.

The hot path takes its resources and principal without FastAPI's dependency solver: synchronous
dependencies run in a worker thread per request, a thread handoff that cost more CPU than the whole proxy.
"""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.deps import Resources
from gateway.serving import service
from gateway.serving.protocol import ProxyRequest
from gateway.tenancy.keys import bearer_token

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["serving"])


async def _proxy(path: str, request: Request) -> Response:
    res: Resources = request.app.state.resources
    who = await res.auth.authenticate(bearer_token(request.headers.get("authorization")))
    state = service.serving_state(res)
    proxy = ProxyRequest.parse(await request.body())
    target = await service.resolve(state, res.pool, who, proxy.model)
    if proxy.stream:
        return await service.stream(state, who, path, proxy, target)
    return await service.complete(state, request, who, path, proxy, target)


@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request) -> Response:
    return await _proxy("/v1/chat/completions", request)


@router.post("/completions", response_model=None)
async def completions(request: Request) -> Response:
    return await _proxy("/v1/completions", request)

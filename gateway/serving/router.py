"""Routes `POST /v1/chat/completions` and `POST /v1/completions`: auth, resolve the model, proxy."""

from __future__ import annotations

import logging

from fastapi import APIRouter, Request
from starlette.responses import Response

from gateway.deps import PrincipalDep, ResourcesDep
from gateway.serving import service
from gateway.serving.protocol import ProxyRequest

logger = logging.getLogger(__name__)

router = APIRouter(prefix="/v1", tags=["serving"])


async def _proxy(path: str, request: Request, res: ResourcesDep, who: PrincipalDep) -> Response:
    state = service.serving_state(res)
    proxy = ProxyRequest.parse(await request.body())
    target = await service.resolve(state, res.pool, who, proxy.model)
    if proxy.stream:
        return await service.stream(state, who, path, proxy, target)
    return await service.complete(state, request, who, path, proxy, target)


@router.post("/chat/completions", response_model=None)
async def chat_completions(request: Request, res: ResourcesDep, who: PrincipalDep) -> Response:
    return await _proxy("/v1/chat/completions", request, res, who)


@router.post("/completions", response_model=None)
async def completions(request: Request, res: ResourcesDep, who: PrincipalDep) -> Response:
    return await _proxy("/v1/completions", request, res, who)

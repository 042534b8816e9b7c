"""Routes of capture: the admin switch (`/v1/admin/.../capture`) and OpenAI's stored-completions API
(`GET /v1/chat/completions`, `GET|POST|DELETE /v1/chat/completions/{id}`, `GET .../{id}/messages`); creating
a completion is the proxy's (`gateway.serving.router`)."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request

from gateway.capture import service
from gateway.capture.protocol import CaptureSettingOut, CaptureUpdate, CompletionUpdate
from gateway.deps import AdminDep, PrincipalDep, RequestLimitDep, ResourcesDep

admin_router = APIRouter(prefix="/v1/admin", dependencies=[AdminDep], tags=["admin"])
router = APIRouter(prefix="/v1/chat/completions", tags=["capture"], dependencies=[RequestLimitDep])


@admin_router.post("/organizations/{org_id}/capture")
async def set_org_capture(org_id: str, body: CaptureUpdate, res: ResourcesDep) -> CaptureSettingOut:
    return await service.set_org(res, org_id, body)


@admin_router.get("/organizations/{org_id}/capture")
async def get_org_capture(org_id: str, res: ResourcesDep) -> CaptureSettingOut:
    return await service.get_org(res, org_id)


@admin_router.post("/api_keys/{key_id}/capture")
async def set_key_capture(key_id: str, body: CaptureUpdate, res: ResourcesDep) -> CaptureSettingOut:
    return await service.set_key(res, key_id, body)


@admin_router.get("/api_keys/{key_id}/capture")
async def get_key_capture(key_id: str, res: ResourcesDep) -> CaptureSettingOut:
    return await service.get_key(res, key_id)


@router.get("")
async def list_completions(
    request: Request,
    res: ResourcesDep,
    who: PrincipalDep,
    model: str | None = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
) -> dict[str, Any]:
    metadata = {
        k[len("metadata[") : -1]: v
        for k, v in request.query_params.items()
        if k.startswith("metadata[") and k.endswith("]")
    }
    return await service.list_completions(
        res, who, model=model, metadata=metadata, after=after, limit=limit, order=order
    )


@router.get("/{completion_id}")
async def retrieve_completion(completion_id: str, res: ResourcesDep, who: PrincipalDep) -> dict[str, Any]:
    return await service.retrieve(res, who, completion_id)


@router.post("/{completion_id}")
async def update_completion(
    completion_id: str, body: CompletionUpdate, res: ResourcesDep, who: PrincipalDep
) -> dict[str, Any]:
    return await service.update(res, who, completion_id, body.metadata)


@router.delete("/{completion_id}")
async def delete_completion(completion_id: str, res: ResourcesDep, who: PrincipalDep) -> dict[str, Any]:
    return await service.delete(res, who, completion_id)


@router.get("/{completion_id}/messages")
async def list_messages(
    completion_id: str,
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
) -> dict[str, Any]:
    return await service.messages(res, who, completion_id, after=after, limit=limit, order=order)

"""Routes that export captured episodes: their exact token sequences, as JSONL samples or Tinker `Datum`s
(`gateway.capture.export_service`)."""

from __future__ import annotations

from typing import Any, Literal

from fastapi import APIRouter
from fastapi.responses import Response

from gateway.capture import export_service
from gateway.capture.protocol import ExportRequest
from gateway.deps import PrincipalDep, RequestLimitDep, ResourcesDep
from gateway.files.protocol import FileObject

router = APIRouter(prefix="/v1", tags=["episodes"], dependencies=[RequestLimitDep])


@router.post("/episodes/export", response_model=None)
async def export_episodes(body: ExportRequest, res: ResourcesDep, who: PrincipalDep) -> Response | FileObject:
    out = await export_service.many(res, who, body)
    if isinstance(out, FileObject):
        return out
    return Response(out, media_type="application/jsonl")


@router.get("/episodes/{episode_id}/export")
async def export_episode(
    episode_id: str,
    res: ResourcesDep,
    who: PrincipalDep,
    format: Literal["jsonl", "tinker"] = "jsonl",
    reward: str | None = None,
) -> dict[str, Any]:
    return await export_service.one(res, who, episode_id, fmt=format, reward=reward)

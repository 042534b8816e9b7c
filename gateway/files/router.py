"""Files API: `/v1/files`."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import FileResponse

from gateway.deps import PrincipalDep, RequestLimitDep, ResourcesDep
from gateway.files import service
from gateway.files.protocol import FileDeleted, FileObject
from gateway.protocol import CursorPage

router = APIRouter(prefix="/v1/files", tags=["files"], dependencies=[RequestLimitDep])


@router.post("")
async def create_file(request: Request, res: ResourcesDep, who: PrincipalDep) -> FileObject:
    length = request.headers.get("content-length")
    return await service.upload(
        res.pool,
        res.blobs,
        res.settings,
        offload=res.offload,
        org_id=who.organization_id,
        content_type=request.headers.get("content-type"),
        content_length=int(length) if length and length.isdigit() else None,
        body=request.stream(),
    )


@router.get("")
async def list_files(
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=10000)] = 10000,
    order: Literal["asc", "desc"] = "desc",
    purpose: str | None = None,
) -> CursorPage[FileObject]:
    return await service.list_files(
        res.pool, org_id=who.organization_id, purpose=purpose, after=after, limit=limit, order=order
    )


@router.get("/{file_id}")
async def retrieve_file(file_id: str, res: ResourcesDep, who: PrincipalDep) -> FileObject:
    return FileObject.from_row(await service.get(res.pool, org_id=who.organization_id, file_id=file_id))


@router.delete("/{file_id}")
async def delete_file(file_id: str, res: ResourcesDep, who: PrincipalDep) -> FileDeleted:
    await service.delete(res.pool, res.blobs, org_id=who.organization_id, file_id=file_id)
    return FileDeleted(id=file_id)


@router.get("/{file_id}/content")
async def file_content(file_id: str, res: ResourcesDep, who: PrincipalDep) -> FileResponse:
    row = await service.get(res.pool, org_id=who.organization_id, file_id=file_id)
    return FileResponse(
        res.blobs.path(row.blob_key), media_type="application/octet-stream", filename=row.filename
    )

"""Aliases API: `POST /v1/aliases` (create or move), `GET /v1/aliases[/{name}]`, `DELETE /v1/aliases/{name}`;
the caller's organisation's aliases only (another organisation's is a 404)."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.aliases import service
from gateway.aliases.protocol import Alias, AliasDeleted, AliasList, AliasWrite
from gateway.deps import PrincipalDep, RequestLimitDep, ResourcesDep

router = APIRouter(prefix="/v1/aliases", tags=["aliases"], dependencies=[RequestLimitDep])


@router.post("")
async def write_alias(body: AliasWrite, res: ResourcesDep, who: PrincipalDep) -> Alias:
    return await service.write(res, who, body)


@router.get("")
async def list_aliases(res: ResourcesDep, who: PrincipalDep) -> AliasList:
    return AliasList(data=await service.list_all(res, who))


@router.get("/{name:path}")
async def retrieve_alias(name: str, res: ResourcesDep, who: PrincipalDep) -> Alias:
    return await service.get(res, who, name)


@router.delete("/{name:path}")
async def delete_alias(name: str, res: ResourcesDep, who: PrincipalDep) -> AliasDeleted:
    await service.delete(res, who, name)
    return AliasDeleted(name=name)

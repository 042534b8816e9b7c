"""Admin API: organisations and their API keys (authenticated with the admin key)."""

from __future__ import annotations

from typing import Literal

from fastapi import APIRouter

from gateway.deps import AdminDep, PoolDep, ResourcesDep
from gateway.protocol import OpenAIBaseModel
from gateway.tenancy import service
from gateway.tenancy.protocol import ApiKey, ApiKeyCreate, Organization, OrganizationCreate

router = APIRouter(prefix="/v1/admin", dependencies=[AdminDep], tags=["admin"])


class OrganizationList(OpenAIBaseModel):
    object: str = "list"
    data: list[Organization]


class ApiKeyList(OpenAIBaseModel):
    object: str = "list"
    data: list[ApiKey]


@router.post("/organizations")
async def create_organization(body: OrganizationCreate, pool: PoolDep) -> Organization:
    return await service.create_org(pool, body.name)


@router.get("/organizations")
async def list_organizations(pool: PoolDep) -> OrganizationList:
    return OrganizationList(data=await service.list_orgs(pool))


@router.get("/organizations/{org_id}")
async def get_organization(org_id: str, pool: PoolDep) -> Organization:
    return await service.get_org(pool, org_id)


@router.post("/organizations/{org_id}/api_keys")
async def create_api_key(org_id: str, pool: PoolDep, body: ApiKeyCreate | None = None) -> ApiKey:
    return await service.create_key(pool, org_id, body.name if body else None)


@router.get("/organizations/{org_id}/api_keys")
async def list_api_keys(
    org_id: str, pool: PoolDep, kind: Literal["user", "eval", "job", "episode", "all"] = "user"
) -> ApiKeyList:
    """People's keys; `kind=eval|job|episode|all` shows the keys minted for eval runs, jobs, episodes too."""
    return ApiKeyList(data=await service.list_keys(pool, org_id, None if kind == "all" else kind))


@router.delete("/api_keys/{key_id}")
async def revoke_api_key(key_id: str, res: ResourcesDep) -> ApiKey:
    return await service.revoke_key(res.pool, res.auth, key_id)

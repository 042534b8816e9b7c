"""Admin API: rate limits per organisation and per key, a key's monthly spend limit, the organisation's
monthly budget and its Stripe customer."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.deps import AdminDep, ResourcesDep
from gateway.limits import service
from gateway.limits.protocol import (
    BillingSettings,
    BillingUpdate,
    Limits,
    LimitsUpdate,
    OrgLimits,
    SpendLimit,
    SpendLimitUpdate,
)

router = APIRouter(prefix="/v1/admin", dependencies=[AdminDep], tags=["admin"])


@router.post("/organizations/{org_id}/limits")
async def set_org_limits(org_id: str, body: LimitsUpdate, res: ResourcesDep) -> Limits:
    return await service.set_limits(res, org_id=org_id, key_id=None, body=body)


@router.post("/api_keys/{key_id}/limits")
async def set_key_limits(key_id: str, body: LimitsUpdate, res: ResourcesDep) -> Limits:
    return await service.set_key_limits(res, key_id=key_id, body=body)


@router.post("/api_keys/{key_id}/spend_limit")
async def set_spend_limit(key_id: str, body: SpendLimitUpdate, res: ResourcesDep) -> SpendLimit:
    return await service.set_spend_limit(res, key_id, body)


@router.get("/api_keys/{key_id}/spend_limit")
async def get_spend_limit(key_id: str, res: ResourcesDep) -> SpendLimit:
    return await service.get_spend_limit(res, key_id)


@router.get("/organizations/{org_id}/limits")
async def get_limits(org_id: str, res: ResourcesDep) -> OrgLimits:
    return await service.get_limits(res, org_id)


@router.post("/organizations/{org_id}/billing")
async def set_billing(org_id: str, body: BillingUpdate, res: ResourcesDep) -> BillingSettings:
    return await service.set_billing(res, org_id, body)


@router.get("/organizations/{org_id}/billing")
async def get_billing(org_id: str, res: ResourcesDep) -> BillingSettings:
    return await service.get_billing(res, org_id)

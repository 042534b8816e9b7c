"""Setting and reading limits, budgets and Stripe customers (admin API); a change drops this gateway's
cached policy of the organisation at once (other gateways see it within `limits_cache_ttl_s`)."""

from __future__ import annotations

import logging

from gateway.deps import Resources
from gateway.errors import not_found
from gateway.limits import store
from gateway.limits.budget import key_month_spend_usd
from gateway.limits.protocol import (
    BillingSettings,
    BillingUpdate,
    Limits,
    LimitsUpdate,
    OrgLimits,
    SpendLimit,
    SpendLimitUpdate,
)
from gateway.tenancy import store as tenancy_store

logger = logging.getLogger(__name__)


async def _check_org(res: Resources, org_id: str) -> None:
    if await tenancy_store.get_org(res.pool, org_id=org_id) is None:
        raise not_found("organization", org_id, param="org_id")


async def set_limits(res: Resources, *, org_id: str, key_id: str | None, body: LimitsUpdate) -> Limits:
    await _check_org(res, org_id)
    row = await store.set_limits(
        res.pool,
        org_id=org_id,
        key_id=key_id,
        requests=body.max_requests_per_1_minute,
        tokens=body.max_tokens_per_1_minute,
    )
    res.guard.forget(org_id)
    return Limits.from_row(row)


async def _org_of_key(res: Resources, key_id: str) -> str:
    org_id = await store.org_of_key(res.pool, key_id=key_id)
    if org_id is None:
        raise not_found("API key", key_id, param="key_id")
    return org_id


async def set_key_limits(res: Resources, *, key_id: str, body: LimitsUpdate) -> Limits:
    return await set_limits(res, org_id=await _org_of_key(res, key_id), key_id=key_id, body=body)


async def get_spend_limit(res: Resources, key_id: str) -> SpendLimit:
    org_id = await _org_of_key(res, key_id)
    return SpendLimit(
        api_key_id=key_id,
        organization_id=org_id,
        monthly_spend_limit_usd=await store.spend_limit_of_key(res.pool, key_id=key_id),
        month_to_date_usd=round(
            await key_month_spend_usd(res.pool, res.settings, org_id=org_id, key_id=key_id), 6
        ),
    )


async def set_spend_limit(res: Resources, key_id: str, body: SpendLimitUpdate) -> SpendLimit:
    org_id = await _org_of_key(res, key_id)
    await store.set_spend_limit(res.pool, org_id=org_id, key_id=key_id, limit=body.monthly_spend_limit_usd)
    res.guard.forget(org_id)
    return await get_spend_limit(res, key_id)


async def get_billing(res: Resources, org_id: str) -> BillingSettings:
    await _check_org(res, org_id)
    row = await store.billing_of_org(res.pool, org_id=org_id)
    spent = await res.guard.month_spend_micro(org_id) / 1e6
    return BillingSettings(
        organization_id=org_id,
        monthly_budget_usd=row.monthly_budget_usd if row else None,
        stripe_customer_id=row.stripe_customer_id if row else None,
        month_to_date_usd=spent,
    )


async def set_billing(res: Resources, org_id: str, body: BillingUpdate) -> BillingSettings:
    await _check_org(res, org_id)
    given = body.model_fields_set
    await store.set_billing(
        res.pool,
        org_id=org_id,
        budget=body.monthly_budget_usd,
        set_budget="monthly_budget_usd" in given,
        customer=body.stripe_customer_id,
        set_customer="stripe_customer_id" in given,
    )
    res.guard.forget(org_id)
    return await get_billing(res, org_id)


async def get_limits(res: Resources, org_id: str) -> OrgLimits:
    await _check_org(res, org_id)
    org = Limits(organization_id=org_id)
    keys: list[Limits] = []
    for row in await store.limits_of_org(res.pool, org_id=org_id):
        if row.api_key_id:
            keys.append(Limits.from_row(row))
        else:
            org = Limits.from_row(row)
    return OrgLimits(organization=org, api_keys=keys, billing=await get_billing(res, org_id))

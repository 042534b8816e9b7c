"""Routes `GET /v1/organization/usage/completions` and `GET /v1/organization/costs`.

An organisation's keys (a person's, not those minted for an eval run or a job) read their own organisation's
usage, each read taking one request from the key's request limit; the admin key reads any, naming it with
the `organization_id` query parameter.
"""

from __future__ import annotations

import hmac
from typing import Annotated

from fastapi import APIRouter, Header, Query

from gateway.deps import ResourcesDep, authenticate_person
from gateway.errors import InvalidRequest
from gateway.tenancy.keys import bearer_token
from gateway.usage import service
from gateway.usage.protocol import CompletionsUsageResult, CostsResult, UsagePage

router = APIRouter(prefix="/v1/organization", tags=["usage"])


async def _organization(res: ResourcesDep, authorization: str | None, organization_id: str | None) -> str:
    """The organisation whose usage is read. An organisation's key takes one request from its request
    bucket, as `RequestLimitDep` does on the other routes of a key (that dependency would refuse the admin
    key, which these routes also take and which no per-key bucket limits)."""
    token = bearer_token(authorization)
    if res.admin_key and hmac.compare_digest(token.encode(), res.admin_key.encode()):
        if not organization_id:
            raise InvalidRequest("The admin key must name organization_id.", param="organization_id")
        return organization_id
    who = await authenticate_person(res, token)  # a key minted for an eval run or a job: 403
    await res.guard.admit_request(who.organization_id, who.api_key_id)
    return who.organization_id  # an organisation's key sees only its own usage, whatever it asks


@router.get("/usage/completions")
async def usage_completions(
    res: ResourcesDep,
    start_time: int,
    authorization: Annotated[str | None, Header()] = None,
    end_time: int | None = None,
    bucket_width: str = "1d",
    group_by: Annotated[list[str] | None, Query(alias="group_by[]")] = None,
    group_by_plain: Annotated[list[str] | None, Query(alias="group_by")] = None,
    models: Annotated[list[str] | None, Query(alias="models[]")] = None,
    api_key_ids: Annotated[list[str] | None, Query(alias="api_key_ids[]")] = None,
    limit: int | None = None,
    page: str | None = None,
    organization_id: str | None = None,
) -> UsagePage[CompletionsUsageResult]:
    org = await _organization(res, authorization, organization_id)
    return await service.completions(
        res.pool,
        org,
        start_time=start_time,
        end_time=end_time,
        bucket_width=bucket_width,
        group_by=(group_by or []) + (group_by_plain or []),
        models=models,
        api_key_ids=api_key_ids,
        limit=limit,
        page=page,
    )


@router.get("/costs")
async def organization_costs(
    res: ResourcesDep,
    start_time: int,
    authorization: Annotated[str | None, Header()] = None,
    end_time: int | None = None,
    bucket_width: str = "1d",
    group_by: Annotated[list[str] | None, Query(alias="group_by[]")] = None,
    group_by_plain: Annotated[list[str] | None, Query(alias="group_by")] = None,
    limit: int | None = None,
    page: str | None = None,
    organization_id: str | None = None,
) -> UsagePage[CostsResult]:
    org = await _organization(res, authorization, organization_id)
    return await service.costs(
        res.pool,
        res.settings,
        org,
        start_time=start_time,
        end_time=end_time,
        bucket_width=bucket_width,
        group_by=(group_by or []) + (group_by_plain or []),
        limit=limit,
        page=page,
    )

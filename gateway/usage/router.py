"""Routes `GET /v1/organization/usage/completions`, `GET /v1/organization/usage/capture_storage` and
`GET /v1/organization/costs`.

An organisation's keys (a person's, not those minted for an eval run or a job) read their own organisation's
usage, each read taking one request from the key's request limit; the admin key reads any, naming it with
the `organization_id` query parameter. Every route takes the same query (`usage_query`).
"""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Depends, Query

from gateway.deps import AdminOrPrincipalDep, ResourcesDep, limit_requests
from gateway.errors import InvalidRequest
from gateway.usage import service
from gateway.usage.protocol import (
    CaptureStorageUsageResult,
    CompletionsUsageResult,
    CostsResult,
    UsagePage,
    UsageQuery,
)

router = APIRouter(prefix="/v1/organization", tags=["usage"])


async def usage_query(
    res: ResourcesDep,
    who: AdminOrPrincipalDep,
    start_time: int,
    end_time: int | None = None,
    bucket_width: str = "1d",
    group_by: Annotated[list[str] | None, Query(alias="group_by[]")] = None,
    group_by_plain: Annotated[list[str] | None, Query(alias="group_by")] = None,
    limit: int | None = None,
    page: str | None = None,
    organization_id: str | None = None,
) -> UsageQuery:
    """The query of every route, for the admin key's named organisation or the calling key's own (whatever
    it names). An organisation's key takes one request from its request bucket, as `RequestLimitDep` does
    on the other routes of a key (that dependency would refuse the admin key, which no per-key bucket
    limits)."""
    if who is None:
        if not organization_id:
            raise InvalidRequest("The admin key must name organization_id.", param="organization_id")
        org = organization_id
    else:
        await limit_requests(res, who)
        org = who.organization_id
    return UsageQuery(
        organization_id=org,
        start_time=start_time,
        end_time=end_time,
        bucket_width=bucket_width,
        group_by=(group_by or []) + (group_by_plain or []),
        limit=limit,
        page=page,
    )


UsageQueryDep = Annotated[UsageQuery, Depends(usage_query)]


@router.get("/usage/completions")
async def usage_completions(
    res: ResourcesDep,
    query: UsageQueryDep,
    models: Annotated[list[str] | None, Query(alias="models[]")] = None,
    api_key_ids: Annotated[list[str] | None, Query(alias="api_key_ids[]")] = None,
) -> UsagePage[CompletionsUsageResult]:
    return await service.completions(res.pool, query, models=models, api_key_ids=api_key_ids)


@router.get("/usage/capture_storage")
async def usage_capture_storage(
    res: ResourcesDep, query: UsageQueryDep
) -> UsagePage[CaptureStorageUsageResult]:
    return await service.capture_storage(res.pool, query)


@router.get("/costs")
async def organization_costs(res: ResourcesDep, query: UsageQueryDep) -> UsagePage[CostsResult]:
    return await service.costs(res.pool, res.settings, query)

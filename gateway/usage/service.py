"""The usage and costs API in OpenAI's organisation shapes: pages of time buckets, results grouped on request.

Every bucket of the requested range is listed (empty ones too, as OpenAI does); `limit` is the number of
buckets a page holds and `page` the cursor (the start time of the next page's first bucket).
"""

from __future__ import annotations

import logging
from collections import defaultdict
from datetime import UTC, datetime, timedelta
from typing import Any

import asyncpg

from gateway.errors import InvalidRequest
from gateway.settings import Settings
from gateway.usage import storage, store
from gateway.usage.pricing import (
    capture_storage_cost,
    gb_months,
    input_cost,
    output_cost,
    training_cost,
    training_time_cost,
    training_tokens_cost,
)
from gateway.usage.protocol import (
    Bucket,
    CaptureStorageUsageResult,
    CompletionsUsageResult,
    CostAmount,
    CostsLineItem,
    CostsResult,
    UsagePage,
    UsageQuery,
)

logger = logging.getLogger(__name__)

WIDTHS = {"1m": timedelta(minutes=1), "1h": timedelta(hours=1), "1d": timedelta(days=1)}
DEFAULT_LIMIT = {"1m": 60, "1h": 24, "1d": 7}
MAX_LIMIT = {"1m": 1440, "1h": 168, "1d": 31}


MAX_TIMESTAMP = 253_402_300_799
"""The last second of year 9999 (UTC): the latest `start_time`, `end_time` or `page` accepted."""


def _timestamp(value: int, param: str) -> datetime:
    if not 0 <= value <= MAX_TIMESTAMP:
        raise InvalidRequest(
            f"{param} must be a Unix time in seconds between 0 and {MAX_TIMESTAMP}.",
            param=param,
            code="invalid_value",
        )
    return datetime.fromtimestamp(value, UTC)


def _window(
    start_time: int, end_time: int | None, bucket_width: str, limit: int | None, page: str | None
) -> tuple[timedelta, datetime, datetime, datetime, int, bool]:
    """(width, first bucket, end of this page, end of the range, buckets on this page, has_more).

    Times are checked against `MAX_TIMESTAMP` before any date arithmetic, and the page's end is computed in
    whole seconds, so no value of a parameter can overflow a date.
    """
    if bucket_width not in WIDTHS:
        raise InvalidRequest("bucket_width must be one of 1m, 1h, 1d.", param="bucket_width")
    width = WIDTHS[bucket_width]
    n = limit or DEFAULT_LIMIT[bucket_width]
    if not 1 <= n <= MAX_LIMIT[bucket_width]:
        raise InvalidRequest(f"limit must be between 1 and {MAX_LIMIT[bucket_width]}.", param="limit")
    start = _timestamp(start_time, "start_time")
    end = _timestamp(end_time, "end_time") if end_time else datetime.now(UTC)
    if end <= start:
        raise InvalidRequest("end_time must be after start_time.", param="end_time")
    first = start
    if page:
        cursor = int(page) if page.isascii() and page.isdigit() else -1
        if not start_time <= cursor <= MAX_TIMESTAMP or (cursor - start_time) % int(width.total_seconds()):
            raise InvalidRequest("Invalid page cursor.", param="page", code="invalid_value")
        first = datetime.fromtimestamp(cursor, UTC)
    seconds = int(width.total_seconds())
    page_end_ts = min(int(end.timestamp()), int(first.timestamp()) + n * seconds)
    page_end = end if page_end_ts >= int(end.timestamp()) else datetime.fromtimestamp(page_end_ts, UTC)
    return width, first, page_end, end, n, page_end < end


def _buckets(first: datetime, page_end: datetime, width: timedelta) -> list[Bucket[Any]]:
    out: list[Bucket[Any]] = []
    t, end, step = int(first.timestamp()), page_end.timestamp(), int(width.total_seconds())
    while t < end:
        out.append(Bucket(start_time=t, end_time=int(min(t + step, end))))
        t += step
    return out


def _page(data: list[Bucket[Any]], page_end: datetime, has_more: bool) -> UsagePage[Any]:
    return UsagePage(
        data=data, has_more=has_more, next_page=str(int(page_end.timestamp())) if has_more else None
    )


async def completions(
    pool: asyncpg.Pool,
    query: UsageQuery,
    *,
    models: list[str] | None,
    api_key_ids: list[str] | None,
) -> UsagePage[CompletionsUsageResult]:
    """`GET /v1/organization/usage/completions`."""
    bad = [g for g in query.group_by if g not in store.GROUPABLE]
    if bad:
        raise InvalidRequest(f"group_by supports model and api_key_id, not {bad[0]}.", param="group_by")
    width, first, page_end, _, _, has_more = _window(
        query.start_time, query.end_time, query.bucket_width, query.limit, query.page
    )
    rows = await store.completion_buckets(
        pool,
        org_id=query.organization_id,
        width=width,
        start=first,
        end=page_end,
        group_by=query.group_by,
        models=models or None,
        api_key_ids=api_key_ids or None,
    )
    buckets = _buckets(first, page_end, width)
    by_start = {b.start_time: b for b in buckets}
    for r in rows:
        result = CompletionsUsageResult(
            input_tokens=r.input_tokens,
            output_tokens=r.output_tokens,
            num_model_requests=r.num_model_requests,
            api_key_id=r.api_key_id,
            model=r.model,
        )
        by_start[int(r.bucket.timestamp())].results.append(result)
    return _page(buckets, page_end, has_more)


async def capture_storage(pool: asyncpg.Pool, query: UsageQuery) -> UsagePage[CaptureStorageUsageResult]:
    """`GET /v1/organization/usage/capture_storage`: byte-seconds of bytes kept in capture, per bucket."""
    if query.group_by:
        raise InvalidRequest("group_by is not supported for capture storage.", param="group_by")
    width, first, page_end, _, _, has_more = _window(
        query.start_time, query.end_time, query.bucket_width, query.limit, query.page
    )
    rows = await storage.buckets(pool, org_id=query.organization_id, width=width, start=first, end=page_end)
    buckets: list[Bucket[CaptureStorageUsageResult]] = _buckets(first, page_end, width)
    by_start = {b.start_time: b for b in buckets}
    for r in rows:
        result = CaptureStorageUsageResult(byte_seconds=r.byte_seconds, gb_months=gb_months(r.byte_seconds))
        by_start[int(r.bucket.timestamp())].results.append(result)
    return _page(buckets, page_end, has_more)


async def costs(pool: asyncpg.Pool, settings: Settings, query: UsageQuery) -> UsagePage[CostsResult]:
    """`GET /v1/organization/costs`: amounts from the price table; `group_by=line_item` splits them into
    `<base model>, input|output|training tokens|training hours` and `capture storage`."""
    bad = [g for g in query.group_by if g != "line_item"]
    if bad:
        raise InvalidRequest(f"group_by supports line_item, not {bad[0]}.", param="group_by")
    width, first, page_end, _, _, has_more = _window(
        query.start_time, query.end_time, query.bucket_width, query.limit, query.page
    )
    done, trained = await store.cost_inputs(
        pool, org_id=query.organization_id, width=width, start=first, end=page_end
    )
    kept = await storage.buckets(pool, org_id=query.organization_id, width=width, start=first, end=page_end)
    lines: dict[int, dict[str, tuple[float, float, str]]] = defaultdict(dict)

    def add(bucket: datetime, item: str, amount: float, quantity: float, unit: str) -> None:
        key = int(bucket.timestamp())
        old = lines[key].get(item, (0.0, 0.0, unit))
        lines[key][item] = (old[0] + amount, old[1] + quantity, unit)

    for c in done:
        model = c.base_model
        add(
            c.bucket,
            f"{model}, input",
            input_cost(settings, model, c.prompt_tokens),
            c.prompt_tokens,
            "tokens",
        )
        add(
            c.bucket,
            f"{model}, output",
            output_cost(settings, model, c.completion_tokens),
            c.completion_tokens,
            "tokens",
        )
    for t in trained:
        model = t.base_model
        add(
            t.bucket,
            f"{model}, training tokens",
            training_tokens_cost(settings, model, t.trained_tokens),
            t.trained_tokens,
            "tokens",
        )
        hours = t.training_seconds / 3600.0
        add(
            t.bucket,
            f"{model}, training hours",
            training_time_cost(settings, model, t.training_seconds),
            hours,
            "hours",
        )
    for k in kept:
        add(
            k.bucket,
            "capture storage",
            capture_storage_cost(settings, k.byte_seconds),
            gb_months(k.byte_seconds),
            "GB-months",
        )
    buckets: list[Bucket[CostsResult]] = _buckets(first, page_end, width)
    for b in buckets:
        items = lines.get(b.start_time, {})
        if "line_item" in query.group_by:
            b.results = [
                CostsLineItem(
                    amount=CostAmount(value=amount), line_item=item, quantity=quantity, quantity_unit=unit
                )
                for item, (amount, quantity, unit) in sorted(items.items())
            ]
        elif items:
            total = sum(a for a, _, _ in items.values())
            b.results = [CostsResult(amount=CostAmount(value=total))]
    return _page(buckets, page_end, has_more)


async def job_usage(
    pool: asyncpg.Pool, settings: Settings, org_id: str, job_ids: list[str]
) -> dict[str, Any]:
    """`{job id: {trained_tokens, training_seconds, steps, cost_usd}}` for jobs with recorded progress."""
    out: dict[str, Any] = {}
    for r in await store.job_usage(pool, org_id=org_id, job_ids=job_ids):
        cost = training_cost(settings, r.base_model, r.trained_tokens, r.training_seconds)
        out[r.job_id] = {
            "trained_tokens": int(r.trained_tokens),
            "training_seconds": round(float(r.training_seconds), 3),
            "steps": int(r.steps),
            "cost_usd": round(cost, 6),
        }
    return out

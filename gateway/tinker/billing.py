"""Tinker's billing reports (the SDK's `AdminClient` and `tinker billing`): an organisation's usage as hourly
events, and its checkpoint storage now. Only the caller's organisation's.

Usage events (`GET /api/v1/billing/usage/events`), one per UTC hour, event type, base model and session:

- `training`: tokens of Tinker's `forward` / `forward_backward` (with the session of their training model),
  priced as billing prices them, as prompt tokens of the base model; and tokens fine-tuning jobs trained
  (no session), at the base model's training rate, in the hour their attempt ended (when billing records
  them). A job's hourly charge (`training_per_hour`) is no token and has no event here.
- `sampling_prefill` (never `cached`) and `sampling_sample`: prompt and completion tokens of every completion
  of the organisation, Tinker's sampling included. No session: Tinker sampling is metered as a completion of
  its served model with the caller's key, and a usage row does not say which session sent it.
- `checkpoint`: Tinker checkpoints saved in the hour (no price).

No `storage` events: checkpoint rows do not keep their history (saving again under a name replaces the row,
an expired one is deleted), so gigabyte-hours of the past cannot be computed. Costs come from the price table
(`gateway.usage.pricing`), so `cost_data_through` is always None. Usage is in the report as soon as it is in
the usage tables: a Tinker pass when it is answered, a completion within the gateway's
`usage_flush_interval_s` (1 s by default).
"""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime, timedelta

from gateway.deps import Resources
from gateway.errors import InvalidRequest
from gateway.settings import Settings
from gateway.tenancy.keys import Principal
from gateway.tinker import billing_store as store
from gateway.tinker.billing_protocol import (
    BillingUsageEvent,
    BillingUsageResponse,
    BillingUsageSession,
    CheckpointEvent,
    CurrentCheckpointStorageUsageItem,
    CurrentCheckpointStorageUsageResponse,
    SamplingPrefillEvent,
    SamplingSampleEvent,
    TrainingEvent,
)
from gateway.usage.pricing import input_cost, output_cost, training_tokens_cost

HOUR = timedelta(hours=1)
MAX_WINDOW = timedelta(days=14)
"""The longest window one request reads, as Tinker documents it."""
BYTES_PER_GIGABYTE = 1e9


def parse_time(value: str, param: str) -> datetime:
    """An RFC 3339 time (one without an offset is taken as UTC) on a UTC hour boundary, else a 400 naming
    `param`."""
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        raise InvalidRequest(
            f"{param} must be an RFC 3339 time such as 2026-07-13T00:00:00Z, not {value!r}.",
            param=param,
            code="invalid_value",
        ) from None
    at = parsed.replace(tzinfo=UTC) if parsed.tzinfo is None else parsed.astimezone(UTC)
    if at.minute or at.second or at.microsecond:
        raise InvalidRequest(
            f"{param} must be on a UTC hour boundary (such as {at:%Y-%m-%dT%H}:00:00Z), not {value!r}.",
            param=param,
            code="invalid_value",
        )
    return at


def window(starting_on: str, ending_before: str, now: datetime) -> tuple[datetime, datetime]:
    """`[start, end)` of a usage request, checked as Tinker documents it: hour-aligned, a start not in the
    future, an end after it and at most 14 days on."""
    start = parse_time(starting_on, "starting_on")
    end = parse_time(ending_before, "ending_before")
    if start > now:
        raise InvalidRequest(
            "starting_on must not be in the future.", param="starting_on", code="invalid_value"
        )
    if end <= start:
        raise InvalidRequest(
            "ending_before must be after starting_on.", param="ending_before", code="invalid_value"
        )
    if end - start > MAX_WINDOW:
        raise InvalidRequest(
            "ending_before must be at most 14 days after starting_on.",
            param="ending_before",
            code="invalid_value",
        )
    return start, end


def _token_event(
    bucket: datetime,
    base_model: str,
    session_id: str | None,
    info: TrainingEvent | SamplingPrefillEvent | SamplingSampleEvent,
    rate: float,
    cost: Callable[[Settings, str, int], float],
    settings: Settings,
) -> BillingUsageEvent:
    return BillingUsageEvent(
        bucket_start=bucket,
        bucket_end=bucket + HOUR,
        base_model=base_model,
        session_id=session_id,
        estimated_cost_usd=cost(settings, base_model, info.token_count),
        effective_rate_usd_per_million_tokens=rate,
        event_info=info,
    )


def _metadata(value: dict[str, object] | None) -> dict[str, str] | None:
    """A session's `user_metadata` as the SDK types it (strings; any other value as its JSON)."""
    if value is None:
        return None
    return {k: v if isinstance(v, str) else json.dumps(v) for k, v in value.items()}


async def usage_events(
    res: Resources, who: Principal, starting_on: str, ending_before: str
) -> BillingUsageResponse:
    """`GET /api/v1/billing/usage/events` (see the module)."""
    start, end = window(starting_on, ending_before, datetime.now(UTC))
    org, settings = who.organization_id, res.settings
    async with res.pool.acquire() as conn:
        completions = await store.completion_hours(conn, org_id=org, start=start, end=end)
        trained = await store.training_hours(conn, org_id=org, start=start, end=end)
        checkpoints = await store.checkpoint_hours(conn, org_id=org, start=start, end=end)
    events: list[BillingUsageEvent] = []
    for c in completions:
        price = settings.price_of(c.base_model)
        if c.tinker_pass:
            if c.prompt_tokens:
                info = TrainingEvent(token_count=c.prompt_tokens)
                rate = price.input_per_million  # billed as the prompt tokens they are metered as
                events.append(
                    _token_event(c.bucket, c.base_model, c.session_id, info, rate, input_cost, settings)
                )
            continue
        if c.prompt_tokens:
            prefill = SamplingPrefillEvent(token_count=c.prompt_tokens)
            events.append(
                _token_event(
                    c.bucket, c.base_model, None, prefill, price.input_per_million, input_cost, settings
                )
            )
        if c.completion_tokens:
            sample = SamplingSampleEvent(token_count=c.completion_tokens)
            events.append(
                _token_event(
                    c.bucket, c.base_model, None, sample, price.output_per_million, output_cost, settings
                )
            )
    for t in trained:
        if t.trained_tokens:
            info = TrainingEvent(token_count=t.trained_tokens)
            rate = settings.price_of(t.base_model).training_per_million
            events.append(
                _token_event(t.bucket, t.base_model, None, info, rate, training_tokens_cost, settings)
            )
    for k in checkpoints:
        events.append(
            BillingUsageEvent(
                bucket_start=k.bucket,
                bucket_end=k.bucket + HOUR,
                base_model=k.base_model,
                session_id=k.session_id,
                event_info=CheckpointEvent(count=k.count),
            )
        )
    events.sort(
        key=lambda e: (
            e.bucket_start,
            -e.token_count(),
            e.event_info.type,
            e.base_model or "",
            e.session_id or "",
        )
    )
    session_ids = sorted({e.session_id for e in events if e.session_id is not None})
    rows = await store.session_metadata(res.pool, org_id=org, session_ids=session_ids) if session_ids else []
    sessions = {r.id: BillingUsageSession(user_metadata=_metadata(r.user_metadata)) for r in rows}
    return BillingUsageResponse(data=events, sessions=sessions, cost_data_through=None)


async def checkpoint_storage(
    res: Resources, who: Principal, project_id: str | None
) -> CurrentCheckpointStorageUsageResponse:
    """`GET /api/v1/billing/usage/checkpoints/current`: the organisation's checkpoints that have not expired
    (no item when it has none). tunegate has no projects or users, so there is one item (a `project_id` is a
    400), and no storage price, so no rate or projected cost."""
    if project_id is not None:
        raise InvalidRequest(
            "tunegate has no projects: leave project_id out for the organization's checkpoints.",
            param="project_id",
            code="invalid_value",
        )
    now = await store.storage_now(res.pool, org_id=who.organization_id)
    items = []
    if now.checkpoint_count:
        items.append(
            CurrentCheckpointStorageUsageItem(
                checkpoint_count=now.checkpoint_count,
                size_bytes=now.size_bytes,
                size_gigabytes=now.size_bytes / BYTES_PER_GIGABYTE,
            )
        )
    return CurrentCheckpointStorageUsageResponse(data=items)

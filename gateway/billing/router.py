"""Admin API: the billing outbox (what was sent to Stripe and what waits), and a manual billing pass."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Query

from gateway.billing import outbox, store
from gateway.billing.store import OutboxRow
from gateway.deps import AdminDep, ResourcesDep
from gateway.errors import InvalidRequest
from gateway.timeutil import ts

router = APIRouter(prefix="/v1/admin/billing", dependencies=[AdminDep], tags=["admin"])


def _row(r: OutboxRow) -> dict[str, Any]:
    return {
        "object": "billing.meter_event",
        "id": str(r.id),
        "identifier": r.identifier,
        "organization_id": r.organization_id,
        "stripe_customer_id": r.stripe_customer_id,
        "meter": r.meter,
        "event_name": r.event_name,
        "window_start": ts(r.window_start),
        "value": r.value,
        "status": r.status,
        "attempts": r.attempts,
        "last_error": r.last_error,
        "created_at": ts(r.created_at),
        "sent_at": ts(r.sent_at),
    }


@router.get("/outbox")
async def list_outbox(
    res: ResourcesDep,
    organization_id: str | None = None,
    status: str | None = None,
    after: str | None = None,
    limit: int = Query(default=100, ge=1, le=1000),
) -> dict[str, Any]:
    """Outbox rows, newest first; `status` is `pending` or `sent`; page with `after=<last id>`."""
    before = None
    if after:
        before = int(after) if after.isascii() and after.isdigit() and len(after) <= 18 else None
        if before is None:
            raise InvalidRequest("after must be an outbox row's id.", param="after", code="invalid_value")
    rows = await store.list_outbox(
        res.pool, org_id=organization_id, status=status, before=before, limit=limit + 1
    )
    data = [_row(r) for r in rows[:limit]]
    return {
        "object": "list",
        "data": data,
        "has_more": len(rows) > limit,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
    }


@router.post("/run")
async def run_billing(res: ResourcesDep) -> dict[str, int]:
    """Aggregate unbilled usage and send pending meter events now (the worker does this periodically)."""
    return await outbox.run_billing(res.pool, res.settings)

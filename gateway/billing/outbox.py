"""Stripe billing through an outbox: exactly-once meter events across crashes and retries.

1. `aggregate()` — meter the bytes kept in capture up to now (`gateway.usage.storage`), then, in one
   transaction, under an advisory lock: mark every unbilled usage row of organisations
   that have a Stripe customer as billed, and insert one outbox row per (organisation, meter, window) with
   the sums. The row's `identifier` (`tg:<org>:<meter>:<window start>:<row id>`) never changes afterwards.
2. `send_pending()` — send each pending row as a Stripe meter event carrying that identifier (and the same
   idempotency key), so a retry, a second worker or a restart after a crash between "sent" and "marked" is
   deduplicated by Stripe; 429 and 5xx are retried with backoff; a row that still fails stays pending with
   its error and is tried again next run. Rows of one (customer, meter) are sent one at a time, as Stripe
   asks; different ones concurrently.

Nothing here is on the serving path: the worker's periodic task runs `run_billing()`. The SQL lives in
`gateway.billing.store`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import defaultdict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import asyncpg

from gateway.billing import store
from gateway.billing.store import OutboxRow
from gateway.settings import Settings
from gateway.usage import storage

logger = logging.getLogger(__name__)

MAX_EVENT_AGE_S = 30 * 24 * 3600  # Stripe takes timestamps up to 35 days old
BACKOFF_S = 0.2


def event_names(settings: Settings) -> dict[str, str]:
    """Stripe meter event name of each meter."""
    return {
        "input_tokens": settings.stripe_meter_input_tokens,
        "output_tokens": settings.stripe_meter_output_tokens,
        "training_tokens": settings.stripe_meter_training_tokens,
        "training_seconds": settings.stripe_meter_training_seconds,
        "capture_byte_hours": settings.stripe_meter_capture_storage,
    }


async def aggregate(pool: asyncpg.Pool, settings: Settings) -> int:
    """Move unbilled usage into outbox rows; returns the rows made. Safe to run anywhere, any time. The bytes
    kept in capture are metered up to now first (`gateway.usage.storage`)."""
    await storage.meter(pool)
    names = event_names(settings)
    width = timedelta(seconds=settings.billing_window_s)
    made = 0
    async with pool.acquire() as conn, conn.transaction():
        await store.lock_billing(conn)
        for total in await store.mark_unbilled(conn, width=width):
            await store.add_outbox_row(conn, total=total, event_name=names[total.meter])
            made += 1
    return made


@dataclass
class SendReport:
    sent: int = 0
    failed: int = 0


def make_client(settings: Settings) -> Any:
    """The official Stripe client, async over httpx, pointed at `stripe_api_base` when set."""
    import stripe

    assert settings.stripe_api_key is not None
    base = settings.stripe_api_base
    return stripe.StripeClient(
        settings.stripe_api_key.get_secret_value(),
        base_addresses={"api": base, "meter_events": base} if base else None,
        max_network_retries=settings.stripe_max_retries,
        http_client=stripe.HTTPXClient(),
    )


def _retryable(exc: BaseException) -> bool:
    import stripe

    if isinstance(exc, stripe.RateLimitError | stripe.APIConnectionError):
        return True
    status = getattr(exc, "http_status", None)
    return isinstance(exc, stripe.StripeError) and (status is None or status == 429 or status >= 500)


def _already_recorded(exc: BaseException) -> bool:
    """Stripe's answer for an identifier it has seen: the event counts once, so the row is done."""
    text = str(exc).lower()
    return "identifier" in text and ("already" in text or "duplicate" in text)


async def _send_one(client: Any, row: OutboxRow, attempts: int) -> None:
    timestamp = int(max(row.window_start.timestamp(), time.time() - MAX_EVENT_AGE_S))
    params = {
        "event_name": row.event_name,
        "identifier": row.identifier,
        "timestamp": timestamp,
        "payload": {"stripe_customer_id": row.stripe_customer_id, "value": str(row.value)},
    }
    for attempt in range(attempts + 1):
        try:
            await client.v1.billing.meter_events.create_async(
                params, options={"idempotency_key": row.identifier}
            )
            return
        except Exception as exc:
            if _already_recorded(exc):
                return
            if attempt >= attempts or not _retryable(exc):
                raise
            await asyncio.sleep(BACKOFF_S * 2**attempt)


async def send_pending(pool: asyncpg.Pool, settings: Settings, *, batch: int = 1000) -> SendReport:
    """Send pending outbox rows to Stripe; returns how many were sent and how many failed this time."""
    report = SendReport()
    if settings.stripe_api_key is None:
        return report
    rows = await store.pending(pool, limit=batch)
    if not rows:
        return report
    client = make_client(settings)
    lanes: dict[tuple[str | None, str], list[OutboxRow]] = defaultdict(list)
    for r in rows:
        lanes[(r.stripe_customer_id, r.event_name)].append(r)
    gate = asyncio.Semaphore(16)

    async def lane(items: list[OutboxRow]) -> None:
        async with gate:
            for r in items:
                try:
                    await _send_one(client, r, settings.stripe_max_retries)
                except Exception as exc:  # noqa: BLE001 - any failure leaves the row pending
                    report.failed += 1
                    logger.warning("meter event %s not sent: %s", r.identifier, exc)
                    await store.mark_failed(pool, row_id=r.id, error=str(exc)[:500])
                    continue
                await store.mark_sent(pool, row_id=r.id)
                report.sent += 1

    await asyncio.gather(*(lane(v) for v in lanes.values()))
    return report


async def run_billing(pool: asyncpg.Pool, settings: Settings) -> dict[str, int]:
    """One billing pass: aggregate, then send."""
    made = await aggregate(pool, settings)
    report = await send_pending(pool, settings)
    if made or report.sent or report.failed:
        logger.info("billing: %d outbox rows made, %d sent, %d failed", made, report.sent, report.failed)
    return {"aggregated": made, "sent": report.sent, "failed": report.failed}

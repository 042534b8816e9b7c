"""Billing: the outbox's plain SQL, and the frozen rows it returns.

`mark_unbilled` and `add_outbox_row` run in one transaction under `lock_billing`; see `gateway.billing.outbox`
for the protocol they serve.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from gateway.db import Conn, rows_to

BILLING_LOCK_ID = 0x7462_696C  # "tbil"

MARK_COMPLETIONS = """
WITH picked AS (
    UPDATE completion_usage u SET billed = true
    FROM organization_billing b
    WHERE NOT u.billed AND b.organization_id = u.organization_id AND b.stripe_customer_id IS NOT NULL
    RETURNING u.organization_id, u.created_at, u.prompt_tokens, u.completion_tokens
)
SELECT organization_id, date_bin($1::interval, created_at, 'epoch'::timestamptz) AS window_start,
       sum(prompt_tokens)::bigint AS input_tokens, sum(completion_tokens)::bigint AS output_tokens
FROM picked GROUP BY 1, 2"""
MARK_TRAINING = """
WITH picked AS (
    UPDATE training_usage u SET billed = true
    FROM organization_billing b
    WHERE NOT u.billed AND b.organization_id = u.organization_id AND b.stripe_customer_id IS NOT NULL
    RETURNING u.organization_id, u.created_at, u.trained_tokens, u.training_seconds
)
SELECT organization_id, date_bin($1::interval, created_at, 'epoch'::timestamptz) AS window_start,
       sum(trained_tokens)::bigint AS training_tokens,
       round(sum(training_seconds))::bigint AS training_seconds
FROM picked GROUP BY 1, 2"""
MARK_CAPTURE_STORAGE = """
WITH picked AS (
    UPDATE capture_storage_usage u SET billed = true
    FROM organization_billing b
    WHERE NOT u.billed AND b.organization_id = u.organization_id AND b.stripe_customer_id IS NOT NULL
    RETURNING u.organization_id, u.created_at, u.byte_seconds
)
SELECT organization_id, date_bin($1::interval, created_at, 'epoch'::timestamptz) AS window_start,
       round(sum(byte_seconds) / 3600.0)::bigint AS capture_byte_hours
FROM picked GROUP BY 1, 2"""
INSERT_OUTBOX = """
WITH n AS (SELECT nextval(pg_get_serial_sequence('billing_outbox', 'id')) AS id)
INSERT INTO billing_outbox (id, identifier, organization_id, stripe_customer_id, meter, event_name,
    window_start, value)
SELECT n.id, 'tg:' || $1 || ':' || $3 || ':' || extract(epoch FROM $5::timestamptz)::bigint || ':' || n.id,
       $1, (SELECT stripe_customer_id FROM organization_billing WHERE organization_id = $1), $3, $4, $5, $2
FROM n"""
PENDING = """
SELECT * FROM billing_outbox WHERE status = 'pending' ORDER BY id LIMIT $1"""
MARK_SENT = (
    "UPDATE billing_outbox SET status = 'sent', sent_at = now(), attempts = attempts + 1 WHERE id = $1"
)
MARK_FAILED = "UPDATE billing_outbox SET attempts = attempts + 1, last_error = $2 WHERE id = $1"
LIST = """
SELECT * FROM billing_outbox
WHERE ($1::text IS NULL OR organization_id = $1) AND ($2::text IS NULL OR status = $2)
  AND ($3::bigint IS NULL OR id < $3)
ORDER BY id DESC LIMIT $4"""

# The meters each marking statement sums, in the order their outbox rows are made.
_MARKS = (
    (MARK_COMPLETIONS, ("input_tokens", "output_tokens")),
    (MARK_TRAINING, ("training_tokens", "training_seconds")),
    (MARK_CAPTURE_STORAGE, ("capture_byte_hours",)),
)


@dataclass(frozen=True, slots=True)
class MeterSum:
    """Newly billed usage of one organisation, meter and window: one outbox row to make."""

    organization_id: str
    window_start: datetime
    meter: str
    value: int


@dataclass(frozen=True, slots=True)
class OutboxRow:
    id: int
    identifier: str
    """`tg:<org>:<meter>:<window start>:<row id>`: Stripe's identifier and idempotency key of the event."""
    organization_id: str
    stripe_customer_id: str | None
    meter: str
    event_name: str
    window_start: datetime
    value: int
    status: str
    attempts: int
    last_error: str | None
    created_at: datetime
    sent_at: datetime | None


async def lock_billing(conn: Conn) -> None:
    """Hold the billing lock until the caller's transaction ends (one aggregation at a time)."""
    await conn.execute("SELECT pg_advisory_xact_lock($1)", BILLING_LOCK_ID)


async def mark_unbilled(conn: Conn, *, width: timedelta) -> list[MeterSum]:
    """Mark every unbilled usage row of organisations that have a Stripe customer as billed; returns their
    sums per organisation, window (`width` wide, from the epoch) and meter, leaving out zero sums."""
    sums: list[MeterSum] = []
    for sql, meters in _MARKS:
        for record in await conn.fetch(sql, width):
            for meter in meters:
                value = record[meter]
                if value:
                    sums.append(
                        MeterSum(record["organization_id"], record["window_start"], meter, int(value))
                    )
    return sums


async def add_outbox_row(conn: Conn, *, total: MeterSum, event_name: str) -> None:
    """One pending outbox row for `total`, with its identifier and the organisation's Stripe customer."""
    await conn.execute(
        INSERT_OUTBOX, total.organization_id, total.value, total.meter, event_name, total.window_start
    )


async def pending(conn: Conn, *, limit: int) -> list[OutboxRow]:
    """The oldest rows not yet sent."""
    return rows_to(OutboxRow, await conn.fetch(PENDING, limit))


async def mark_sent(conn: Conn, *, row_id: int) -> None:
    await conn.execute(MARK_SENT, row_id)


async def mark_failed(conn: Conn, *, row_id: int, error: str) -> None:
    """Count a failed attempt; the row stays pending."""
    await conn.execute(MARK_FAILED, row_id, error)


async def list_outbox(
    conn: Conn, *, org_id: str | None, status: str | None, before: int | None, limit: int
) -> list[OutboxRow]:
    """Rows newest first; `before`: only rows of a lower id."""
    return rows_to(OutboxRow, await conn.fetch(LIST, org_id, status, before, limit))

"""Stored bytes of capture over time, metered as tokens are.

Migration 0021 keeps, per organisation, the bytes its captured records store (`capture_storage`, kept right
by triggers on every insert, rewrite and delete, a record's bytes counted until it is deleted or expires)
and the byte-seconds accrued since the last pass. `meter()`, run before every billing aggregation, accrues
every organisation up to now and moves its whole byte-seconds into `capture_storage_usage` rows, which the
usage and costs APIs read and the billing outbox marks and sends (`capture_byte_hours`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

import asyncpg

from gateway.db import Conn, rows_to

ORGS = "SELECT organization_id FROM capture_storage WHERE bytes > 0 OR pending >= 1 ORDER BY organization_id"
"""Organisations with something to meter (one that keeps nothing accrues nothing until a record comes)."""
METER = "SELECT capture_storage_meter($1, $2)"
NOW = "SELECT clock_timestamp()"
BUCKETS = """
SELECT date_bin($2::interval, created_at, $3::timestamptz) AS bucket,
       sum(byte_seconds)::bigint AS byte_seconds
FROM capture_storage_usage
WHERE organization_id = $1 AND created_at >= $3 AND created_at < $4
GROUP BY 1 ORDER BY 1"""
KEPT = "SELECT bytes FROM capture_storage WHERE organization_id = $1"

SECONDS_PER_DAY = 86_400
GB = 1_000_000_000


@dataclass(frozen=True, slots=True)
class StorageBucket:
    bucket: datetime
    byte_seconds: int


async def meter(pool: asyncpg.Pool) -> int:
    """Accrue every organisation's stored bytes up to now, one organisation per transaction (no pass holds
    more than one organisation's row); how many usage rows were made."""
    at = await pool.fetchval(NOW)
    made = 0
    for record in await pool.fetch(ORGS):
        made += bool(await pool.fetchval(METER, record["organization_id"], at))
    return made


async def buckets(
    conn: Conn, *, org_id: str, width: timedelta, start: datetime, end: datetime
) -> list[StorageBucket]:
    """Byte-seconds metered per bucket of `[start, end)`."""
    return rows_to(StorageBucket, await conn.fetch(BUCKETS, org_id, width, start, end))


async def kept_bytes(conn: Conn, *, org_id: str) -> int:
    """The bytes the organisation's live records store (as of the last change or pass)."""
    value = await conn.fetchval(KEPT, org_id)
    return int(value or 0)

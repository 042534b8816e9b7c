"""Dashboard sessions and the job metrics the job page plots: plain SQL."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gateway.db import Conn, maybe_row_to

INSERT_SESSION = """
INSERT INTO dashboard_sessions
    (id_digest, organization_id, api_key_id, is_admin, sealed, csrf_token, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7))"""
# A session lives while it has not expired and, for an organisation's key, while that key is live.
GET_SESSION = """
SELECT s.organization_id, s.api_key_id, s.is_admin, s.sealed, s.csrf_token
FROM dashboard_sessions s
LEFT JOIN api_keys k ON k.id = s.api_key_id
WHERE s.id_digest = $1 AND s.expires_at > now()
  AND (s.is_admin OR (k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())))"""
DELETE_SESSION = "DELETE FROM dashboard_sessions WHERE id_digest = $1"
DELETE_EXPIRED = "DELETE FROM dashboard_sessions WHERE expires_at <= now()"

# The metrics events of a job after a cursor, oldest first, thinned in the database to every `$4`-th one (the
# stride that keeps at most `$4` rows) and the last; the job's organisation guards every row.
JOB_METRICS = """
SELECT seq, data, total, stride FROM (
    SELECT seq, data, n, total, greatest(1, ceil(total::float8 / $4))::int AS stride FROM (
        SELECT seq, data, row_number() OVER (ORDER BY seq) AS n, count(*) OVER () AS total
        FROM fine_tuning_job_events
        WHERE job_id = $1 AND organization_id = $2 AND type = 'metrics' AND seq > $3
    ) numbered
) strided
WHERE (n - 1) % stride = 0 OR n = total
ORDER BY seq"""
JOB_EXISTS = "SELECT 1 FROM fine_tuning_jobs WHERE id = $1 AND organization_id = $2"


async def insert_session(
    conn: Conn,
    *,
    id_digest: bytes,
    org_id: str | None,
    api_key_id: str | None,
    is_admin: bool,
    sealed: bytes,
    csrf_token: str,
    ttl_s: float,
) -> None:
    await conn.execute(INSERT_SESSION, id_digest, org_id, api_key_id, is_admin, sealed, csrf_token, ttl_s)


@dataclass(frozen=True, slots=True)
class SessionRow:
    """A live sign-in session (expired ones and those of revoked keys are never returned)."""

    organization_id: str | None
    api_key_id: str | None
    is_admin: bool
    sealed: bytes
    """The key, XORed with the pad only the browser's cookie holds."""
    csrf_token: str


async def get_session(conn: Conn, *, id_digest: bytes) -> SessionRow | None:
    return maybe_row_to(SessionRow, await conn.fetchrow(GET_SESSION, id_digest))


async def delete_session(conn: Conn, *, id_digest: bytes) -> None:
    await conn.execute(DELETE_SESSION, id_digest)


async def delete_expired(conn: Conn) -> None:
    await conn.execute(DELETE_EXPIRED)


async def job_exists(conn: Conn, *, org_id: str, job_id: str) -> bool:
    return await conn.fetchval(JOB_EXISTS, job_id, org_id) is not None


async def job_metrics(
    conn: Conn, *, org_id: str, job_id: str, after_seq: int, points: int
) -> tuple[list[dict[str, Any]], int, int, int]:
    """The job's metrics events after `after_seq` (one writer per job writes them in step order), thinned
    to about `points`: `(data of the rows kept, rows read, stride, the cursor of the next call)`."""
    rows = await conn.fetch(JOB_METRICS, job_id, org_id, after_seq, points)
    if not rows:
        return [], 0, 1, after_seq
    return [r["data"] for r in rows], rows[0]["total"], rows[0]["stride"], rows[-1]["seq"]

"""A fine-tuning job while a worker holds it: its lease (`JOB_LEASE`, `gateway.work.lease`), and what an
attempt writes: heartbeats, checkpoints, the job's files and metrics, its training usage and its end.

A worker acts for every organisation, so these statements take a job id; each row written still carries the
job's organisation. Every change of a held job is guarded by the worker still holding it.
"""

from __future__ import annotations

import logging
from typing import Any

import asyncpg

from gateway.db import Conn, maybe_row_to
from gateway.ids import new_id
from gateway.jobs import store
from gateway.jobs.store import JobRow
from gateway.queue import RUN_JOB
from gateway.settings import Settings
from gateway.tenancy import scoped
from gateway.work.lease import Lease, StaleWork

logger = logging.getLogger(__name__)


def key_name(job_id: str) -> str:
    """The name of the keys minted for a job's trainers (the reaper revokes them by it)."""
    return f"job {job_id}"


CLAIM = """
UPDATE fine_tuning_jobs j
SET status = 'running', worker_id = $2, heartbeat_at = now(), attempts = j.attempts + 1,
    started_at = coalesce(j.started_at, now()),
    -- an attempt starts from the last checkpoint: steps reported after it are trained again
    current_step = coalesce((SELECT c.step_number FROM fine_tuning_job_checkpoints c
                             WHERE c.job_id = j.id AND c.path = j.last_checkpoint), j.current_step)
WHERE j.id = $1 AND j.status = 'queued' AND j.worker_id IS NULL
RETURNING j.*"""
# The lease's beat (`gateway.work.lease`); a trainer's beat also records its step (`HEARTBEAT`).
BEAT = "UPDATE fine_tuning_jobs SET heartbeat_at = now() WHERE id = $1 AND worker_id = $2 RETURNING status"
HEARTBEAT = """
UPDATE fine_tuning_jobs SET heartbeat_at = now(), current_step = coalesce($3, current_step)
WHERE id = $1 AND worker_id = $2 RETURNING status"""
RELEASE = "UPDATE fine_tuning_jobs SET worker_id = NULL WHERE id = $1 AND worker_id = $2 RETURNING *"
REQUEUE_OWN = """
UPDATE fine_tuning_jobs
SET status = 'queued', worker_id = NULL, queued_at = now(), queue_generation = queue_generation + 1
WHERE id = $1 AND worker_id = $2 AND status = 'running' RETURNING queue_generation"""
FAIL_OWN = """
UPDATE fine_tuning_jobs SET status = 'failed', error = $3, finished_at = now(), worker_id = NULL
WHERE id = $1 AND worker_id = $2 AND status = 'running' RETURNING *"""
SUCCEED_OWN = """
UPDATE fine_tuning_jobs
SET status = 'succeeded', fine_tuned_model = $3, trained_tokens = $4, result_files = $5, finished_at = now(),
    worker_id = NULL, current_step = $6
WHERE id = $1 AND worker_id = $2 AND status = 'running' RETURNING *"""
# Budget reached: the job this worker runs turns paused (the heartbeat then stops its trainer).
PAUSE_OWN = """
UPDATE fine_tuning_jobs SET status = 'paused'
WHERE id = $1 AND worker_id = $2 AND status = 'running' RETURNING *"""
SET_CHECKPOINT = "UPDATE fine_tuning_jobs SET last_checkpoint = $2 WHERE id = $1"
INSERT_CHECKPOINT = """
INSERT INTO fine_tuning_job_checkpoints (id, job_id, organization_id, step_number, metrics,
    fine_tuned_model_checkpoint, path, version)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (job_id, step_number) DO NOTHING"""
CHECKPOINT_METRICS = "SELECT step_number, metrics FROM fine_tuning_job_checkpoints WHERE job_id = $1"
# A guard's rollback: the paused job, let go, resumes from an earlier checkpoint than its last.
RESUME_FROM_STEP = """
UPDATE fine_tuning_jobs j SET last_checkpoint = c.path
FROM fine_tuning_job_checkpoints c
WHERE j.id = $1 AND c.job_id = j.id AND c.step_number = $2 AND j.status = 'paused' AND j.worker_id IS NULL"""
GUARDS_PAUSED = """
SELECT DISTINCT split_part(dedup_key, ':', 2) AS name FROM fine_tuning_job_events
WHERE job_id = $1 AND dedup_key LIKE 'guard_paused:%'"""
EARLIER_METRICS = """
SELECT data FROM fine_tuning_job_events
WHERE job_id = $1 AND type = 'metrics' AND (data ->> 'step')::int < $2
ORDER BY (data ->> 'step')::int"""
QUEUED_UNCLAIMED = """
SELECT id, queue_generation FROM fine_tuning_jobs WHERE status = 'queued' AND worker_id IS NULL
ORDER BY queued_at LIMIT 1000"""
# Jobs whose worker stopped proving it is alive; `attempts` decides between a re-queue and a failure.
STALE = """
SELECT id, organization_id, attempts, worker_id, last_checkpoint FROM fine_tuning_jobs
WHERE worker_id IS NOT NULL AND heartbeat_at < now() - make_interval(secs => $1)"""
REQUEUE_STALE = """
UPDATE fine_tuning_jobs
SET status = CASE WHEN status = 'running' THEN 'queued' ELSE status END,
    worker_id = NULL,
    queued_at = CASE WHEN status = 'running' THEN now() ELSE queued_at END,
    queue_generation = queue_generation + CASE WHEN status = 'running' THEN 1 ELSE 0 END
WHERE id = $1 AND worker_id = $2 RETURNING status = 'queued' AS queued, queue_generation"""
FAIL_STALE = """
UPDATE fine_tuning_jobs SET status = 'failed', error = $3, finished_at = now(), worker_id = NULL
WHERE id = $1 AND worker_id = $2 AND status = 'running' RETURNING *"""
INSERT_TRAINING_USAGE = """
INSERT INTO training_usage (organization_id, job_id, base_model, method, trained_tokens, steps,
    training_seconds, outcome)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)"""
RECORDED_TOKENS = "SELECT coalesce(sum(trained_tokens), 0)::bigint FROM training_usage WHERE job_id = $1"
# The blob of a job's training, validation or environment file (gone when the file was deleted meanwhile).
FILE_BLOB_KEY = "SELECT blob_key FROM files WHERE id = $1 AND organization_id = $2"
JOB_METRICS = "SELECT data FROM fine_tuning_job_events WHERE job_id = $1 AND type = 'metrics' ORDER BY seq"
INSERT_RESULT_FILE = """
INSERT INTO files (id, organization_id, filename, purpose, bytes, sha256, status, blob_key)
VALUES ($1, $2, $3, 'fine-tune-results', $4, $5, 'processed', $6)"""


async def claim(conn: Conn, *, job_id: str, worker_id: str) -> JobRow | None:
    """Take queued job `job_id` (None when another worker took it first)."""
    return maybe_row_to(JobRow, await conn.fetchrow(CLAIM, job_id, worker_id))


async def heartbeat(conn: Conn, *, job_id: str, worker_id: str, step: int | None) -> str | None:
    """Returns the job's status, or None when this worker no longer holds the job."""
    return await conn.fetchval(HEARTBEAT, job_id, worker_id, step)


async def release(conn: Conn, *, job_id: str, worker_id: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(RELEASE, job_id, worker_id))


async def requeue_own(conn: Conn, *, job_id: str, worker_id: str) -> int | None:
    """Queue the running job this worker holds again: its new queue generation (None: it no longer runs
    here)."""
    generation: int | None = await conn.fetchval(REQUEUE_OWN, job_id, worker_id)
    return generation


async def pause_own(conn: Conn, *, job_id: str, worker_id: str) -> JobRow | None:
    """Pause the running job this worker holds (None when it is no longer running here)."""
    return maybe_row_to(JobRow, await conn.fetchrow(PAUSE_OWN, job_id, worker_id))


async def fail_own(conn: Conn, *, job_id: str, worker_id: str, error: dict[str, Any]) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(FAIL_OWN, job_id, worker_id, error))


async def succeed_own(
    conn: Conn,
    *,
    job_id: str,
    worker_id: str,
    model: str,
    trained_tokens: int,
    result_files: list[str],
    step: int,
) -> JobRow | None:
    return maybe_row_to(
        JobRow, await conn.fetchrow(SUCCEED_OWN, job_id, worker_id, model, trained_tokens, result_files, step)
    )


async def add_checkpoint(
    conn: Conn,
    *,
    job_id: str,
    org_id: str,
    step: int,
    metrics: dict[str, Any],
    model_name: str,
    path: str,
    version: str | None,
) -> None:
    await conn.execute(
        INSERT_CHECKPOINT, new_id("ftckpt_"), job_id, org_id, step, metrics, model_name, path, version
    )
    await conn.execute(SET_CHECKPOINT, job_id, path)


async def checkpoint_metrics(conn: Conn, *, job_id: str) -> list[tuple[int, dict[str, Any] | None]]:
    """`(step, metrics)` of each of the job's checkpoints."""
    return [(r["step_number"], r["metrics"]) for r in await conn.fetch(CHECKPOINT_METRICS, job_id)]


async def resume_from_step(conn: Conn, *, job_id: str, step: int) -> None:
    """Point a paused job, no longer held, at its checkpoint of `step`: it resumes from there."""
    await conn.execute(RESUME_FROM_STEP, job_id, step)


async def guards_paused(conn: Conn, *, job_id: str) -> set[str]:
    """The guards that paused an attempt of the job (their events say so)."""
    return {r["name"] for r in await conn.fetch(GUARDS_PAUSED, job_id)}


async def metrics_before(conn: Conn, *, job_id: str, step: int) -> list[dict[str, Any]]:
    """The data of the job's metrics events of the steps before `step` (earlier attempts'), oldest first."""
    return [r["data"] for r in await conn.fetch(EARLIER_METRICS, job_id, step)]


async def file_blob_key(conn: Conn, *, file_id: str, org_id: str) -> str | None:
    """The blob key of one of the organisation's files, None when there is no such file."""
    key: str | None = await conn.fetchval(FILE_BLOB_KEY, file_id, org_id)
    return key


async def job_metrics(conn: Conn, *, job_id: str) -> list[dict[str, Any]]:
    """The data of a job's metrics events, in the order they were recorded."""
    return [row["data"] for row in await conn.fetch(JOB_METRICS, job_id) if row["data"]]


async def add_result_file(
    conn: Conn, *, file_id: str, org_id: str, filename: str, size: int, sha256: str, blob_key: str
) -> None:
    await conn.execute(INSERT_RESULT_FILE, file_id, org_id, filename, size, sha256, blob_key)


async def add_training_usage(
    conn: Conn,
    *,
    org_id: str,
    job_id: str,
    base_model: str,
    method: str,
    trained_tokens: int,
    steps: int,
    seconds: float,
    outcome: str,
) -> None:
    """One trainer attempt's progress (call in the transaction that changes the job's state)."""
    await conn.execute(
        INSERT_TRAINING_USAGE, org_id, job_id, base_model, method, trained_tokens, steps, seconds, outcome
    )


async def recorded_tokens(conn: Conn, *, job_id: str) -> int:
    """Trained tokens already metered for a job (earlier attempts)."""
    return int(await conn.fetchval(RECORDED_TOKENS, job_id))


# -- the lease -------------------------------------------------------------------------------------------


async def _revoke_keys(pool: asyncpg.Pool, row: StaleWork) -> None:
    """Revoke the keys minted for a lost worker's trainers (a trainer dies with its worker; its key would
    live on until it expires). Before the job is re-queued, so the key of its next attempt is never among
    them."""
    for key_id in await scoped.revoke_named(
        pool, org_id=row.organization_id, kind="job", name=key_name(row.id)
    ):
        logger.info("job %s: revoked key %s of its lost worker %s", row.id, key_id, row.worker_id)


def _give_up(row: StaleWork, settings: Settings) -> dict[str, Any]:
    message = f"The job's worker was lost {row.attempts} times; giving up."
    return {"code": "max_attempts_exceeded", "param": None, "message": message}


async def _failed(conn: Conn, row: StaleWork, error: dict[str, Any]) -> None:
    await store.add_event(
        conn,
        job_id=row.id,
        org_id=row.organization_id,
        level="error",
        message=error["message"],
        dedup_key="failed",
    )


async def _requeued(conn: Conn, row: StaleWork, generation: int) -> None:
    resumes = " and will resume from its last checkpoint" if row.row["last_checkpoint"] else ""
    await store.add_event(
        conn,
        job_id=row.id,
        org_id=row.organization_id,
        level="warn",
        message=f"The job's worker stopped responding; the job was re-queued{resumes}",
        dedup_key=f"requeued:{generation}",
    )


JOB_LEASE = Lease(
    kind="job",
    function=RUN_JOB,
    claim=CLAIM,
    heartbeat=BEAT,
    release=RELEASE,
    queued_unclaimed=QUEUED_UNCLAIMED,
    stale=STALE,
    fail_stale=FAIL_STALE,
    give_up=_give_up,
    requeue_own=REQUEUE_OWN,
    requeue_stale=REQUEUE_STALE,
    on_stale=_revoke_keys,
    on_failed=_failed,
    on_requeued=_requeued,
)

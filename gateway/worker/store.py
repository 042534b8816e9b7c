"""The worker's SQL: claiming, heartbeats, events, checkpoints, a job's files and metrics, and the end of a
job.

A worker acts for every organisation, so these statements take a job id; each row written still carries
the job's organisation.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from gateway.db import Conn, maybe_row_to, rows_to
from gateway.ids import new_id
from gateway.jobs.store import JobRow


@dataclass(frozen=True, slots=True)
class QueuedJob:
    """A queued job no worker holds: what its queue message needs."""

    id: str
    queue_generation: int


@dataclass(frozen=True, slots=True)
class StaleJob:
    """A job whose worker stopped heartbeating."""

    id: str
    organization_id: str
    attempts: int
    worker_id: str
    last_checkpoint: str | None


# The fairest work that fits the free devices, of both kinds a worker runs on its devices: queued jobs and
# Tinker training models waiting for a holder (open requests, no worker). The organisation with the fewest
# running jobs and held models first, then the one that started either least recently, then the work that
# has waited longest. $3, when not null, is a held model whose holder asks whether to let its slot go
# (`gateway.tinker.holder`): it is ranked as if it waited, had just been taken (as `HAND_BACK_MODEL` records
# it), and had waited least of all.
FAIREST = """
WITH work AS (
    SELECT 'job' AS kind, j.id, j.organization_id, j.queued_at AS since, j.seq
    FROM fine_tuning_jobs j
    WHERE j.status = 'queued' AND j.worker_id IS NULL
      -- only a job whose devices (and a reinforcement job's generation devices) are free here
      AND coalesce((j.method #>> ARRAY[j.method->>'type', 'hyperparameters', 'gpus'])::int, 1)
          + CASE WHEN j.method->>'type' = 'reinforcement' THEN $2::int ELSE 0 END <= $1
    UNION ALL
    SELECT 'tinker', m.id, m.organization_id, w.since, m.seq
    FROM (SELECT model_id, min(created_at) AS since FROM tinker_requests
          WHERE status IN ('pending', 'running') AND model_id IS NOT NULL GROUP BY model_id) w
    JOIN tinker_models m ON m.id = w.model_id
    WHERE m.worker_id IS NULL AND m.lost IS NULL AND $1 >= 1
    UNION ALL
    SELECT 'tinker', m.id, m.organization_id, now(), m.seq FROM tinker_models m WHERE m.id = $3::text
)
SELECT w.kind, w.id FROM work w
ORDER BY (SELECT count(*) FROM fine_tuning_jobs r
          WHERE r.organization_id = w.organization_id AND r.status = 'running')
         + (SELECT count(*) FROM tinker_models t
            WHERE t.organization_id = w.organization_id AND t.worker_id IS NOT NULL
              AND t.id IS DISTINCT FROM $3::text),
         greatest((SELECT max(r.started_at) FROM fine_tuning_jobs r
                   WHERE r.organization_id = w.organization_id),
                  (SELECT max(t.held_at) FROM tinker_models t
                   WHERE t.organization_id = w.organization_id),
                  (SELECT now() FROM tinker_models t
                   WHERE t.id = $3::text AND t.organization_id = w.organization_id))
             NULLS FIRST,
         w.since, w.seq
LIMIT 1"""
# A held Tinker model lets its slot go for waiting work (`gateway.tinker.holder`), open requests or not. Its
# `held_at` becomes now, so that the claims that follow rank it as `FAIREST` did with the model as $3: after
# the work it let go for.
HAND_BACK_MODEL = """
UPDATE tinker_models SET worker_id = NULL, heartbeat_at = NULL, resume_path = $3, held_at = now()
WHERE id = $1 AND worker_id = $2 RETURNING id"""
MODEL_ASKED = """
SELECT EXISTS (SELECT 1 FROM tinker_requests WHERE model_id = $1 AND status IN ('pending', 'running'))"""
CLAIM = """
UPDATE fine_tuning_jobs j
SET status = 'running', worker_id = $2, heartbeat_at = now(), attempts = j.attempts + 1,
    started_at = coalesce(j.started_at, now()),
    -- an attempt starts from the last checkpoint: steps reported after it are trained again
    current_step = coalesce((SELECT c.step_number FROM fine_tuning_job_checkpoints c
                             WHERE c.job_id = j.id AND c.path = j.last_checkpoint), j.current_step)
WHERE j.id = $1 AND j.status = 'queued' AND j.worker_id IS NULL
RETURNING j.*"""
HEARTBEAT = """
UPDATE fine_tuning_jobs SET heartbeat_at = now(), current_step = coalesce($3, current_step)
WHERE id = $1 AND worker_id = $2 RETURNING status"""
RELEASE = "UPDATE fine_tuning_jobs SET worker_id = NULL WHERE id = $1 AND worker_id = $2 RETURNING *"
REQUEUE_OWN = """
UPDATE fine_tuning_jobs
SET status = 'queued', worker_id = NULL, queued_at = now(), queue_generation = queue_generation + 1
WHERE id = $1 AND worker_id = $2 AND status = 'running' RETURNING *"""
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
WHERE id = $1 AND worker_id = $2 RETURNING *"""
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


@dataclass(frozen=True, slots=True)
class Work:
    """What a worker may take next: a queued job or a Tinker model waiting for a holder."""

    kind: Literal["job", "tinker"]
    id: str


async def fairest(conn: Conn, *, free: int, generation: int = 0, holding: str | None = None) -> Work | None:
    """The fairest work that fits `free` devices (a reinforcement job takes `generation` more, a Tinker
    model one device), across organisations as `FAIREST` orders it; None when nothing waits. `holding`: a
    held model that would give its device back (counted in `free`), ranked among the waiting work as if it
    had just been taken; it is the answer when nothing else should have its device first."""
    return maybe_row_to(Work, await conn.fetchrow(FAIREST, free, generation, holding))


async def hand_back_model(conn: Conn, *, model_id: str, worker_id: str, resume_path: str) -> bool:
    """Let a held Tinker model go for work that waits, with its state saved at `resume_path`, whether or not
    requests of it are open (they wait for its next holder, which loads that state first). False when this
    worker no longer holds it."""
    return await conn.fetchval(HAND_BACK_MODEL, model_id, worker_id, resume_path) is not None


async def model_asked(conn: Conn, *, model_id: str) -> bool:
    """Whether requests of a Tinker model are open (so, once let go, it needs a wake-up of its own)."""
    return bool(await conn.fetchval(MODEL_ASKED, model_id))


async def claim(conn: Conn, *, job_id: str, worker_id: str) -> JobRow | None:
    """Take queued job `job_id` (None when another worker took it first)."""
    return maybe_row_to(JobRow, await conn.fetchrow(CLAIM, job_id, worker_id))


ANNOUNCE = """
INSERT INTO workers (id, devices, device_kind) VALUES ($1, $2, $3)
ON CONFLICT (id) DO UPDATE
SET devices = EXCLUDED.devices, device_kind = EXCLUDED.device_kind, seen_at = now()"""
LEAVE = "DELETE FROM workers WHERE id = $1"
LARGEST = "SELECT max(devices) FROM workers WHERE seen_at > now() - make_interval(secs => $1)"


async def announce(conn: Conn, *, worker_id: str, devices: int, kind: str) -> None:
    """This worker is alive and owns `devices` devices of `kind`."""
    await conn.execute(ANNOUNCE, worker_id, devices, kind)


async def leave(conn: Conn, *, worker_id: str) -> None:
    await conn.execute(LEAVE, worker_id)


async def largest_worker(conn: Conn, *, within_s: float) -> int | None:
    """The most devices a worker seen in the last `within_s` seconds owns (None: no worker seen)."""
    value = await conn.fetchval(LARGEST, within_s)
    return int(value) if value is not None else None


async def heartbeat(conn: Conn, *, job_id: str, worker_id: str, step: int | None) -> str | None:
    """Returns the job's status, or None when this worker no longer holds the job."""
    return await conn.fetchval(HEARTBEAT, job_id, worker_id, step)


async def release(conn: Conn, *, job_id: str, worker_id: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(RELEASE, job_id, worker_id))


async def requeue_own(conn: Conn, *, job_id: str, worker_id: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(REQUEUE_OWN, job_id, worker_id))


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


async def queued_unclaimed(conn: Conn) -> list[QueuedJob]:
    return rows_to(QueuedJob, await conn.fetch(QUEUED_UNCLAIMED))


async def stale(conn: Conn, *, after_s: float) -> list[StaleJob]:
    return rows_to(StaleJob, await conn.fetch(STALE, after_s))


async def requeue_stale(conn: Conn, *, job_id: str, worker_id: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(REQUEUE_STALE, job_id, worker_id))


async def fail_stale(conn: Conn, *, job_id: str, worker_id: str, error: dict[str, Any]) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(FAIL_STALE, job_id, worker_id, error))


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

"""Fine-tuning jobs, events and checkpoints: plain SQL.

State changes are single statements guarded by the allowed previous states, so concurrent actors (API calls,
workers, the reaper) cannot race a job into an impossible state.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.db import Conn, maybe_row_to, row_to, rows_to
from gateway.ids import new_id
from gateway.jobs.method import JobMethod, as_method


@dataclass(frozen=True, slots=True)
class JobRow:
    """A fine-tuning job, as the API and the worker read it."""

    id: str
    organization_id: str
    api_key_id: str | None
    model: str
    training_file: str
    validation_file: str | None
    status: str
    method: JobMethod
    """Typed (`gateway.jobs.method`; stored as `{"type": ..., <type>: {"hyperparameters": ..., ...}}`), its
    hyperparameters resolved once queued. Parsed from the stored JSON when the row is read."""
    seed: int
    suffix: str | None
    metadata: dict[str, Any] | None
    integrations: list[dict[str, Any]] | None
    error: dict[str, Any] | None
    fine_tuned_model: str | None
    trained_tokens: int | None
    result_files: list[str] | None
    estimated_finish: datetime | None
    created_at: datetime
    queued_at: datetime | None
    started_at: datetime | None
    finished_at: datetime | None
    queue_generation: int
    attempts: int
    worker_id: str | None
    current_step: int | None
    total_steps: int | None
    last_checkpoint: str | None
    request_hash: str | None
    max_cost_usd: float | None = None
    """The create's `max_cost`: the job pauses once its cost reaches it (None: no limit)."""
    estimated_cost_usd: float | None = None
    """The expected cost when the job was queued (`gateway.jobs.cost.queued_estimate`)."""
    guards: dict[str, Any] | None = None
    """Its guards, resolved at create (`gateway.jobs.guards`; None: a job made before them, the defaults)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "method", as_method(self.method))


@dataclass(frozen=True, slots=True)
class EventRow:
    id: str
    created_at: datetime
    level: str
    message: str
    type: str
    data: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    id: str
    job_id: str
    created_at: datetime
    step_number: int
    metrics: dict[str, Any] | None
    fine_tuned_model_checkpoint: str
    path: str


INSERT = """
INSERT INTO fine_tuning_jobs (id, organization_id, api_key_id, model, training_file, validation_file, status,
    method, seed, suffix, metadata, integrations, idempotency_key, request_hash, method_type, gpus,
    max_cost_usd, guards)
VALUES ($1, $2, $3, $4, $5, $6, 'validating_files', $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17)
RETURNING *"""
GET = "SELECT * FROM fine_tuning_jobs WHERE id = $1 AND organization_id = $2"
GET_ANY = "SELECT * FROM fine_tuning_jobs WHERE id = $1"
BY_IDEMPOTENCY_KEY = "SELECT * FROM fine_tuning_jobs WHERE organization_id = $1 AND idempotency_key = $2"
LIST = """
SELECT * FROM fine_tuning_jobs
WHERE organization_id = $1
  AND ($2::text IS NULL OR seq < (SELECT seq FROM fine_tuning_jobs WHERE id = $2 AND organization_id = $1))
  AND ($3::jsonb IS NULL OR metadata @> $3::jsonb)
ORDER BY seq DESC LIMIT $4"""

TO_QUEUED = """
UPDATE fine_tuning_jobs
SET status = 'queued', method = $2, total_steps = $3, gpus = $4, estimated_cost_usd = $5,
    queued_at = now(), queue_generation = queue_generation + 1
WHERE id = $1 AND status = 'validating_files' RETURNING *"""
TO_FAILED = """
UPDATE fine_tuning_jobs SET status = 'failed', error = $2, finished_at = now(), worker_id = NULL
WHERE id = $1 AND status = ANY($3::text[]) RETURNING *"""
CANCEL = """
UPDATE fine_tuning_jobs SET status = 'cancelled', finished_at = now()
WHERE id = $1 AND organization_id = $2
  AND status IN ('validating_files', 'queued', 'running', 'paused') RETURNING *"""
PAUSE = """
UPDATE fine_tuning_jobs SET status = 'paused'
WHERE id = $1 AND organization_id = $2 AND status IN ('queued', 'running') RETURNING *"""
RESUME = """
UPDATE fine_tuning_jobs SET status = 'queued', queued_at = now(), queue_generation = queue_generation + 1
WHERE id = $1 AND organization_id = $2 AND status = 'paused' RETURNING *"""

INSERT_EVENT = """
INSERT INTO fine_tuning_job_events (id, job_id, organization_id, level, message, type, data, dedup_key)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8)
ON CONFLICT (job_id, dedup_key) DO NOTHING"""
LIST_EVENTS = """
SELECT * FROM fine_tuning_job_events
WHERE job_id = $1 AND organization_id = $2
  AND ($3::text IS NULL OR seq < (SELECT seq FROM fine_tuning_job_events WHERE id = $3 AND job_id = $1))
ORDER BY seq DESC LIMIT $4"""
LIST_CHECKPOINTS = """
SELECT * FROM fine_tuning_job_checkpoints
WHERE job_id = $1 AND organization_id = $2
  AND ($3::text IS NULL OR seq < (SELECT seq FROM fine_tuning_job_checkpoints WHERE id = $3 AND job_id = $1))
ORDER BY seq DESC LIMIT $4"""


async def insert(conn: Conn, **kw: Any) -> JobRow:
    """A new job, `validating_files`; `method` a `JobMethod` (or its stored shape)."""
    method = as_method(kw["method"])
    record = await conn.fetchrow(
        INSERT,
        new_id("ftjob-"),
        kw["org_id"],
        kw["api_key_id"],
        kw["model"],
        kw["training_file"],
        kw["validation_file"],
        method.stored(),
        kw["seed"],
        kw["suffix"],
        kw["metadata"],
        kw["integrations"],
        kw["idempotency_key"],
        kw["request_hash"],
        method.type,
        method.gpus,
        kw.get("max_cost"),
        kw.get("guards"),
    )
    return row_to(JobRow, record)


async def get(conn: Conn, *, org_id: str, job_id: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(GET, job_id, org_id))


async def get_any(conn: Conn, *, job_id: str) -> JobRow | None:
    """A job by id alone — for the worker, which acts for every organisation."""
    return maybe_row_to(JobRow, await conn.fetchrow(GET_ANY, job_id))


async def by_idempotency_key(conn: Conn, *, org_id: str, key: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(BY_IDEMPOTENCY_KEY, org_id, key))


async def list_page(
    conn: Conn, *, org_id: str, after: str | None, limit: int, metadata: dict[str, str] | None
) -> list[JobRow]:
    return rows_to(JobRow, await conn.fetch(LIST, org_id, after, metadata, limit))


async def to_queued(
    conn: Conn, *, job_id: str, method: JobMethod, total_steps: int, estimated_cost: float | None = None
) -> JobRow | None:
    """Queue a validated job with its resolved method (and so the devices it claims) and its expected cost."""
    record = await conn.fetchrow(TO_QUEUED, job_id, method.stored(), total_steps, method.gpus, estimated_cost)
    return maybe_row_to(JobRow, record)


async def to_failed(
    conn: Conn, *, job_id: str, error: dict[str, Any], from_states: tuple[str, ...]
) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(TO_FAILED, job_id, error, list(from_states)))


async def cancel(conn: Conn, *, org_id: str, job_id: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(CANCEL, job_id, org_id))


async def pause(conn: Conn, *, org_id: str, job_id: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(PAUSE, job_id, org_id))


async def resume(conn: Conn, *, org_id: str, job_id: str) -> JobRow | None:
    return maybe_row_to(JobRow, await conn.fetchrow(RESUME, job_id, org_id))


async def add_event(
    conn: Conn,
    *,
    job_id: str,
    org_id: str,
    message: str,
    level: str = "info",
    type: str = "message",
    data: dict[str, Any] | None = None,
    dedup_key: str | None = None,
) -> None:
    """Record an event; with a `dedup_key`, the same event is recorded once however often it is sent."""
    await conn.execute(
        INSERT_EVENT, new_id("ftevent-"), job_id, org_id, level, message, type, data, dedup_key
    )


async def add_metric_events(conn: Conn, *, job_id: str, org_id: str, points: list[dict[str, Any]]) -> None:
    """Record many steps' metrics at once (each point has its `step`), as the worker records one: a
    `metrics` event per step, recorded once per step."""
    rows = []
    for point in points:
        step, total = point["step"], point.get("total_steps")
        message = f"Step {step}/{total}" if total else f"Step {step}"
        dedup = f"metrics:{step}"
        rows.append((new_id("ftevent-"), job_id, org_id, "info", message, "metrics", point, dedup))
    await conn.executemany(INSERT_EVENT, rows)


async def list_events(
    conn: Conn, *, org_id: str, job_id: str, after: str | None, limit: int
) -> list[EventRow]:
    return rows_to(EventRow, await conn.fetch(LIST_EVENTS, job_id, org_id, after, limit))


async def list_checkpoints(
    conn: Conn, *, org_id: str, job_id: str, after: str | None, limit: int
) -> list[CheckpointRow]:
    return rows_to(CheckpointRow, await conn.fetch(LIST_CHECKPOINTS, job_id, org_id, after, limit))

"""Usage queries: completion buckets and cost inputs, plain SQL.

Buckets are `date_bin(width, created_at, start)`, so the first bucket starts exactly at `start_time`.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime, timedelta

from gateway.db import Conn, rows_to

GROUPABLE = ("model", "api_key_id")


@dataclass(frozen=True, slots=True)
class CompletionBucket:
    """Completion sums of one bucket (and one model or key when grouped by them)."""

    bucket: datetime
    model: str | None
    """The model when grouped by model, else None."""
    api_key_id: str | None
    """The key when grouped by key, else None."""
    input_tokens: int
    output_tokens: int
    num_model_requests: int


@dataclass(frozen=True, slots=True)
class CompletionCostInput:
    """Completion tokens of one bucket and base model."""

    bucket: datetime
    base_model: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class TrainingCostInput:
    """Training of one bucket and base model."""

    bucket: datetime
    base_model: str
    trained_tokens: int
    training_seconds: float


@dataclass(frozen=True, slots=True)
class JobUsage:
    """Training so far of one job (every attempt) on its base model."""

    job_id: str
    base_model: str
    trained_tokens: int
    training_seconds: float
    steps: int


COST_COMPLETIONS = """
SELECT date_bin($2::interval, created_at, $3::timestamptz) AS bucket, base_model,
       sum(prompt_tokens)::bigint AS prompt_tokens, sum(completion_tokens)::bigint AS completion_tokens
FROM completion_usage
WHERE organization_id = $1 AND created_at >= $3 AND created_at < $4
GROUP BY 1, 2 ORDER BY 1"""
COST_TRAINING = """
SELECT date_bin($2::interval, created_at, $3::timestamptz) AS bucket, base_model,
       sum(trained_tokens)::bigint AS trained_tokens, sum(training_seconds)::float8 AS training_seconds
FROM training_usage
WHERE organization_id = $1 AND created_at >= $3 AND created_at < $4
GROUP BY 1, 2 ORDER BY 1"""
JOB_USAGE = """
SELECT job_id, base_model, sum(trained_tokens)::bigint AS trained_tokens,
       sum(training_seconds)::float8 AS training_seconds, sum(steps)::bigint AS steps
FROM training_usage WHERE organization_id = $1 AND job_id = ANY($2::text[])
GROUP BY job_id, base_model"""


async def completion_buckets(
    conn: Conn,
    *,
    org_id: str,
    width: timedelta,
    start: datetime,
    end: datetime,
    group_by: list[str],
    models: list[str] | None,
    api_key_ids: list[str] | None,
) -> list[CompletionBucket]:
    """Sums per bucket (and per `group_by` column) of `[start, end)`."""
    cols = [c for c in GROUPABLE if c in group_by]
    select = "".join(f", {c}" if c in cols else f", NULL::text AS {c}" for c in GROUPABLE)
    group = "".join(f", {c}" for c in cols)
    sql = f"""
SELECT date_bin($2::interval, created_at, $3::timestamptz) AS bucket{select},
       sum(prompt_tokens)::bigint AS input_tokens, sum(completion_tokens)::bigint AS output_tokens,
       count(*) FILTER (WHERE status < 400) AS num_model_requests
FROM completion_usage
WHERE organization_id = $1 AND created_at >= $3 AND created_at < $4
  AND ($5::text[] IS NULL OR model = ANY($5::text[]))
  AND ($6::text[] IS NULL OR api_key_id = ANY($6::text[]))
GROUP BY 1{group} ORDER BY 1{group}"""  # noqa: S608 - columns come from the fixed GROUPABLE list
    return rows_to(CompletionBucket, await conn.fetch(sql, org_id, width, start, end, models, api_key_ids))


async def cost_inputs(
    conn: Conn, *, org_id: str, width: timedelta, start: datetime, end: datetime
) -> tuple[list[CompletionCostInput], list[TrainingCostInput]]:
    """Completion and training sums per bucket and base model."""
    args = (org_id, width, start, end)
    completions = rows_to(CompletionCostInput, await conn.fetch(COST_COMPLETIONS, *args))
    return completions, rows_to(TrainingCostInput, await conn.fetch(COST_TRAINING, *args))


async def job_usage(conn: Conn, *, org_id: str, job_ids: list[str]) -> list[JobUsage]:
    """Training usage so far of some jobs (every attempt)."""
    return rows_to(JobUsage, await conn.fetch(JOB_USAGE, org_id, job_ids))

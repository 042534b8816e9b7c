"""Rate limits, budgets and Stripe customers: plain SQL, and the frozen rows it returns."""

from __future__ import annotations

from dataclasses import dataclass

from gateway.db import Conn, maybe_row_to, row_to, rows_to


@dataclass(frozen=True, slots=True)
class LimitsRow:
    """Per-minute limits of an organisation (`api_key_id` None) or of one of its keys; None: no limit set."""

    organization_id: str
    api_key_id: str | None
    max_requests_per_1_minute: int | None
    max_tokens_per_1_minute: int | None
    monthly_spend_limit_usd: float | None = None
    """A key's monthly spend limit (USD); None for none (and always for an organisation's row)."""


@dataclass(frozen=True, slots=True)
class BillingRow:
    organization_id: str
    monthly_budget_usd: float | None
    stripe_customer_id: str | None


@dataclass(frozen=True, slots=True)
class MonthCompletions:
    """Month-to-date completion tokens of one base model."""

    base_model: str
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class MonthTraining:
    """Month-to-date training of one base model."""

    base_model: str
    trained_tokens: int
    training_seconds: float


@dataclass(frozen=True, slots=True)
class JobTraining:
    """Training of one job on its base model: its recorded attempts, or its last attempt's progress so far."""

    job_id: str
    base_model: str
    tokens: int | None
    seconds: float


UPSERT_LIMITS = """
INSERT INTO rate_limits (subject, organization_id, api_key_id, max_requests_per_1_minute,
    max_tokens_per_1_minute)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (subject) DO UPDATE SET max_requests_per_1_minute = EXCLUDED.max_requests_per_1_minute,
    max_tokens_per_1_minute = EXCLUDED.max_tokens_per_1_minute, updated_at = now()
RETURNING *"""
LIMITS_OF_ORG = "SELECT * FROM rate_limits WHERE organization_id = $1"
KEY_ORG = "SELECT organization_id FROM api_keys WHERE id = $1"
UPSERT_SPEND_LIMIT = """
INSERT INTO rate_limits (subject, organization_id, api_key_id, monthly_spend_limit_usd)
VALUES ('key:' || $2, $1, $2, $3)
ON CONFLICT (subject) DO UPDATE
    SET monthly_spend_limit_usd = EXCLUDED.monthly_spend_limit_usd, updated_at = now()
RETURNING *"""
SPEND_LIMIT_OF_KEY = "SELECT monthly_spend_limit_usd FROM rate_limits WHERE subject = 'key:' || $1"
UPSERT_BILLING = """
INSERT INTO organization_billing (organization_id, monthly_budget_usd, stripe_customer_id)
VALUES ($1, $2, $3)
ON CONFLICT (organization_id) DO UPDATE SET
    monthly_budget_usd = CASE WHEN $4 THEN EXCLUDED.monthly_budget_usd
                              ELSE organization_billing.monthly_budget_usd END,
    stripe_customer_id = CASE WHEN $5 THEN EXCLUDED.stripe_customer_id
                              ELSE organization_billing.stripe_customer_id END,
    updated_at = now()
RETURNING *"""
BILLING_OF_ORG = "SELECT * FROM organization_billing WHERE organization_id = $1"
# Month-to-date usage by base model (prices are applied in Python, from the settings).
MONTH_START = "date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'"
MONTH_COMPLETIONS = f"""
SELECT base_model, sum(prompt_tokens)::bigint AS prompt_tokens,
       sum(completion_tokens)::bigint AS completion_tokens
FROM completion_usage
WHERE organization_id = $1 AND created_at >= {MONTH_START}
GROUP BY base_model"""
MONTH_TRAINING = f"""
SELECT base_model, sum(trained_tokens)::bigint AS trained_tokens,
       sum(training_seconds)::float8 AS training_seconds
FROM training_usage
WHERE organization_id = $1 AND created_at >= {MONTH_START}
GROUP BY base_model"""
# A key's month: its own completions and those of the keys minted for its jobs (named `job <id>` by
# `gateway.jobs.running.key_name`), and its jobs' recorded training.
KEY_MONTH_COMPLETIONS = f"""
SELECT base_model, sum(prompt_tokens)::bigint AS prompt_tokens,
       sum(completion_tokens)::bigint AS completion_tokens
FROM completion_usage
WHERE organization_id = $1 AND created_at >= {MONTH_START}
  AND (api_key_id = $2 OR api_key_id IN (
        SELECT k.id FROM fine_tuning_jobs j
        JOIN api_keys k
            ON k.organization_id = j.organization_id AND k.kind = 'job' AND k.name = 'job ' || j.id
        WHERE j.organization_id = $1 AND j.api_key_id = $2))
GROUP BY base_model"""
KEY_MONTH_TRAINING = f"""
SELECT u.base_model, sum(u.trained_tokens)::bigint AS trained_tokens,
       sum(u.training_seconds)::float8 AS training_seconds
FROM training_usage u JOIN fine_tuning_jobs j ON j.id = u.job_id
WHERE u.organization_id = $1 AND j.api_key_id = $2 AND u.created_at >= {MONTH_START}
GROUP BY u.base_model"""
KEY_JOBS_IN = """
SELECT id FROM fine_tuning_jobs WHERE organization_id = $1 AND api_key_id = $2 AND status = ANY($3::text[])"""
RECORDED = """
SELECT job_id, base_model, sum(trained_tokens)::bigint AS tokens, sum(training_seconds)::float8 AS seconds
FROM training_usage WHERE organization_id = $1 AND job_id = ANY($2::text[])
GROUP BY job_id, base_model"""
# The last attempt's last metrics event (after the attempt's start): its cumulative tokens and its time, while
# the attempt runs and after it was stopped (paused, cancelled) until its usage row is recorded.
LIVE = """
SELECT j.id AS job_id, j.model AS base_model, m.tokens,
       greatest(0, extract(epoch FROM m.created_at - s.created_at))::float8 AS seconds
FROM fine_tuning_jobs j
JOIN LATERAL (SELECT created_at FROM fine_tuning_job_events
              WHERE job_id = j.id AND dedup_key = 'started:' || j.attempts) s ON true
JOIN LATERAL (SELECT CASE WHEN jsonb_typeof(data->'tokens') = 'number'
                          THEN (data->>'tokens')::numeric::bigint END AS tokens, created_at
              FROM fine_tuning_job_events
              WHERE job_id = j.id AND type = 'metrics' ORDER BY seq DESC LIMIT 1) m
    ON m.created_at >= s.created_at
WHERE j.organization_id = $1 AND j.id = ANY($2::text[]) AND j.status = ANY($3::text[])
  AND NOT EXISTS (SELECT 1 FROM training_usage u WHERE u.job_id = j.id AND u.created_at >= s.created_at)"""
LIVE_STATES = ("running", "paused", "cancelled")
"""States in which a job's last attempt may have progress its usage row does not hold yet."""


async def set_limits(
    conn: Conn, *, org_id: str, key_id: str | None, requests: int | None, tokens: int | None
) -> LimitsRow:
    subject = f"key:{key_id}" if key_id else f"org:{org_id}"
    return row_to(LimitsRow, await conn.fetchrow(UPSERT_LIMITS, subject, org_id, key_id, requests, tokens))


async def limits_of_org(conn: Conn, *, org_id: str) -> list[LimitsRow]:
    return rows_to(LimitsRow, await conn.fetch(LIMITS_OF_ORG, org_id))


async def set_spend_limit(conn: Conn, *, org_id: str, key_id: str, limit: float | None) -> LimitsRow:
    """Set (None: clear) a key's monthly spend limit; its per-minute limits stay as they are."""
    return row_to(LimitsRow, await conn.fetchrow(UPSERT_SPEND_LIMIT, org_id, key_id, limit))


async def spend_limit_of_key(conn: Conn, *, key_id: str) -> float | None:
    """A key's monthly spend limit in USD, None when it has none."""
    limit = await conn.fetchval(SPEND_LIMIT_OF_KEY, key_id)
    return None if limit is None else float(limit)


async def org_of_key(conn: Conn, *, key_id: str) -> str | None:
    return await conn.fetchval(KEY_ORG, key_id)


async def set_billing(
    conn: Conn,
    *,
    org_id: str,
    budget: float | None,
    set_budget: bool,
    customer: str | None,
    set_customer: bool,
) -> BillingRow:
    return row_to(
        BillingRow, await conn.fetchrow(UPSERT_BILLING, org_id, budget, customer, set_budget, set_customer)
    )


async def billing_of_org(conn: Conn, *, org_id: str) -> BillingRow | None:
    return maybe_row_to(BillingRow, await conn.fetchrow(BILLING_OF_ORG, org_id))


async def month_usage(conn: Conn, *, org_id: str) -> tuple[list[MonthCompletions], list[MonthTraining]]:
    """Month-to-date completion and training usage of an organisation, by base model."""
    completions = rows_to(MonthCompletions, await conn.fetch(MONTH_COMPLETIONS, org_id))
    return completions, rows_to(MonthTraining, await conn.fetch(MONTH_TRAINING, org_id))


async def key_month_usage(
    conn: Conn, *, org_id: str, key_id: str
) -> tuple[list[MonthCompletions], list[MonthTraining], list[str]]:
    """A key's month-to-date completions and recorded training by base model (see `KEY_MONTH_COMPLETIONS`),
    and its jobs whose last attempt may have progress not recorded yet (`LIVE_STATES`)."""
    completions = rows_to(MonthCompletions, await conn.fetch(KEY_MONTH_COMPLETIONS, org_id, key_id))
    training = rows_to(MonthTraining, await conn.fetch(KEY_MONTH_TRAINING, org_id, key_id))
    live = [r["id"] for r in await conn.fetch(KEY_JOBS_IN, org_id, key_id, list(LIVE_STATES))]
    return completions, training, live


async def recorded_training(conn: Conn, *, org_id: str, job_ids: list[str]) -> list[JobTraining]:
    """The training usage jobs' ended attempts recorded, by job and base model."""
    return rows_to(JobTraining, await conn.fetch(RECORDED, org_id, job_ids))


async def live_training(conn: Conn, *, org_id: str, job_ids: list[str]) -> list[JobTraining]:
    """The cumulative progress of jobs' last attempts that no usage row holds yet (see `LIVE`)."""
    return rows_to(JobTraining, await conn.fetch(LIVE, org_id, job_ids, list(LIVE_STATES)))

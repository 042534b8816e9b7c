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


UPSERT_LIMITS = """
INSERT INTO rate_limits (subject, organization_id, api_key_id, max_requests_per_1_minute,
    max_tokens_per_1_minute)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (subject) DO UPDATE SET max_requests_per_1_minute = EXCLUDED.max_requests_per_1_minute,
    max_tokens_per_1_minute = EXCLUDED.max_tokens_per_1_minute, updated_at = now()
RETURNING *"""
LIMITS_OF_ORG = "SELECT * FROM rate_limits WHERE organization_id = $1"
KEY_ORG = "SELECT organization_id FROM api_keys WHERE id = $1"
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
MONTH_COMPLETIONS = """
SELECT base_model, sum(prompt_tokens)::bigint AS prompt_tokens,
       sum(completion_tokens)::bigint AS completion_tokens
FROM completion_usage
WHERE organization_id = $1 AND created_at >= date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
GROUP BY base_model"""
MONTH_TRAINING = """
SELECT base_model, sum(trained_tokens)::bigint AS trained_tokens,
       sum(training_seconds)::float8 AS training_seconds
FROM training_usage
WHERE organization_id = $1 AND created_at >= date_trunc('month', now() AT TIME ZONE 'UTC') AT TIME ZONE 'UTC'
GROUP BY base_model"""


async def set_limits(
    conn: Conn, *, org_id: str, key_id: str | None, requests: int | None, tokens: int | None
) -> LimitsRow:
    subject = f"key:{key_id}" if key_id else f"org:{org_id}"
    return row_to(LimitsRow, await conn.fetchrow(UPSERT_LIMITS, subject, org_id, key_id, requests, tokens))


async def limits_of_org(conn: Conn, *, org_id: str) -> list[LimitsRow]:
    return rows_to(LimitsRow, await conn.fetch(LIMITS_OF_ORG, org_id))


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

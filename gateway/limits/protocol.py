"""Admin API shapes for rate limits, budgets and the Stripe customer of an organisation."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.limits.store import LimitsRow
from gateway.protocol import OpenAIBaseModel

MAX_PER_MINUTE = 2**31 - 1
"""Largest per-minute limit (the columns are PostgreSQL `integer`s)."""
MAX_BUDGET_USD = 1e9
"""Largest monthly budget in USD: 1e15 micro-USD, still exact in Redis' Lua numbers (doubles)."""


class LimitsUpdate(OpenAIBaseModel):
    """`POST .../limits`: per-minute limits. Null or absent: unlimited for an organisation; for an API key,
    the defaults `default_requests_per_minute` / `default_tokens_per_minute`."""

    max_requests_per_1_minute: int | None = Field(default=None, ge=1, le=MAX_PER_MINUTE)
    max_tokens_per_1_minute: int | None = Field(default=None, ge=1, le=MAX_PER_MINUTE)


class Limits(OpenAIBaseModel):
    object: Literal["rate_limit"] = "rate_limit"
    organization_id: str
    api_key_id: str | None = None
    max_requests_per_1_minute: int | None = None
    max_tokens_per_1_minute: int | None = None
    monthly_spend_limit_usd: float | None = None
    """A key's monthly spend limit (`POST /v1/admin/api_keys/{key_id}/spend_limit`)."""

    @classmethod
    def from_row(cls, row: LimitsRow) -> Limits:
        return cls(
            organization_id=row.organization_id,
            api_key_id=row.api_key_id,
            max_requests_per_1_minute=row.max_requests_per_1_minute,
            max_tokens_per_1_minute=row.max_tokens_per_1_minute,
            monthly_spend_limit_usd=row.monthly_spend_limit_usd,
        )


class SpendLimitUpdate(OpenAIBaseModel):
    """`POST /v1/admin/api_keys/{key_id}/spend_limit`: the most the key may spend in a UTC calendar month, on
    its completions, its Tinker training and the jobs it creates; null clears it."""

    monthly_spend_limit_usd: float | None = Field(ge=0, le=MAX_BUDGET_USD, allow_inf_nan=False)


class SpendLimit(OpenAIBaseModel):
    object: Literal["api_key.spend_limit"] = "api_key.spend_limit"
    api_key_id: str
    organization_id: str
    monthly_spend_limit_usd: float | None = None
    month_to_date_usd: float
    """What the key has spent this calendar month (UTC), its jobs' progress not yet recorded included."""


class BillingUpdate(OpenAIBaseModel):
    """`POST .../billing`: only the fields present change; null clears one."""

    monthly_budget_usd: float | None = Field(default=None, ge=0, le=MAX_BUDGET_USD, allow_inf_nan=False)
    stripe_customer_id: str | None = Field(default=None, max_length=255)


class BillingSettings(OpenAIBaseModel):
    object: Literal["organization.billing"] = "organization.billing"
    organization_id: str
    monthly_budget_usd: float | None = None
    stripe_customer_id: str | None = None
    month_to_date_usd: float | None = None
    """Spend of the current calendar month (UTC), from recorded usage."""


class OrgLimits(OpenAIBaseModel):
    object: Literal["organization.limits"] = "organization.limits"
    organization: Limits
    api_keys: list[Limits]
    billing: BillingSettings

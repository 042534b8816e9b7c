"""Month-to-date spend and the monthly budget of an organisation, from the database: what the request guard
seeds its Redis counter with, and what a worker compares a running training job against.

Prices come from the settings (`price_of`), so spend is always priced as the current table says.
"""

from __future__ import annotations

import logging

from gateway.db import Conn
from gateway.limits import store
from gateway.settings import Settings
from gateway.usage.pricing import completion_cost, training_cost

logger = logging.getLogger(__name__)


async def month_spend_usd(conn: Conn, settings: Settings, *, org_id: str) -> float:
    """Month-to-date (UTC calendar month) spend of an organisation: recorded completions and training."""
    completions, training = await store.month_usage(conn, org_id=org_id)
    total = 0.0
    for c in completions:
        total += completion_cost(settings, c.base_model, c.prompt_tokens, c.completion_tokens)
    for t in training:
        total += training_cost(settings, t.base_model, t.trained_tokens, t.training_seconds)
    return total


async def monthly_budget_usd(conn: Conn, *, org_id: str) -> float | None:
    """The organisation's monthly hard limit in USD, None when it has none."""
    row = await store.billing_of_org(conn, org_id=org_id)
    if row is None or row.monthly_budget_usd is None:
        return None
    return float(row.monthly_budget_usd)

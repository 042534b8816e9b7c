"""Month-to-date spend and monthly limits, from the database: an organisation's spend and budget, and an API
key's spend and spend limit. They seed the request guard's Redis counters, and a worker holds a running
training job against them.

A key's spend is what it was used for this calendar month (UTC): its own completions (chat, completions,
Tinker training and sampling), the training of the jobs it created (their recorded attempts, and the progress
of attempts not recorded yet, so that jobs running side by side see each other) and their model graders'
completions. Prices come from the settings (`price_of`), so spend is always priced as the current table says.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from gateway.db import Conn
from gateway.limits import store
from gateway.limits.store import JobTraining, MonthCompletions, MonthTraining
from gateway.settings import Settings
from gateway.usage.pricing import completion_cost, training_cost

logger = logging.getLogger(__name__)


def _priced(
    settings: Settings, completions: Iterable[MonthCompletions], training: Iterable[MonthTraining]
) -> float:
    total = 0.0
    for c in completions:
        total += completion_cost(settings, c.base_model, c.prompt_tokens, c.completion_tokens)
    for t in training:
        total += training_cost(settings, t.base_model, t.trained_tokens, t.training_seconds)
    return total


async def month_spend_usd(conn: Conn, settings: Settings, *, org_id: str) -> float:
    """Month-to-date (UTC calendar month) spend of an organisation: recorded completions and training."""
    completions, training = await store.month_usage(conn, org_id=org_id)
    return _priced(settings, completions, training)


async def monthly_budget_usd(conn: Conn, *, org_id: str) -> float | None:
    """The organisation's monthly hard limit in USD, None when it has none."""
    row = await store.billing_of_org(conn, org_id=org_id)
    if row is None or row.monthly_budget_usd is None:
        return None
    return float(row.monthly_budget_usd)


async def key_month_spend_usd(conn: Conn, settings: Settings, *, org_id: str, key_id: str) -> float:
    """Month-to-date spend of an API key (see the module), its jobs' unrecorded progress included."""
    completions, training, live = await store.key_month_usage(conn, org_id=org_id, key_id=key_id)
    total = _priced(settings, completions, training)
    if live:
        unrecorded = await unrecorded_usd(conn, settings, org_id=org_id, job_ids=live)
        total += sum(unrecorded.values())
    return total


async def unrecorded_usd(
    conn: Conn,
    settings: Settings,
    *,
    org_id: str,
    job_ids: list[str],
    recorded: list[JobTraining] | None = None,
) -> dict[str, float]:
    """USD of the progress jobs' last attempts made that no usage row holds yet (by job id; absent: none):
    their cumulative tokens less what their `recorded` attempts hold (read when not given), and their time."""
    if recorded is None:
        recorded = await store.recorded_training(conn, org_id=org_id, job_ids=job_ids)
    tokens: dict[str, int] = {}
    for r in recorded:
        tokens[r.job_id] = tokens.get(r.job_id, 0) + (r.tokens or 0)
    out: dict[str, float] = {}
    for live in await store.live_training(conn, org_id=org_id, job_ids=job_ids):
        unrecorded = max(0, (live.tokens or 0) - tokens.get(live.job_id, 0))
        out[live.job_id] = training_cost(settings, live.base_model, unrecorded, live.seconds)
    return out


async def key_spend_limit_usd(conn: Conn, *, key_id: str) -> float | None:
    """The key's monthly spend limit in USD, None when it has none."""
    return await store.spend_limit_of_key(conn, key_id=key_id)

"""A job's cost: what it has accrued, what it is projected to total, the monthly-budget check of a create, and
what a running job has spent against its `max_cost`.

Accrued is priced as billing prices it (`gateway.usage.pricing`): the training usage its ended attempts
recorded (`training_usage`), the running attempt's progress since (its last metrics event's cumulative tokens,
and the time from the attempt's start to that event), and the chat completions its model graders made with
the job's keys (`gateway.jobs.running.key_name`). Projected total: accrued scaled by total steps over steps
done while the job has steps left; before its first step, the estimate made when it was queued; accrued alone
once it has ended.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from gateway.db import Conn, rows_to
from gateway.errors import InsufficientQuota
from gateway.jobs.method import JobMethod
from gateway.jobs.projection import model_graders
from gateway.jobs.protocol import TERMINAL_STATES, BudgetState
from gateway.jobs.running import key_name
from gateway.jobs.store import JobRow
from gateway.limits import store as limits_store
from gateway.limits.budget import key_month_spend_usd, key_spend_limit_usd, unrecorded_usd
from gateway.settings import Settings
from gateway.usage.pricing import completion_cost, training_cost

if TYPE_CHECKING:  # the worker imports this module too, and has no request resources
    from gateway.deps import Resources

logger = logging.getLogger(__name__)

GRADERS = """
SELECT k.name, u.base_model, sum(u.prompt_tokens)::bigint AS prompt_tokens,
       sum(u.completion_tokens)::bigint AS completion_tokens
FROM api_keys k
JOIN completion_usage u ON u.organization_id = k.organization_id AND u.created_at >= k.created_at
    AND u.api_key_id = k.id
WHERE k.organization_id = $1 AND k.kind = 'job' AND k.name = ANY($2::text[])
GROUP BY k.name, u.base_model"""
PAUSED_FOR_MAX_COST = """
SELECT EXISTS (SELECT 1 FROM fine_tuning_job_events
               WHERE job_id = $1 AND dedup_key LIKE 'max_cost_paused:%')"""
THROUGHPUT = """
SELECT coalesce(sum(trained_tokens), 0)::float8 AS tokens,
       coalesce(sum(training_seconds), 0)::float8 AS seconds
FROM training_usage
WHERE organization_id = $1 AND base_model = $2 AND method = $3 AND training_seconds > 0"""


@dataclass(frozen=True, slots=True)
class _Graded:
    name: str
    base_model: str
    prompt_tokens: int
    completion_tokens: int


async def graders_usd(conn: Conn, settings: Settings, *, org_id: str, job_ids: list[str]) -> dict[str, float]:
    """USD of the chat completions each job's model graders made (by job id; absent: none)."""
    names = {key_name(j): j for j in job_ids}
    out: dict[str, float] = {}
    for r in rows_to(_Graded, await conn.fetch(GRADERS, org_id, list(names))):
        job_id = names[r.name]
        usd = completion_cost(settings, r.base_model, r.prompt_tokens, r.completion_tokens)
        out[job_id] = out.get(job_id, 0.0) + usd
    return out


async def recorded_usd(conn: Conn, settings: Settings, *, org_id: str, job_id: str) -> tuple[int, float]:
    """Trained tokens and USD of a job's ended attempts (`training_usage`), its graders' completions not
    counted."""
    rows = await limits_store.recorded_training(conn, org_id=org_id, job_ids=[job_id])
    tokens = sum(r.tokens or 0 for r in rows)
    return tokens, sum(training_cost(settings, r.base_model, r.tokens or 0, r.seconds) for r in rows)


async def paused_for_max_cost(conn: Conn, *, job_id: str) -> bool:
    """Whether an attempt of the job was paused by its `max_cost` (the worker's event says so)."""
    return bool(await conn.fetchval(PAUSED_FOR_MAX_COST, job_id))


async def job_costs(conn: Conn, settings: Settings, rows: list[JobRow]) -> dict[str, dict[str, float | None]]:
    """`{job id: {"accrued": usd, "projected_total": usd | None}}` of one organisation's jobs."""
    if not rows:
        return {}
    org_id = rows[0].organization_id
    ids = [r.id for r in rows]
    accrued = dict.fromkeys(ids, 0.0)
    recorded = await limits_store.recorded_training(conn, org_id=org_id, job_ids=ids)
    for t in recorded:
        accrued[t.job_id] += training_cost(settings, t.base_model, t.tokens or 0, t.seconds)
    live = [r.id for r in rows if r.status in limits_store.LIVE_STATES]
    if live:
        unrecorded = await unrecorded_usd(conn, settings, org_id=org_id, job_ids=live, recorded=recorded)
        for job_id, usd in unrecorded.items():
            accrued[job_id] += usd
    graded = [r.id for r in rows if r.method.grader is not None and any(model_graders(r.method.grader))]
    if graded:  # only jobs whose graders call a model have completions of their own
        for job_id, usd in (await graders_usd(conn, settings, org_id=org_id, job_ids=graded)).items():
            accrued[job_id] += usd
    return {
        r.id: {"accrued": round(accrued[r.id], 6), "projected_total": _projected(r, accrued[r.id])}
        for r in rows
    }


def _projected(row: JobRow, accrued: float) -> float | None:
    if row.status in TERMINAL_STATES:
        return round(accrued, 6)
    done, total = row.current_step or 0, row.total_steps or 0
    if done > 0 and total > 0:
        return round(accrued * max(total, done) / done, 6)
    if row.estimated_cost_usd is not None:
        return round(max(accrued, row.estimated_cost_usd), 6)
    return None


async def throughput(conn: Conn, *, org_id: str, base_model: str, method: str) -> float | None:
    """Trained tokens a second of the organisation's recorded training of `base_model` with `method` (None
    without a second of it)."""
    row = await conn.fetchrow(THROUGHPUT, org_id, base_model, method)
    if row is None or row["seconds"] < 1.0 or row["tokens"] <= 0:
        return None
    return float(row["tokens"]) / float(row["seconds"])


# ---- the create's budget check -------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class BudgetVerdict:
    """The create's check of one job against the organisation's monthly budget and its key's spend limit."""

    estimate_usd: float
    """The training cost it holds against them: the file's bytes over four, times the epochs."""
    budget_usd: float | None
    spent_usd: float
    """Month to date (0 when not read: no budget to hold it against)."""
    key_limit_usd: float | None = None
    """The creating key's monthly spend limit, None for none."""
    key_spent_usd: float = 0.0
    """The key's month to date (0 when not read: no limit to hold it against)."""
    what: str = "job"
    """What is estimated, in the refusal: `job`, or `loop` for a Tinker loop."""

    @property
    def left_usd(self) -> float | None:
        return None if self.budget_usd is None else max(0.0, self.budget_usd - self.spent_usd)

    @property
    def key_left_usd(self) -> float | None:
        return None if self.key_limit_usd is None else max(0.0, self.key_limit_usd - self.key_spent_usd)

    @property
    def allowed(self) -> bool:
        return self.refusal is None

    @property
    def refusal(self) -> str | None:
        if self.budget_usd is not None and self.spent_usd + self.estimate_usd > self.budget_usd:
            return (
                f"This {self.what}'s estimated cost (${self.estimate_usd:.4f}) does not fit the "
                f"organization's remaining monthly budget (${self.left_usd or 0.0:.4f})."
            )
        if self.key_limit_usd is not None and self.key_spent_usd + self.estimate_usd > self.key_limit_usd:
            return (
                f"This {self.what}'s estimated cost (${self.estimate_usd:.4f}) does not fit the remaining "
                f"monthly spend limit of this API key (${self.key_left_usd or 0.0:.4f})."
            )
        return None


def given_epochs(method: JobMethod) -> int:
    """The epochs the budget check counts: as the create gives them (1 for `"auto"`)."""
    epochs = getattr(method.hyperparameters, "n_epochs", 1)
    return epochs if isinstance(epochs, int) else 1


async def budget_verdict(
    res: Resources,
    org_id: str,
    key_id: str | None,
    base_model: str,
    file_bytes: int,
    epochs: int,
    *,
    read_spend: bool = False,
) -> BudgetVerdict:
    """Whether a job's estimated training cost fits the organisation's monthly budget and the spend limit of
    the key that creates it (`key_id`). Trained tokens are estimated from the file (about four bytes a token)
    times the epochs. A month's spend is read only when there is a limit to hold it against, or when
    `read_spend` asks for it."""
    estimate = training_cost(res.settings, base_model, file_bytes // 4 * epochs, 0.0)
    return await spend_verdict(res, org_id, key_id, estimate, read_spend=read_spend)


async def spend_verdict(
    res: Resources,
    org_id: str,
    key_id: str | None,
    estimate_usd: float,
    *,
    read_spend: bool = False,
    what: str = "job",
) -> BudgetVerdict:
    """Whether `estimate_usd` fits the organisation's monthly budget and the spend limit of the key `key_id`.
    A month's spend is read only when there is a limit to hold it against, or when `read_spend` asks."""
    billing = await limits_store.billing_of_org(res.pool, org_id=org_id)
    budget = (
        None if billing is None or billing.monthly_budget_usd is None else float(billing.monthly_budget_usd)
    )
    spent = await res.guard.month_spend_micro(org_id) / 1e6 if budget is not None or read_spend else 0.0
    key_limit = await key_spend_limit_usd(res.pool, key_id=key_id) if key_id is not None else None
    key_spent = 0.0
    if key_id is not None and (key_limit is not None or read_spend):
        key_spent = await key_month_spend_usd(res.pool, res.settings, org_id=org_id, key_id=key_id)
    return BudgetVerdict(estimate_usd, budget, spent, key_limit, key_spent, what)


def budget_state(verdict: BudgetVerdict) -> BudgetState:
    """The `budget` of an estimate."""
    return BudgetState(
        monthly_budget_usd=verdict.budget_usd,
        month_to_date_usd=round(verdict.spent_usd, 6),
        left_usd=verdict.left_usd,
        api_key_monthly_spend_limit_usd=verdict.key_limit_usd,
        api_key_month_to_date_usd=round(verdict.key_spent_usd, 6),
        api_key_left_usd=verdict.key_left_usd,
    )


async def check_budget(
    res: Resources, org_id: str, key_id: str | None, base_model: str, file_bytes: int, epochs: int
) -> None:
    """429 `insufficient_quota` when the job's estimated training cost does not fit the monthly budget or the
    key's spend limit."""
    verdict = await budget_verdict(res, org_id, key_id, base_model, file_bytes, epochs)
    if verdict.refusal is not None:
        raise InsufficientQuota(verdict.refusal, code="insufficient_quota")

"""Metering: what an attempt costs, its one training usage row, and the budget pause.

An attempt is metered by the trainer's progress (`ingest.Progress`): its cumulative tokens less what
earlier attempts of the job recorded, and the time from its start to its last reported step. The usage row
is written once, in the transaction that changes the job's state, and the same spend is added to the
request guard's month counter in Redis, so completions see the budget that training used.

While the trainer runs, every `budget_check_interval_s` the organisation's month-to-date spend plus this
attempt's cost (not yet recorded as usage) is held against its monthly budget; a job that reaches it is
paused, so its trainer checkpoints and the job resumes from there once the budget is raised.

A job with a `max_cost` is held to it at every step the trainer reports: its earlier attempts' recorded
cost, its model graders' completions and this attempt's cost so far. The step that reaches it pauses the job
the same way (the trainer checkpoints within a step), with an event that gives the numbers, and the attempt
is billed up to that step only: what the trainer does after it is billed to the next attempt, if the job is
resumed. Resuming is the user's choice to go on past the limit: a job paused once by its `max_cost` is not
paused by it again.

A job created with an API key that has a monthly spend limit is held to it at every step too: the key's
month-to-date spend (`gateway.limits.budget.key_month_spend_usd`: its completions, and its jobs' training,
the progress of those running side by side included) pauses the job at the step that reaches the limit, billed
to that step, as `max_cost` does; before the attempt's trainer starts (`JobRun`), so a job that starts (or
is resumed) while its key is over its limit pauses without training, billed nothing; and with the budget
check, for a key that reaches its limit between steps (its completions).

Each step's metrics event carries the job's cost so far (`cost.accrued`) and its projection.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import asyncpg

from gateway.jobs import cost as job_cost
from gateway.jobs import running
from gateway.jobs import store as jobs_store
from gateway.jobs.store import JobRow
from gateway.limits.buckets import Buckets, key_month_key, month_key, to_micro
from gateway.limits.budget import (
    key_month_spend_usd,
    key_spend_limit_usd,
    month_spend_usd,
    monthly_budget_usd,
)
from gateway.usage.pricing import training_cost
from gateway.worker.context import JobContext
from gateway.worker.job.ingest import Progress
from gateway.worker.job.spec import calls_models

logger = logging.getLogger(__name__)

BUDGET_PAUSED = "Paused: the organisation's monthly budget is reached"
MAX_COST_PAUSED = "Paused: the job's cost reached its max_cost"
"""The start of the event's message; its data has `reason`, `max_cost`, `accrued` and `step`."""
KEY_LIMIT_PAUSED = "Paused: the monthly spend limit of the API key that created this job is reached"
"""The start of the event's message; its data has `reason`, `api_key_id`, `monthly_spend_limit`,
`month_to_date` and `step`."""


class Meter:
    """Meters one attempt of one job, held by `worker_id`."""

    def __init__(self, ctx: JobContext[JobRow], *, progress: Progress, spend: Buckets | None = None) -> None:
        self.ctx = ctx
        self.progress = progress
        self.spend = spend
        """The serving guard's month counters: training spend is added there as it is recorded."""
        self.usage_recorded = False
        self.budget_due = 0.0
        """Monotonic time of the next budget check."""
        self.earlier: tuple[int, float] | None = None
        """Trained tokens and USD of the job's earlier attempts (read once: they do not change meanwhile)."""
        self.graders: tuple[int | None, float] | None = None
        """The step and USD of the job's model graders' completions, as last read."""
        self.billed_to: tuple[int, float] | None = None
        """Cumulative tokens and seconds at the step that reached `max_cost` or the key's spend limit: the
        attempt is billed to it."""
        self.past_limit: bool | None = None
        """An earlier attempt was paused by `max_cost`, and the job resumed: this one goes on past it (None:
        not read yet)."""

    async def attempt_cost_usd(self, conn: asyncpg.Connection | asyncpg.Pool) -> float:
        """What this attempt has trained so far costs, priced as its usage will be when it is recorded."""
        earlier = await running.recorded_tokens(conn, job_id=self.ctx.id)
        tokens = max(0, (self.progress.tokens_seen or 0) - earlier)
        return training_cost(self.ctx.settings, self.ctx.row.model, tokens, self.progress.seconds)

    async def check_budget_when_due(self) -> bool:
        """:meth:`check_budget` and :meth:`check_key_limit`, at most every `budget_check_interval_s` (a
        failed check is logged and retried at the next one). True when it paused the job."""
        if time.monotonic() < self.budget_due:
            return False
        self.budget_due = time.monotonic() + self.ctx.settings.budget_check_interval_s
        try:
            return await self.check_budget() or await self.check_key_limit()
        except (OSError, asyncpg.PostgresError) as exc:
            logger.warning("job %s: budget check failed: %s", self.ctx.id, exc)
            return False

    async def check_budget(self) -> bool:
        """Pause the job when month-to-date spend plus this attempt's cost reaches the organisation's
        monthly budget (the caller stops its trainer). True when it paused the job."""
        budget = await monthly_budget_usd(self.ctx.pool, org_id=self.ctx.org_id)
        if budget is None:
            return False
        spent = await month_spend_usd(self.ctx.pool, self.ctx.settings, org_id=self.ctx.org_id)
        cost = await self.attempt_cost_usd(self.ctx.pool)
        if spent + cost < budget:
            return False
        if not await self.pause(BUDGET_PAUSED, "budget_paused"):
            return False
        logger.info(
            "job %s paused: month-to-date $%.6f + this run $%.6f reaches the budget $%.6f",
            self.ctx.id,
            spent,
            cost,
            budget,
        )
        return True

    async def accrued_usd(self) -> float:
        """The job's cost so far: its earlier attempts' recorded cost, its model graders' completions and this
        attempt's training up to its last reported step, or the step a limit paused it at (priced as its usage
        will be when recorded)."""
        pool, settings, org_id = self.ctx.pool, self.ctx.settings, self.ctx.org_id
        graders = 0.0
        if calls_models(self.ctx.row):  # read once a step: the step's event and its max_cost check share it
            step = self.progress.step
            if self.graders is None or self.graders[0] != step:
                found = await job_cost.graders_usd(pool, settings, org_id=org_id, job_ids=[self.ctx.id])
                self.graders = (step, found.get(self.ctx.id, 0.0))
            graders = self.graders[1]
        if self.earlier is None:
            self.earlier = await job_cost.recorded_usd(pool, settings, org_id=org_id, job_id=self.ctx.id)
        earlier_tokens, earlier_usd = self.earlier
        cumulative, seconds = self.progress.tokens_seen or 0, self.progress.seconds
        if self.billed_to is not None:  # paused: the steps the trainer finishes after it are not billed
            cumulative, seconds = min(cumulative, self.billed_to[0]), min(seconds, self.billed_to[1])
        attempt = training_cost(settings, self.ctx.row.model, max(0, cumulative - earlier_tokens), seconds)
        return earlier_usd + graders + attempt

    async def event_cost(self) -> dict[str, float] | None:
        """The `cost` of a step's metrics event: accrued so far, and projected over the job's steps (None
        when it cannot be read: the event goes without it)."""
        try:
            accrued = await self.accrued_usd()
        except (OSError, asyncpg.PostgresError) as exc:
            logger.warning("job %s: cost not read: %s", self.ctx.id, exc)
            return None
        step, total = self.progress.step or 0, self.ctx.row.total_steps or 0
        projected = accrued * max(total, step) / step if step > 0 and total > 0 else accrued
        return {"accrued": round(accrued, 6), "projected_total": round(projected, 6)}

    async def check_max_cost(self) -> bool:
        """Pause the job when its cost reaches its `max_cost` (the caller stops its trainer), at the step the
        trainer last reported. True when it paused the job."""
        limit = self.ctx.row.max_cost_usd
        if limit is None or self.progress.step is None or self.billed_to is not None or self.past_limit:
            return False
        if self.past_limit is None:  # paused by it before and resumed: the user chose to go on past it
            self.past_limit = await job_cost.paused_for_max_cost(self.ctx.pool, job_id=self.ctx.id)
            if self.past_limit:
                return False
        accrued = await self.accrued_usd()
        if accrued < limit:
            return False
        step = self.progress.step
        message = f"{MAX_COST_PAUSED}: ${accrued:.6f} of ${limit:.6f} at step {step}"
        data = {"reason": "max_cost", "max_cost": limit, "accrued": round(accrued, 6), "step": step}
        if not await self._pause_at_step(message, "max_cost_paused", data):
            return False
        logger.info("job %s paused: its cost $%.6f reached its max_cost $%.6f", self.ctx.id, accrued, limit)
        return True

    async def check_key_limit(self) -> bool:
        """Pause the job when the month's spend of the key that created it reaches the key's spend limit (the
        caller stops its trainer), at the step the trainer last reported (before its first step: nothing of
        the attempt is billed). True when it paused the job."""
        key_id = self.ctx.row.api_key_id
        if key_id is None or self.billed_to is not None:
            return False
        pool = self.ctx.pool
        limit = await key_spend_limit_usd(pool, key_id=key_id)
        if limit is None:
            return False
        spent = await key_month_spend_usd(pool, self.ctx.settings, org_id=self.ctx.org_id, key_id=key_id)
        if spent < limit:
            return False
        step = self.progress.step if self.progress.step is not None else self.progress.start_step
        message = f"{KEY_LIMIT_PAUSED}: ${spent:.6f} of ${limit:.6f} at step {step}"
        data = {
            "reason": "key_spend_limit",
            "api_key_id": key_id,
            "monthly_spend_limit": limit,
            "month_to_date": round(spent, 6),
            "step": step,
        }
        if not await self._pause_at_step(message, "key_limit_paused", data):
            return False
        logger.info("job %s paused: key %s spent $%.6f of its limit $%.6f", self.ctx.id, key_id, spent, limit)
        return True

    async def _pause_at_step(self, message: str, reason: str, data: dict[str, Any]) -> bool:
        """Pause the job at the step the trainer last reported, billed up to it."""
        if not await self.pause(message, reason, data):
            return False
        self.billed_to = (self.progress.tokens_seen or 0, self.progress.seconds)
        return True

    async def pause(self, message: str, reason: str, data: dict[str, Any] | None = None) -> bool:
        """Pause the running job this worker holds, with a warning event that says why (once an attempt).
        False when it no longer runs here (cancelled, paused or taken meanwhile: the next beat sees it)."""
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            row = await running.pause_own(conn, job_id=self.ctx.id, worker_id=self.ctx.worker_id)
            if row is None:
                return False
            await jobs_store.add_event(
                conn,
                job_id=self.ctx.id,
                org_id=self.ctx.org_id,
                level="warn",
                message=message,
                data=data,
                dedup_key=f"{reason}:{self.ctx.row.attempts}",
            )
        return True

    async def record_usage(self, conn: asyncpg.Connection, outcome: str, *, total_tokens: int = 0) -> None:
        """Write this attempt's training usage (once), in the caller's transaction.

        Tokens: the trainer's cumulative count (its result, else its last metrics event) less what earlier
        attempts already recorded; time: the trainer's start to its last reported step.
        """
        if self.usage_recorded:
            return
        self.usage_recorded = True
        cumulative = max(total_tokens, self.progress.tokens_seen or 0)
        earlier = await running.recorded_tokens(conn, job_id=self.ctx.id)
        seconds = self.progress.seconds
        if self.billed_to is not None:  # paused by its max_cost: billed up to the step that reached it
            cumulative, seconds = min(cumulative, self.billed_to[0]), min(seconds, self.billed_to[1])
        tokens = max(0, cumulative - earlier)
        await running.add_training_usage(
            conn,
            org_id=self.ctx.org_id,
            job_id=self.ctx.id,
            base_model=self.ctx.row.model,
            method=self.ctx.row.method.type,
            trained_tokens=tokens,
            steps=max(0, (self.progress.step or 0) - self.progress.start_step),
            seconds=seconds,
            outcome=outcome,
        )
        # The request guard's month counter in Redis counts this spend too, so completions see the budget that
        # training used (a rolled-back transaction would over-count: budgets err on the strict side).
        cost = training_cost(self.ctx.settings, self.ctx.row.model, tokens, seconds)
        if self.spend is not None and cost > 0:
            await self.spend.add_spent(month_key(self.ctx.org_id), to_micro(cost))
            if self.ctx.row.api_key_id is not None:  # the key's spend-limit counter, when it has one
                await self.spend.add_spent(key_month_key(self.ctx.row.api_key_id), to_micro(cost))

    def forget_usage(self) -> None:
        """The transaction that wrote the usage row was rolled back: write it again on the next try."""
        self.usage_recorded = False

"""A training job that reaches its organisation's monthly budget mid-run is paused with a checkpoint (not
killed), and resumes from that checkpoint once the budget is raised; through the SDK, the admin API and a real
worker process."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.limits.buckets import Buckets, make_limits_redis, month_key, to_micro
from gateway.worker.job.metering import BUDGET_PAUSED
from tests.support.data import SFT
from tests.support.fixtures import worker_fixture
from tests.support.jobs import (
    all_events,
    long_sft_job,
    metrics_steps,
    wait_for,
    wait_trainer_gone,
)
from tests.support.stack import Admin, GatewayServer, Tenant, WorkerProcess

pytestmark = pytest.mark.slow

STEPS = 400


budget_worker = worker_fixture(of="stack", TUNEGATE_BUDGET_CHECK_INTERVAL_S="1")


def _set_budget(admin: Admin, org_id: str, usd: float) -> dict:
    resp = admin.http.post(f"/v1/admin/organizations/{org_id}/billing", json={"monthly_budget_usd": usd})
    assert resp.status_code == 200, resp.text
    return resp.json()


def _month_counter(redis_url: str, org_id: str, *, open_month: bool = False) -> int:
    """The request guard's month spend counter in Redis (micro-USD); `open_month` starts it at 0 as the
    month's first completion would."""

    async def run() -> int:
        buckets = Buckets(make_limits_redis(redis_url))
        try:
            if open_month:
                await buckets.hold(month_key(org_id), gateway="test", limit=10**15, base=0, seed=0, ttl_ms=1)
            return int(await buckets.redis.hget(month_key(org_id), "spent") or 0)
        finally:
            await buckets.redis.aclose()

    return asyncio.run(run())


def test_budget_reached_pauses_then_resume_continues(
    stack: GatewayServer, budget_worker: WorkerProcess, admin: Admin, tenant: Tenant
) -> None:
    jobs = tenant.client.fine_tuning.jobs
    redis_url = stack.settings.redis_url or ""
    assert _month_counter(redis_url, tenant.org_id, open_month=True) == 0  # a completion opened the month
    # The only checkpoint is the one the pause makes.
    job = long_sft_job(tenant, SFT, steps=STEPS, checkpoint_every=1000)
    # The whole run's estimate must fit the budget at create time, so the budget shrinks once it trains.
    wait_for(tenant, job.id, ("running",), timeout=60)
    budget = 0.0001  # about 33 trained tokens at the default $3 per million: a few steps
    _set_budget(admin, tenant.org_id, budget)
    paused = wait_for(tenant, job.id, ("paused", "succeeded", "failed", "cancelled"), timeout=60)
    assert paused.status == "paused", paused.error
    wait_trainer_gone(job.id)
    assert jobs.retrieve(job.id).status == "paused"
    events = all_events(tenant, job.id)
    budget_events = [e for e in events if e.message == BUDGET_PAUSED]
    assert len(budget_events) == 1 and budget_events[0].level == "warn"
    ckpts = jobs.checkpoints.list(job.id).data
    assert len(ckpts) == 1, "the pause saved a checkpoint"
    saved = ckpts[0].step_number
    steps_before = metrics_steps(tenant, job.id)
    assert 1 <= saved < STEPS and max(steps_before) == saved
    # The paused attempt's usage is recorded and puts the month at (or past) the budget.
    # (written when the worker lets the job go, just after its trainer exits).
    deadline = time.monotonic() + 15
    while (
        admin.http.get(f"/v1/admin/organizations/{tenant.org_id}/billing").json()["month_to_date_usd"]
        < budget
    ):
        assert time.monotonic() < deadline, "the paused attempt's usage was not recorded"
        time.sleep(0.2)
    # The serving guard's counter saw that training spend too, so completions are held to the same budget.
    month_to_date = admin.http.get(f"/v1/admin/organizations/{tenant.org_id}/billing").json()[
        "month_to_date_usd"
    ]
    assert abs(_month_counter(redis_url, tenant.org_id) - to_micro(month_to_date)) <= 1

    # Still over budget: resuming alone would pause again, so the budget is raised first.
    assert _set_budget(admin, tenant.org_id, 1000.0)["monthly_budget_usd"] == 1000.0
    assert jobs.resume(job.id).status == "queued"
    deadline = time.monotonic() + 60
    while max(metrics_steps(tenant, job.id)) < saved + 3:
        assert time.monotonic() < deadline, "the resumed job did not progress"
        assert jobs.retrieve(job.id).status in ("queued", "running")
        time.sleep(0.3)
    steps_after = metrics_steps(tenant, job.id)
    assert steps_after[: len(steps_before)] == steps_before  # earlier steps were not trained again
    assert steps_after == list(range(1, len(steps_after) + 1))  # it went on from the checkpoint's step
    messages = [e.message for e in all_events(tenant, job.id)]
    started = f"Fine-tuning job started (attempt 2), resuming from step {saved}"
    assert started in messages, [m for m in messages if not m.startswith("Step ")]
    assert jobs.cancel(job.id).status == "cancelled"
    wait_trainer_gone(job.id)

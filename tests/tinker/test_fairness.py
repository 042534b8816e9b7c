"""Slot fairness: a Tinker training model does not keep the only training slot from another organisation's
work. Held past `tinker_max_hold_s` while it keeps sending requests, or idle past `tinker_yield_idle_s`, with
a fine-tuning job of another organisation queued, it is saved and lets the slot go after the request in hand;
the job trains, and the model's next request waits its turn and goes on from the same weights.

The stack tests run a worker with ONE training slot against a gateway on a database of its own; the store
tests check the order a holder asks (`gateway.work.store.fairest` with `holding`) on a migrated database.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
import pytest
import tinker
from tinker import types

from gateway.jobs import running
from gateway.jobs import store as jobs_store
from gateway.tenancy import store as tenancy_store
from gateway.tinker import store as tinker_store
from gateway.work import store
from gateway.work.store import Work
from tests.support.data import HELLO_SFT
from tests.support.fixtures import gateway_fixture
from tests.support.jobs import FINAL_STATES, long_sft_job, wait_for
from tests.support.stack import Admin, GatewayServer, Tenant, WorkerProcess

BOUND_S = 3.0
"""The hold bound of these tests (`tinker_max_hold_s`, `tinker_yield_idle_s`); the defaults are minutes."""
NEVER_S = "3600"
"""A bound the tests never reach: the other rules cannot explain a release."""
WAIT_S = BOUND_S + 240
"""Longest wait for the other organisation's job to start: the bound, and a loaded machine's slack."""

gw = gateway_fixture("tinker-fair", own_database=True, engine=False)

ROWS = [
    [5, 17, 42, 9, 33, 7, 61, 12],
    [8, 23, 4, 56, 19, 40, 11, 3],
]
DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )
    for tokens in ROWS
]


def one_slot_worker(gw: GatewayServer, log: Path, **bounds: str) -> WorkerProcess:
    return WorkerProcess(
        gw.settings,
        log,
        TUNEGATE_DEVICES="cpu:1",
        TUNEGATE_HEARTBEAT_INTERVAL_S="0.5",
        TUNEGATE_TINKER_IDLE_TIMEOUT_S=NEVER_S,
        **bounds,
    )


def logprobs(out: types.ForwardBackwardOutput) -> list[np.ndarray]:
    return [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]


def same_weights(got: types.ForwardBackwardOutput, want: list[np.ndarray]) -> None:
    for a, b in zip(logprobs(got), want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-7)


async def _model_row(gw: GatewayServer, model_id: str) -> dict[str, Any]:
    conn = await asyncpg.connect(gw.settings.database_url)
    try:
        row = await conn.fetchrow(
            """SELECT m.worker_id, m.resume_path, m.lost, s.finished_at
               FROM tinker_models m JOIN tinker_sessions s ON s.id = m.session_id WHERE m.id = $1""",
            model_id,
        )
    finally:
        await conn.close()
    assert row is not None
    return dict(row)


def trained_model(service: tinker.ServiceClient) -> tuple[tinker.TrainingClient, list[np.ndarray]]:
    """A model that trained one step (so a worker holds it), and its log-probabilities of `DATA` now."""
    tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=0)
    tc.forward_backward(DATA, "cross_entropy").result(timeout=300)
    tc.optim_step(types.AdamParams(learning_rate=0.02)).result(timeout=300)
    return tc, logprobs(tc.forward(DATA, "cross_entropy").result(timeout=300))


def assert_let_go_for(gw: GatewayServer, tc: tinker.TrainingClient, other: Tenant, job_id: str) -> None:
    """The job trains while the model's session is open, and the model was saved and let go (not lost)."""
    row = asyncio.run(_model_row(gw, tc.model_id))
    assert row["worker_id"] is None and row["lost"] is None and row["finished_at"] is None
    assert row["resume_path"] is not None and Path(row["resume_path"]).is_dir()
    other.client.fine_tuning.jobs.cancel(job_id)  # the slot comes back sooner than at the job's end
    assert wait_for(other, job_id, timeout=120).status == "cancelled"


def leave_no_job(t: Tenant, job_id: str | None) -> None:
    """Cancel the job unless it ended: a queued or running one would take the slot of the next test's
    worker (the tests share a database)."""
    if job_id is not None and t.client.fine_tuning.jobs.retrieve(job_id).status not in FINAL_STATES:
        t.client.fine_tuning.jobs.cancel(job_id)


@dataclass
class Contest:
    """A model that holds the only slot, and another organisation's job that waits for it."""

    tc: tinker.TrainingClient
    before: list[np.ndarray]
    """The model's log-probabilities of `DATA` once it trained."""
    other: Tenant
    job_id: str


@contextmanager
def contest(gw: GatewayServer, gw_admin: Admin, name: str, log: Path, **bounds: str) -> Iterator[Contest]:
    """A worker of one slot with `bounds`, a model of organisation `<name>-a` that trained a step (so the
    worker holds it) and a long job of `<name>-b` queued behind it; the job is cancelled unless it ended,
    and the worker stopped, at the end."""
    a, b = gw_admin.tenant(f"{name}-a"), gw_admin.tenant(f"{name}-b")
    worker = one_slot_worker(gw, log, **bounds)
    job_id = None
    try:
        service = tinker.ServiceClient(base_url=gw.url, api_key="tml-" + a.key)
        tc, before = trained_model(service)
        job_id = long_sft_job(b, HELLO_SFT, steps=200).id
        yield Contest(tc, before, b, job_id)
    finally:
        leave_no_job(b, job_id)
        worker.stop()


@pytest.mark.timeout(900)
def test_a_busy_model_lets_the_slot_go_after_the_bound(
    gw: GatewayServer, gw_admin: Admin, tmp_path: Path
) -> None:
    """The model's client keeps sending requests (forward passes and optimizer steps that move nothing);
    past `tinker_max_hold_s` the slot goes to the job that waits."""
    bounds = {"TUNEGATE_TINKER_MAX_HOLD_S": str(BOUND_S), "TUNEGATE_TINKER_YIELD_IDLE_S": NEVER_S}
    with contest(gw, gw_admin, "fair-busy", tmp_path / "worker.log", **bounds) as c:
        tc, before, b = c.tc, c.before, c.other
        still = types.AdamParams(learning_rate=0.0)  # a step that changes no weight
        deadline = time.monotonic() + WAIT_S
        answered = 0
        pending: Any = None
        while b.client.fine_tuning.jobs.retrieve(c.job_id).status != "running":
            assert time.monotonic() < deadline, "the job never got the slot the busy model held"
            if pending is None:
                forward = tc.forward(DATA, "cross_entropy")
                pending = (forward, tc.optim_step(still))
            if all(f.future().done() for f in pending):
                same_weights(pending[0].result(), before)
                pending[1].result()
                answered += 1
                pending = None
            else:
                time.sleep(0.05)
        assert answered > 0  # the model was busy when the job took the slot
        assert_let_go_for(gw, tc, b, c.job_id)
        if pending is not None:  # asked while the job held the slot: answered once it was back
            same_weights(pending[0].result(timeout=300), before)
            pending[1].result(timeout=300)
        again = tc.forward_backward(DATA, "cross_entropy").result(timeout=300)
        same_weights(again, before)  # the state it was saved with, weights and all


@pytest.mark.timeout(900)
def test_an_idle_model_lets_the_slot_go_when_work_waits(
    gw: GatewayServer, gw_admin: Admin, tmp_path: Path
) -> None:
    """Idle past `tinker_yield_idle_s` while a job waits, the model lets the slot go long before its hold
    bound or its idle timeout (both out of reach here)."""
    bounds = {"TUNEGATE_TINKER_MAX_HOLD_S": NEVER_S, "TUNEGATE_TINKER_YIELD_IDLE_S": str(BOUND_S)}
    with contest(gw, gw_admin, "fair-idle", tmp_path / "worker.log", **bounds) as c:
        wait_for(c.other, c.job_id, states=("running",), timeout=WAIT_S)
        assert_let_go_for(gw, c.tc, c.other, c.job_id)
        out = c.tc.forward_backward(DATA, "cross_entropy").result(timeout=300)
        same_weights(out, c.before)
        step = c.tc.optim_step(types.AdamParams(learning_rate=0.02)).result(timeout=300)
        assert step is not None


# ------------------------------------------------------------------------------------------- the order
async def _org(pool: asyncpg.Pool, name: str) -> str:
    return str((await tenancy_store.create_org(pool, name=name)).id)


async def _job(pool: asyncpg.Pool, org_id: str, status: str = "queued") -> str:
    job = await jobs_store.insert(
        pool, org_id=org_id, api_key_id=None, model="tiny-chat", training_file="file-none",
        validation_file=None, seed=1, suffix=None, metadata=None, integrations=None, idempotency_key=None,
        method={"type": "supervised", "supervised": {"hyperparameters": {}}}, request_hash=None,
    )  # fmt: skip
    await pool.execute(
        "UPDATE fine_tuning_jobs SET status = $2, queued_at = now(), started_at = now() WHERE id = $1",
        job.id,
        status,
    )
    return str(job.id)


async def _held_model(pool: asyncpg.Pool, org_id: str, name: str) -> str:
    """A Tinker model held by worker `w`, with one open request."""
    model_id = f"ts-{name}:train:0"
    await tinker_store.create_model(
        pool, model_id=model_id, org_id=org_id, key_id="key", session_id=f"ts-{name}", base_model="tiny-chat",
        rank=4, lora_config={"rank": 4}, metadata=None,
    )  # fmt: skip
    assert await tinker_store.claim(pool, model_id=model_id, worker_id="w") is not None
    await tinker_store.add_request(
        pool, request_id=f"tr-{name}", org_id=org_id, model_id=model_id, kind="forward_backward", payload={}
    )
    return model_id


async def test_a_holder_gives_way_only_to_work_the_fair_order_puts_first(migrated_pool: asyncpg.Pool) -> None:
    pool = migrated_pool
    a, b = await _org(pool, "order-a"), await _org(pool, "order-b")
    held = await _held_model(pool, a, "ordera")
    keep = Work("tinker", held)
    # nothing waits: the model is first (itself)
    assert await store.fairest(pool, free=1, holding=held) == keep
    assert await store.fairest(pool, free=0) is None
    # b runs a job elsewhere, a runs nothing once its model is let go: a's model is first, no reason to go
    await _job(pool, b, status="running")
    queued = await _job(pool, b)
    assert await store.fairest(pool, free=1, holding=held) == keep
    # b's running job ends: b's queued job is first, though a's model's request waited longer
    await pool.execute(
        "UPDATE fine_tuning_jobs SET status = 'succeeded' WHERE organization_id = $1 AND status = 'running'",
        b,
    )
    assert await store.fairest(pool, free=1, holding=held) == Work("job", queued)
    # let go with its request open, the model ranks after the job it let go for in the claims that follow
    assert await tinker_store.hand_back_model(pool, model_id=held, worker_id="w", resume_path="/saved")
    assert await tinker_store.model_asked(pool, model_id=held)
    assert await store.fairest(pool, free=1) == Work("job", queued)
    assert await running.claim(pool, job_id=queued, worker_id="w") is not None
    assert await store.fairest(pool, free=1) == keep
    row = await pool.fetchrow("SELECT worker_id, resume_path FROM tinker_models WHERE id = $1", held)
    assert (row["worker_id"], row["resume_path"]) == (None, "/saved")
    # only the holder lets its model go
    assert not await tinker_store.hand_back_model(pool, model_id=held, worker_id="w", resume_path="/other")

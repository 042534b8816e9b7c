"""The lease every kind of worker-held work shares (`gateway.work.lease`), tested once for all three kinds:
fine-tuning jobs, eval runs and Tinker training models.

On a migrated database of the test's own and the real Redis, with each area's `Lease` and the lease's
functions as the worker's crons call them: one claim wins, missed work gets a wake-up, a worker shutting
down hands its work back, stale work is re-queued until `max_attempts` and then failed (a Tinker model,
whose weights die with its holder, at once), and fresh work is left alone. The fair order across
organisations is that of the kinds that take a worker's devices (jobs and Tinker models; eval runs take a
slot each, in the order they were queued).
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest
from arq.connections import ArqRedis

from gateway.evals import store as evals_store
from gateway.evals.store import RUN_LEASE
from gateway.jobs import store as jobs_store
from gateway.jobs.running import JOB_LEASE
from gateway.queue import make_queue
from gateway.settings import Settings
from gateway.tenancy import store as tenancy_store
from gateway.tinker.store import MODEL_LEASE
from gateway.work import lease
from gateway.work import store as work_store
from gateway.work.lease import Lease
from gateway.work.store import Work
from tests.support.stack import Services
from tests.support.work import waiting_model


@dataclass(frozen=True)
class Kind:
    """One kind of work, as the test makes and reads it."""

    lease: Lease
    waiting: Callable[[asyncpg.Pool, str, str], Awaitable[str]]
    """Make work of the kind that waits for a worker, for an organisation; its id."""
    table: str
    status: str
    """The work's status in words, as an SQL expression."""
    queued: str
    failed: str


async def _job(pool: asyncpg.Pool, org_id: str, name: str) -> str:
    job = await jobs_store.insert(
        pool, org_id=org_id, api_key_id=None, model="tiny-chat", training_file="file-none",
        validation_file=None, seed=1, suffix=None, metadata=None, integrations=None, idempotency_key=None,
        method={"type": "supervised", "supervised": {"hyperparameters": {"gpus": 1}}}, request_hash=None,
    )  # fmt: skip
    queue = "UPDATE fine_tuning_jobs SET status = 'queued', queued_at = now() WHERE id = $1"
    await pool.execute(queue, job.id)
    return str(job.id)


async def _run(pool: asyncpg.Pool, org_id: str, name: str) -> str:
    source = {"type": "jsonl", "source": {"type": "file_content", "content": []}}
    made = await evals_store.insert_eval(
        pool, org_id=org_id, name=name, metadata=None, data_source_config={"type": "custom"},
        testing_criteria=[],
    )  # fmt: skip
    run = await evals_store.insert_run(
        pool, eval_id=made.id, org_id=org_id, api_key_id="key", name=name, model="tiny-chat", metadata=None,
        data_source=source, testing_criteria=[],
    )  # fmt: skip
    return str(run.id)


async def _model(pool: asyncpg.Pool, org_id: str, name: str) -> str:
    """A Tinker model with one open request and no holder."""
    # its wake-up's arq job id is unique to the test
    return await waiting_model(pool, org_id, f"{name}-{uuid.uuid4().hex[:8]}")


MODEL_STATUS = "CASE WHEN lost IS NULL THEN 'waiting' ELSE 'lost' END"
"""A Tinker model has no status: it waits for a holder, is held, or is lost."""

KINDS = {
    "job": Kind(JOB_LEASE, _job, "fine_tuning_jobs", "status", "queued", "failed"),
    "eval_run": Kind(RUN_LEASE, _run, "eval_runs", "status", "queued", "failed"),
    "tinker_model": Kind(MODEL_LEASE, _model, "tinker_models", MODEL_STATUS, "waiting", "lost"),
}


@pytest.fixture(params=list(KINDS))
def kind(request: pytest.FixtureRequest) -> Kind:
    return KINDS[request.param]


@pytest.fixture
async def ctx(migrated_pool: asyncpg.Pool, services: Services) -> AsyncIterator[dict[str, Any]]:
    """What the worker's crons get, on the test's own database and a queue of the test's own."""
    settings = Settings(queue_name=f"test-lease:{uuid.uuid4().hex}", stale_after_s=30.0, max_attempts=2)
    queue = make_queue(services.redis_url)
    yield {"pool": migrated_pool, "redis": queue, "settings": settings, "worker_id": "w1"}
    keys = [f"arq:job:{job.job_id}" for job in await queue.queued_jobs(queue_name=settings.queue_name)]
    keys += await queue.keys(f"{settings.queue_name}*")
    if keys:
        await queue.delete(*keys)
    await queue.aclose()


async def _org(pool: asyncpg.Pool, name: str) -> str:
    return str((await tenancy_store.create_org(pool, name=name)).id)


async def _wake_ups(ctx: dict[str, Any]) -> list[tuple[str, tuple[Any, ...]]]:
    queue: ArqRedis = ctx["redis"]
    queued = await queue.queued_jobs(queue_name=ctx["settings"].queue_name)
    return [(job.function, job.args) for job in queued]


async def _state(ctx: dict[str, Any], kind: Kind, id: str) -> tuple[str, str | None]:
    row = await ctx["pool"].fetchrow(f"SELECT {kind.status}, worker_id FROM {kind.table} WHERE id = $1", id)
    return row[0], row[1]


async def _go_stale(ctx: dict[str, Any], kind: Kind, id: str) -> None:
    """The holder stops beating: its last beat is older than `stale_after_s`."""
    stale = f"UPDATE {kind.table} SET heartbeat_at = now() - interval '1 hour' WHERE id = $1"
    await ctx["pool"].execute(stale, id)


async def test_one_claim_wins_and_the_holder_beats(ctx: dict[str, Any], kind: Kind) -> None:
    pool = ctx["pool"]
    work = await kind.waiting(pool, await _org(pool, "claim"), "claim")
    assert await lease.claim(pool, kind.lease, id=work, worker_id="w1") is not None
    assert await lease.claim(pool, kind.lease, id=work, worker_id="w2") is None
    assert (await _state(ctx, kind, work))[1] == "w1"
    assert await lease.heartbeat(pool, kind.lease, id=work, worker_id="w1") is not None
    assert await lease.heartbeat(pool, kind.lease, id=work, worker_id="w2") is None


async def test_missed_work_gets_a_wake_up(ctx: dict[str, Any], kind: Kind) -> None:
    pool = ctx["pool"]
    org = await _org(pool, "missed")
    work = await kind.waiting(pool, org, "missed")
    held = await kind.waiting(pool, org, "held")
    assert await lease.claim(pool, kind.lease, id=held, worker_id="w1") is not None
    assert await lease.requeue_missed(ctx, kind.lease) == 1
    assert await _wake_ups(ctx) == [(kind.lease.function, (work,))]
    assert await lease.requeue_missed(ctx, kind.lease) == 1  # the same wake-up: arq keeps one
    assert len(await _wake_ups(ctx)) == 1


async def test_a_worker_shutting_down_hands_its_work_back(ctx: dict[str, Any], kind: Kind) -> None:
    pool = ctx["pool"]
    work = await kind.waiting(pool, await _org(pool, "back"), "back")
    assert await lease.claim(pool, kind.lease, id=work, worker_id="w1") is not None
    queued_again = await lease.hand_back(ctx, kind.lease, work)
    assert queued_again == (kind.lease.requeue_own is not None)
    assert await _state(ctx, kind, work) == (kind.queued, None)
    if queued_again:
        assert await _wake_ups(ctx) == [(kind.lease.function, (work,))]
    assert await lease.claim(pool, kind.lease, id=work, worker_id="w2") is not None  # another may take it


async def test_stale_work_is_taken_back_until_max_attempts(ctx: dict[str, Any], kind: Kind) -> None:
    pool = ctx["pool"]
    work = await kind.waiting(pool, await _org(pool, "stale"), "stale")
    fresh = await kind.waiting(pool, await _org(pool, "fresh"), "fresh")
    assert await lease.claim(pool, kind.lease, id=fresh, worker_id="w2") is not None
    max_attempts = ctx["settings"].max_attempts
    for attempt in range(1, max_attempts + 1):
        assert await lease.claim(pool, kind.lease, id=work, worker_id="w1") is not None
        await _go_stale(ctx, kind, work)
        assert await lease.reap_stale(ctx, kind.lease) == 1
        if kind.lease.requeue_stale is None or attempt == max_attempts:
            break
        assert await _state(ctx, kind, work) == (kind.queued, None)
        assert (kind.lease.function, (work,)) in await _wake_ups(ctx)
    assert await _state(ctx, kind, work) == (kind.failed, None)
    assert await lease.claim(pool, kind.lease, id=work, worker_id="w3") is None  # failed work stays failed
    assert (await _state(ctx, kind, fresh))[1] == "w2"  # a holder that beats keeps its work
    assert await lease.reap_stale(ctx, kind.lease) == 0


async def test_the_reaper_runs_the_kinds_hooks(ctx: dict[str, Any], kind: Kind) -> None:
    """A job's re-queue and failure are events of the job; a Tinker model's open requests fail with it."""
    pool = ctx["pool"]
    work = await kind.waiting(pool, await _org(pool, "hooks"), "hooks")
    losses = ctx["settings"].max_attempts if kind.lease.requeue_stale is not None else 1
    for _ in range(losses):
        assert await lease.claim(pool, kind.lease, id=work, worker_id="w1") is not None
        await _go_stale(ctx, kind, work)
        await lease.reap_stale(ctx, kind.lease)
    if kind.lease.kind == "job":
        events = await pool.fetch("SELECT level, message FROM fine_tuning_job_events WHERE job_id = $1", work)
        assert [e["level"] for e in events] == ["warn", "error"]
        assert "giving up" in events[-1]["message"]
    if kind.lease.kind == "tinker_model":
        request = await pool.fetchrow("SELECT status, error FROM tinker_requests WHERE model_id = $1", work)
        assert request["status"] == "failed" and "stopped responding" in request["error"]


@pytest.mark.parametrize("name", ["job", "tinker_model"])
async def test_the_fairest_claim_goes_to_the_organisation_holding_least(
    ctx: dict[str, Any], name: str
) -> None:
    """Work that takes a worker's devices is claimed fairly across organisations: the one that holds the
    least first, whatever waited longest."""
    kind = KINDS[name]
    pool = ctx["pool"]
    busy, idle = await _org(pool, "busy"), await _org(pool, "idle")
    first = await kind.waiting(pool, busy, "first")
    assert await lease.claim(pool, kind.lease, id=first, worker_id="w1") is not None
    older = await kind.waiting(pool, busy, "older")
    await asyncio.sleep(0.01)
    newer = await kind.waiting(pool, idle, "newer")
    wanted = "job" if name == "job" else "tinker"
    assert await work_store.fairest(pool, free=1) == Work(wanted, newer)  # type: ignore[arg-type]
    assert await lease.claim(pool, kind.lease, id=newer, worker_id="w1") is not None
    assert await work_store.fairest(pool, free=1) == Work(wanted, older)  # type: ignore[arg-type]

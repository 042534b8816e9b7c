"""One claim for both kinds of work a worker runs on its devices: queued fine-tuning jobs and Tinker training
models waiting for a holder are ordered by the same fairness across organisations (fewest running jobs and
held models first, then the organisation that started either least recently, then the oldest waiting).

On a migrated database of its own, with the worker's and the Tinker API's own store functions.
"""

from __future__ import annotations

import asyncio

import asyncpg

from gateway.jobs import running
from gateway.jobs import store as jobs_store
from gateway.tenancy import store as tenancy_store
from gateway.tinker import store as tinker_store
from gateway.work import store
from gateway.work.store import Work
from tests.support.work import waiting_model


async def _org(pool: asyncpg.Pool, name: str) -> str:
    return str((await tenancy_store.create_org(pool, name=name)).id)


async def _queued_job(pool: asyncpg.Pool, org_id: str, gpus: int = 1) -> str:
    job = await jobs_store.insert(
        pool, org_id=org_id, api_key_id=None, model="tiny-chat", training_file="file-none",
        validation_file=None, seed=1, suffix=None, metadata=None, integrations=None, idempotency_key=None,
        method={"type": "supervised", "supervised": {"hyperparameters": {"gpus": gpus}}}, request_hash=None,
    )  # fmt: skip
    queue = "UPDATE fine_tuning_jobs SET status = 'queued', queued_at = now() WHERE id = $1"
    await pool.execute(queue, job.id)
    return str(job.id)


async def _take(pool: asyncpg.Pool, free: int = 1) -> Work | None:
    """What a worker with `free` devices takes next, taken as `take_work` takes it."""
    work = await store.fairest(pool, free=free)
    if work is not None and work.kind == "job":
        assert await running.claim(pool, job_id=work.id, worker_id="w") is not None
    elif work is not None:
        assert await tinker_store.claim(pool, model_id=work.id, worker_id="w") is not None
    await asyncio.sleep(0.01)  # distinct start times
    return work


async def test_jobs_and_tinker_models_share_one_fair_order(migrated_pool: asyncpg.Pool) -> None:
    pool = migrated_pool
    a, b, c = [await _org(pool, name) for name in ("fair-a", "fair-b", "fair-c")]
    a1 = await _queued_job(pool, a)
    assert await _take(pool) == Work("job", a1)  # a is running one job now
    a2 = await _queued_job(pool, a)
    b1 = await waiting_model(pool, b, "b1")
    # b runs nothing: its model goes before a's second job, although that job waited longer
    assert await _take(pool) == Work("tinker", b1)
    c1 = await waiting_model(pool, c, "c1")
    b2 = await _queued_job(pool, b)
    assert await _take(pool) == Work("tinker", c1)  # c runs nothing
    # a, b and c each run one: a started least recently, then b, then c
    c2 = await _queued_job(pool, c)
    assert await _take(pool) == Work("job", a2)
    assert await _take(pool) == Work("job", b2)
    assert await _take(pool) == Work("job", c2)
    assert await _take(pool) is None


async def test_only_work_that_fits_and_can_be_held_is_taken(migrated_pool: asyncpg.Pool) -> None:
    pool = migrated_pool
    a, b = [await _org(pool, name) for name in ("fits-a", "fits-b")]
    big = await _queued_job(pool, a, gpus=2)
    lost = await waiting_model(pool, b, "lost")
    await tinker_store.lose(pool, model_id=lost, reason="its holder died")
    assert await store.fairest(pool, free=1) is None  # the job needs two devices; a lost model has no weights
    assert await store.fairest(pool, free=0) is None
    assert await store.fairest(pool, free=2) == Work("job", big)
    held = await waiting_model(pool, b, "held")
    assert await tinker_store.claim(pool, model_id=held, worker_id="w") is not None
    assert await store.fairest(pool, free=1) is None  # a held model waits for no one
    # a job another worker claimed between the choice and the claim is not claimed twice
    assert await running.claim(pool, job_id=big, worker_id="w1") is not None
    assert await running.claim(pool, job_id=big, worker_id="w2") is None

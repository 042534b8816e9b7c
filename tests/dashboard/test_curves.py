"""The job page's curves of a long job, read from PostgreSQL: thinned evenly in the query, never losing the
first or the last step, only after the cursor, and only the job's own organisation's."""

from __future__ import annotations

from collections.abc import AsyncIterator

import asyncpg
import pytest

from bench.dashboard import job_with_metrics
from gateway.dashboard import store
from gateway.db import create_pool
from gateway.ids import new_id
from gateway.jobs import store as jobs_store
from gateway.tenancy import store as tenancy_store
from tests.support.stack import GatewayServer


@pytest.fixture
async def pool(stack: GatewayServer) -> AsyncIterator[asyncpg.Pool]:
    assert stack.settings.database_url  # the session's gateway has migrated the shared database
    made = await create_pool(stack.settings.database_url, min_size=1, max_size=2)
    yield made
    await made.close()


async def _job(pool: asyncpg.Pool, org_id: str, steps: int) -> str:
    return await job_with_metrics(pool, org_id, [{"step": s} for s in range(1, steps + 1)])


async def test_long_jobs_are_thinned_in_the_query(pool: asyncpg.Pool) -> None:
    org = (await tenancy_store.create_org(pool, name="curves")).id
    other = (await tenancy_store.create_org(pool, name="curves-other")).id
    job = await _job(pool, org, 10_000)

    kept, count, stride, cursor = await store.job_metrics(
        pool, org_id=org, job_id=job, after_seq=0, points=2000
    )
    steps = [d["step"] for d in kept]
    assert (count, stride, len(steps)) == (10_000, 5, 2001)
    assert steps[0] == 1 and steps[-1] == 10_000 and steps[1:-1] == list(range(6, 10_000, 5))

    kept, count, stride, _ = await store.job_metrics(pool, org_id=org, job_id=job, after_seq=0, points=10_000)
    assert stride == 1 and [d["step"] for d in kept] == list(range(1, 10_001))

    await pool.execute(
        jobs_store.INSERT_EVENT,
        new_id("ftevent-"),
        job,
        org,
        "info",
        "Step",
        "metrics",
        {"step": 10_001},
        "metrics:10001",
    )
    kept, count, _, after = await store.job_metrics(
        pool, org_id=org, job_id=job, after_seq=cursor, points=2000
    )
    assert [d["step"] for d in kept] == [10_001] and count == 1 and after > cursor
    assert await store.job_metrics(pool, org_id=org, job_id=job, after_seq=after, points=2000) == (
        [],
        0,
        1,
        after,
    )

    assert await store.job_metrics(pool, org_id=other, job_id=job, after_seq=0, points=2000) == ([], 0, 1, 0)
    assert not await store.job_exists(pool, org_id=other, job_id=job)

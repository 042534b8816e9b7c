"""One lease for every kind of work a worker holds: fine-tuning jobs, eval runs and Tinker training models.

Work of each kind is a row that a worker holds while it runs it, through the same lifecycle:

* **claim**: one guarded `UPDATE` takes the row for this worker (`worker_id`, `heartbeat_at`), so two workers
  woken for it cannot both hold it;
* **heartbeat**: while it holds the row the worker stamps `heartbeat_at`, and reads the row's status (a
  cancel or a pause reaches the worker this way); no row back means the work was taken from it;
* **hand back**: a worker shutting down puts what it holds back in the queue, with a wake-up of its own
  (`hand_back`), or just lets it go when that cannot be done;
* **requeue when missed**: queued work that no worker holds gets a wake-up again (`requeue_missed`: Redis was
  down when it was queued, or its wake-up was spent on other work);
* **reap when stale**: work whose worker stopped heartbeating for `stale_after_s` is taken back
  (`reap_stale`): re-queued, or failed once it was lost `max_attempts` times, or at once for a kind whose
  state dies with its worker (a Tinker model's unsaved weights).

A `Lease` is one kind's SQL for these steps, the arq function that wakes a worker for it, and its hooks (a
job's events, an eval run's key revoked); the steps are written once, here. Each area's store owns its
table's statements and exports its `Lease` (`gateway.jobs.running.JOB_LEASE`, `gateway.evals.store.
RUN_LEASE`, `gateway.tinker.store.MODEL_LEASE`), and the worker builds its cron list from them
(`gateway.worker.main.LEASES`).

A fourth kind of worker-held work (batch inference, say) is one `Lease` plus one run function: its table's
lease columns (`worker_id`, `heartbeat_at`, `attempts`, `queue_generation` and a status), its statements and
hooks in its own store, its run function registered with the worker beside `run_job`, and its `Lease` added
to `LEASES`. The shared behaviour is tested once for every kind (`tests/work/test_lease.py`).

Statements take positional parameters, the same for every kind:

====================  ======================================  ================================================
statement             parameters                              returns
====================  ======================================  ================================================
`claim`               $1 id, $2 worker                        the row, none when another holds it
`heartbeat`           $1 id, $2 worker                        the status (first column), none when lost
`release`             $1 id, $2 worker                        a row when this worker held it
`requeue_own`         $1 id, $2 worker                        `queue_generation`; none when not running
`queued_unclaimed`    (none)                                  `id`, `queue_generation` of each waiting one
`stale`               $1 seconds                              `id`, `organization_id`, `worker_id`,
                                                              `attempts` (and what the hooks read)
`requeue_stale`       $1 id, $2 worker                        `queued` (whether it was queued again),
                                                              `queue_generation`; none when not held
`fail_stale`          $1 id, $2 worker, $3 the error          a row when it failed it
====================  ======================================  ================================================
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import asyncpg

from gateway.db import Conn
from gateway.queue import enqueue
from gateway.settings import Settings

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class StaleWork:
    """Work whose worker stopped heartbeating, as the kind's `stale` statement read it."""

    id: str
    organization_id: str
    worker_id: str
    attempts: int
    """Claims so far (0 for a kind that does not count them: it is never re-queued)."""
    row: Mapping[str, Any]
    """Everything `stale` selected, for the kind's hooks (a job's last checkpoint, a run's key)."""

    @classmethod
    def of(cls, record: Mapping[str, Any]) -> StaleWork:
        return cls(
            id=record["id"],
            organization_id=record["organization_id"],
            worker_id=record["worker_id"],
            attempts=int(record.get("attempts") or 0),
            row=record,
        )


OnStale = Callable[[asyncpg.Pool, StaleWork], Awaitable[None]]
"""Before the reaper decides: undo what the lost worker held outside the row (its minted keys)."""
OnFailed = Callable[[asyncpg.Connection, StaleWork, Any], Awaitable[None]]
"""In the transaction that failed stale work, with the error stored (a job's event, open requests failed)."""
OnRequeued = Callable[[asyncpg.Connection, StaleWork, int], Awaitable[None]]
"""In the transaction that re-queued stale work, with its new queue generation (a job's event)."""


@dataclass(frozen=True, slots=True)
class Lease:
    """One kind of worker-held work: its statements (see the module's table), its wake-up and its hooks."""

    kind: str
    """A name for logs: `job`, `eval_run`, `tinker_model`."""
    function: str
    """The arq function that wakes a worker for it (`gateway.queue.RUN_JOB`, ...)."""
    claim: str
    heartbeat: str
    release: str
    queued_unclaimed: str
    stale: str
    fail_stale: str
    give_up: Callable[[StaleWork, Settings], Any]
    """The error `fail_stale` stores for stale work that is not re-queued."""
    requeue_own: str | None = None
    """None: what a worker holds cannot be put back by it (it is let go: `release`)."""
    requeue_stale: str | None = None
    """None: the work's state dies with its worker, so stale work is failed at once."""
    on_stale: OnStale | None = None
    on_failed: OnFailed | None = None
    on_requeued: OnRequeued | None = None


async def claim(conn: Conn, lease: Lease, *, id: str, worker_id: str) -> asyncpg.Record | None:
    """Take work `id` for `worker_id`; None when another worker holds it, or it is not waiting."""
    return await conn.fetchrow(lease.claim, id, worker_id)


async def heartbeat(conn: Conn, lease: Lease, *, id: str, worker_id: str) -> Any:
    """Stamp held work; its status, or None when `worker_id` no longer holds it."""
    return await conn.fetchval(lease.heartbeat, id, worker_id)


async def wake(ctx: Mapping[str, Any], lease: Lease, id: str, generation: int) -> bool:
    """Enqueue the wake-up of queued work `id` (one per queue generation); False when Redis is away."""
    settings: Settings = ctx["settings"]
    return await enqueue(ctx["redis"], settings.queue_name, id, generation, function=lease.function)


async def hand_back(
    ctx: Mapping[str, Any],
    lease: Lease,
    id: str,
    *,
    within: Callable[[asyncpg.Connection], Awaitable[None]] | None = None,
) -> bool:
    """The worker is shutting down: queue work `id` that it holds again and wake a worker for it, or let it
    go when it no longer runs (cancelled, paused) or its kind cannot be put back. `within` runs in the
    transaction that re-queues it (a job's usage of the attempt). True when it was queued again."""
    pool: asyncpg.Pool = ctx["pool"]
    worker_id: str = ctx["worker_id"]
    generation = None
    if lease.requeue_own is not None:
        async with pool.acquire() as conn, conn.transaction():
            generation = await conn.fetchval(lease.requeue_own, id, worker_id)
            if generation is not None and within is not None:
                await within(conn)
    if generation is None:
        await pool.execute(lease.release, id, worker_id)
        return False
    await wake(ctx, lease, id, generation)
    return True


async def requeue_missed(ctx: Mapping[str, Any], lease: Lease) -> int:
    """Wake a worker for each queued work of the kind that no worker holds; how many wake-ups were sent."""
    sent = 0
    for row in await ctx["pool"].fetch(lease.queued_unclaimed):
        if await wake(ctx, lease, row["id"], row["queue_generation"]):
            sent += 1
    return sent


async def reap_stale(ctx: Mapping[str, Any], lease: Lease) -> int:
    """Take work of the kind back from workers that stopped heartbeating: run its `on_stale` hook, then
    re-queue it (with a wake-up), or fail it once it was lost `max_attempts` times (or at once, for a kind
    that cannot be re-queued). Each change is guarded by the lost worker still holding the row, so a reaper
    racing another, or the worker coming back, changes nothing twice. How many were taken back."""
    settings: Settings = ctx["settings"]
    pool: asyncpg.Pool = ctx["pool"]
    reaped = 0
    for record in await pool.fetch(lease.stale, settings.stale_after_s):
        row = StaleWork.of(record)
        if lease.on_stale is not None:
            await lease.on_stale(pool, row)
        if lease.requeue_stale is None or row.attempts >= settings.max_attempts:
            error = lease.give_up(row, settings)
            async with pool.acquire() as conn, conn.transaction():
                failed = await conn.fetchrow(lease.fail_stale, row.id, row.worker_id, error)
                if failed is not None and lease.on_failed is not None:
                    await lease.on_failed(conn, row, error)
            if failed is not None:
                logger.info("%s %s: failed, its worker %s was lost", lease.kind, row.id, row.worker_id)
                reaped += 1
            continue
        async with pool.acquire() as conn, conn.transaction():
            requeued = await conn.fetchrow(lease.requeue_stale, row.id, row.worker_id)
            if requeued is not None and requeued["queued"] and lease.on_requeued is not None:
                await lease.on_requeued(conn, row, requeued["queue_generation"])
        if requeued is None:
            continue
        reaped += 1
        if requeued["queued"]:
            logger.info("%s %s: re-queued, its worker %s was lost", lease.kind, row.id, row.worker_id)
            await wake(ctx, lease, row.id, requeued["queue_generation"])
    return reaped

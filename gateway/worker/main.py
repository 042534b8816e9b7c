"""The worker (scheduler), in arq's idiom: `run_job` trains one job, `run_tinker_model` holds a Tinker
training model, `run_eval` executes an eval run (`gateway.worker.evals`). Every kind of work has one lease
(`gateway.work.lease`): for each in `LEASES`, one cron re-enqueues the work that missed the queue and one
takes work back from workers that died.

A queue message only wakes a worker: `run_job` claims the fairest queued job in one SQL statement (the
organisation with the fewest running jobs first), so one organisation's many jobs cannot starve another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
from typing import Any

import asyncpg
from arq import cron

from envsdk.sandbox import remove_stale_dirs
from gateway.billing.outbox import run_billing
from gateway.blobstore import BlobStore
from gateway.db import create_pool, migrate
from gateway.evals.store import RUN_LEASE
from gateway.ids import new_id
from gateway.jobs import running
from gateway.jobs.running import JOB_LEASE
from gateway.jobs.store import JobRow
from gateway.limits.buckets import Buckets, make_limits_redis
from gateway.notices import Notices
from gateway.queue import RUN_JOB, make_queue
from gateway.settings import Settings
from gateway.tinker import store as tinker_store
from gateway.tinker.holder import Holder
from gateway.tinker.housekeeping import tinker_housekeeping
from gateway.tinker.rows import TrainingModelRow
from gateway.tinker.store import MODEL_LEASE
from gateway.work import lease, presence
from gateway.work import store as work_store
from gateway.work.devices import DevicePool, generation_devices, parse_devices
from gateway.work.lease import Lease
from gateway.work.resilience import Worker
from gateway.worker.context import JobContext
from gateway.worker.evals import run_eval
from gateway.worker.runner import JobRun

logger = logging.getLogger(__name__)

LEASES: tuple[Lease, ...] = (JOB_LEASE, RUN_LEASE, MODEL_LEASE)
"""Every kind of work a worker holds (`gateway.work.lease`)."""


async def startup(ctx: dict[str, Any]) -> None:
    settings: Settings = ctx["settings"]
    assert settings.database_url
    await migrate(settings.database_url)
    ctx["pool"] = await create_pool(settings.database_url, min_size=1, max_size=4)
    ctx["blobs"] = BlobStore(settings.blob_dir)
    ctx["notices"] = Notices(settings.database_url, (tinker_store.REQUEST_CHANNEL,))
    await asyncio.to_thread(remove_stale_dirs)  # sandbox dirs a killed worker left behind
    ctx["worker_id"] = f"{socket.gethostname()}:{os.getpid()}:{new_id('', 6)}"
    await work_store.announce(
        ctx["pool"], worker_id=ctx["worker_id"], devices=ctx["devices"].size, kind=_kind(ctx)
    )
    ctx["eval_slots"] = asyncio.Semaphore(settings.eval_run_slots)
    ctx["spend"] = Buckets(make_limits_redis(settings.redis_url)) if settings.redis_url else None
    if settings.worker_metrics_port:
        from prometheus_client import start_http_server

        start_http_server(settings.worker_metrics_port)  # the trainers' environment wait (job/ingest.py)
    ctx["presence"] = asyncio.create_task(
        presence.keep_stamping(
            ctx["redis"], settings.queue_name, ctx["worker_id"], settings.heartbeat_interval_s
        )
    )
    logger.info(
        "worker %s ready with %s", ctx["worker_id"], ", ".join(str(d) for d in ctx["devices"].devices)
    )


def _kind(ctx: dict[str, Any]) -> str:
    pool: DevicePool = ctx["devices"]
    return pool.devices[0].kind


async def shutdown(ctx: dict[str, Any]) -> None:
    stamping: asyncio.Task[None] | None = ctx.get("presence")
    if stamping is not None:
        stamping.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await stamping
        await presence.leave(ctx["redis"], ctx["settings"].queue_name, ctx["worker_id"])
    spend: Buckets | None = ctx.get("spend")
    if spend is not None:
        await spend.redis.aclose()
    notices: Notices | None = ctx.get("notices")
    if notices is not None:
        await notices.aclose()
    pool: asyncpg.Pool | None = ctx.get("pool")
    if pool is not None:
        with contextlib.suppress(OSError, asyncpg.PostgresError):
            await work_store.leave(pool, worker_id=ctx["worker_id"])
        await pool.close()


async def run_job(ctx: dict[str, Any], job_id: str) -> str:
    """A queued job's wake-up: take the fairest work that fits this worker's free devices (usually `job_id`)
    and run it to its end."""
    return await take_work(ctx)


async def run_tinker_model(ctx: dict[str, Any], model_id: str) -> str:
    """A Tinker model's wake-up (a request came for a model no worker holds): as `run_job`."""
    return await take_work(ctx)


async def take_work(ctx: dict[str, Any]) -> str:
    """Claim the fairest work of either kind (`work_store.fairest`: a queued job or a Tinker model waiting
    for a holder) that fits the free devices, take its devices and run it: a job to the end of its trainer
    run, a model until it is idle. Every job and every waiting model has a wake-up of its own, so the one
    this takes in another's place is taken by that other's wake-up."""
    pool: asyncpg.Pool = ctx["pool"]
    worker_id: str = ctx["worker_id"]
    settings: Settings = ctx["settings"]
    devices: DevicePool = ctx["devices"]
    while True:
        await devices.wait_for_free()
        async with devices.lock:  # one claim at a time: what is free cannot change under it
            free = len(devices.free)
            if not free:
                continue
            generation = generation_devices(settings, "reinforcement")
            work = await work_store.fairest(pool, free=free, generation=generation)
            if work is None:
                return "nothing to claim"
            claimed: JobRow | TrainingModelRow | None
            if work.kind == "tinker":
                claimed = await tinker_store.claim(pool, model_id=work.id, worker_id=worker_id)
                count = 1
            else:
                claimed = await running.claim(pool, job_id=work.id, worker_id=worker_id)
                if claimed is not None:
                    count = claimed.method.gpus + generation_devices(settings, claimed.method.type)
            if claimed is None:
                continue  # another worker took it between the choice and the claim
            taken = devices.take(count)
            break
    try:
        if isinstance(claimed, TrainingModelRow):
            return await Holder(claimed, ctx, taken[0]).run()
        context = JobContext(claimed, worker_id, pool, ctx["blobs"], settings)
        run = JobRun(context, queue=ctx["redis"], spend=ctx["spend"], devices=taken)
        return await run.train()
    finally:
        await devices.give_back(taken)


async def announce(ctx: dict[str, Any]) -> None:
    """Tell the gateways this worker is alive and how many devices it owns (a job larger than every live
    worker is refused at creation)."""
    await work_store.announce(
        ctx["pool"], worker_id=ctx["worker_id"], devices=ctx["devices"].size, kind=_kind(ctx)
    )


async def bill(ctx: dict[str, Any]) -> dict[str, int]:
    """Aggregate unbilled usage into the outbox and send pending meter events to Stripe."""
    return await run_billing(ctx["pool"], ctx["settings"])


def _billing_cron(settings: Settings) -> Any:
    every = max(1, settings.billing_interval_s)
    if every < 60:
        return cron(bill, second=set(range(0, 60, every)), unique=True, timeout=300)
    return cron(bill, minute=set(range(0, 60, max(1, every // 60))), second={0}, unique=True, timeout=300)


def _lease_crons(held: Lease, seconds: set[int]) -> list[Any]:
    """The two crons of one kind of work: wake-ups for its missed work, and its reaper."""

    async def requeue(ctx: dict[str, Any]) -> int:
        return await lease.requeue_missed(ctx, held)

    async def reap(ctx: dict[str, Any]) -> int:
        return await lease.reap_stale(ctx, held)

    return [
        cron(requeue, name=f"requeue_missed:{held.kind}", second=seconds, run_at_startup=True, timeout=60),
        cron(reap, name=f"reap_stale:{held.kind}", second=seconds, run_at_startup=True, timeout=60),
    ]


def build_worker(settings: Settings) -> Worker:
    """The arq worker for these settings."""
    assert settings.redis_url
    devices = DevicePool(parse_devices(settings.devices, cpu_slots=settings.training_slots))
    every = max(1, settings.requeue_interval_s)
    seconds = set(range(0, 60, every))
    return Worker(
        functions=[run_job, run_eval, run_tinker_model],
        cron_jobs=[
            *(task for held in LEASES for task in _lease_crons(held, seconds)),
            cron(announce, second=seconds, unique=False, timeout=60),
            cron(tinker_housekeeping, second={0}, run_at_startup=True, unique=True, timeout=120),
            _billing_cron(settings),
        ],
        redis_pool=make_queue(settings.redis_url),
        queue_name=settings.queue_name,
        on_startup=startup,
        on_shutdown=shutdown,
        ctx={"settings": settings, "devices": devices},
        max_jobs=devices.size + settings.eval_run_slots + 3,  # devices + room for the periodic tasks
        job_timeout=7 * 24 * 3600,
        keep_result=0,
        max_tries=1000,
        poll_delay=0.2,
        handle_signals=True,
    )


def run_worker(settings: Settings) -> None:
    """Run a worker in the foreground until SIGINT/SIGTERM."""
    worker = build_worker(settings)
    worker.run()


__all__ = ["RUN_JOB", "build_worker", "run_eval", "run_job", "run_worker"]

"""The worker (scheduler), in arq's idiom: `run_job` trains one job; cron tasks re-enqueue jobs that missed
the queue and take jobs back from workers that died. Eval runs are executed the same way (`run_eval` and its
crons, in `gateway.worker.evals`).

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
from gateway.ids import new_id
from gateway.jobs import store as jobs_store
from gateway.jobs.store import JobRow
from gateway.limits.buckets import Buckets, make_limits_redis
from gateway.notices import Notices
from gateway.queue import RUN_JOB, enqueue, make_queue
from gateway.settings import Settings
from gateway.tenancy import scoped
from gateway.tinker import store as tinker_store
from gateway.tinker.holder import Holder
from gateway.tinker.housekeeping import tinker_housekeeping
from gateway.tinker.rows import TrainingModelRow
from gateway.worker import presence, store
from gateway.worker.context import JobContext
from gateway.worker.devices import DevicePool, devices_of_job, generation_devices, parse_devices
from gateway.worker.evals import reap_stale_runs, requeue_missed_runs, run_eval
from gateway.worker.job.process import key_name
from gateway.worker.resilience import Worker
from gateway.worker.runner import JobRun

logger = logging.getLogger(__name__)


async def startup(ctx: dict[str, Any]) -> None:
    settings: Settings = ctx["settings"]
    assert settings.database_url
    await migrate(settings.database_url)
    ctx["pool"] = await create_pool(settings.database_url, min_size=1, max_size=4)
    ctx["blobs"] = BlobStore(settings.blob_dir)
    ctx["notices"] = Notices(settings.database_url, (tinker_store.REQUEST_CHANNEL,))
    await asyncio.to_thread(remove_stale_dirs)  # sandbox dirs a killed worker left behind
    ctx["worker_id"] = f"{socket.gethostname()}:{os.getpid()}:{new_id('', 6)}"
    await store.announce(
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
            await store.leave(pool, worker_id=ctx["worker_id"])
        await pool.close()


async def run_job(ctx: dict[str, Any], job_id: str) -> str:
    """A queued job's wake-up: take the fairest work that fits this worker's free devices (usually `job_id`)
    and run it to its end."""
    return await take_work(ctx)


async def run_tinker_model(ctx: dict[str, Any], model_id: str) -> str:
    """A Tinker model's wake-up (a request came for a model no worker holds): as `run_job`."""
    return await take_work(ctx)


async def take_work(ctx: dict[str, Any]) -> str:
    """Claim the fairest work of either kind (`store.fairest`: a queued job or a Tinker model waiting for a
    holder) that fits the free devices, take its devices and run it: a job to the end of its trainer run, a
    model until it is idle. Every job and every waiting model has a wake-up of its own, so the one this takes
    in another's place is taken by that other's wake-up."""
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
            work = await store.fairest(pool, free=free, generation=generation)
            if work is None:
                return "nothing to claim"
            claimed: JobRow | TrainingModelRow | None
            if work.kind == "tinker":
                claimed = await tinker_store.claim(pool, model_id=work.id, worker_id=worker_id)
                count = 1
            else:
                claimed = await store.claim(pool, job_id=work.id, worker_id=worker_id)
                if claimed is not None:
                    method = claimed.method
                    count = devices_of_job(method) + generation_devices(settings, method["type"])
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


async def requeue_missed(ctx: dict[str, Any]) -> int:
    """Enqueue queued jobs that have no message (Redis was down at create, or a wake-up was spent)."""
    sent = 0
    for row in await store.queued_unclaimed(ctx["pool"]):
        if await enqueue(ctx["redis"], ctx["settings"].queue_name, row.id, row.queue_generation):
            sent += 1
    return sent


async def reap_stale(ctx: dict[str, Any]) -> int:
    """Take jobs back from workers that stopped heartbeating: revoke the keys minted for their trainers (a
    trainer dies with its worker; the key would live on until it expires), then re-queue them, or fail them
    after N attempts. Revoked first, so that the key of the job's next attempt is never among them."""
    settings: Settings = ctx["settings"]
    pool: asyncpg.Pool = ctx["pool"]
    reaped = 0
    for row in await store.stale(pool, after_s=settings.stale_after_s):
        for key_id in await scoped.revoke_named(
            pool, org_id=row.organization_id, kind="job", name=key_name(row.id)
        ):
            logger.info("job %s: revoked key %s of its lost worker %s", row.id, key_id, row.worker_id)
        if row.attempts >= settings.max_attempts:
            message = f"The job's worker was lost {row.attempts} times; giving up."
            error = {"code": "max_attempts_exceeded", "param": None, "message": message}
            failed = await store.fail_stale(pool, job_id=row.id, worker_id=row.worker_id, error=error)
            if failed is not None:
                await jobs_store.add_event(
                    pool,
                    job_id=row.id,
                    org_id=row.organization_id,
                    level="error",
                    message=message,
                    dedup_key="failed",
                )
            reaped += 1
            continue
        requeued = await store.requeue_stale(pool, job_id=row.id, worker_id=row.worker_id)
        if requeued is None:
            continue
        reaped += 1
        if requeued.status == "queued":
            await jobs_store.add_event(
                pool,
                job_id=row.id,
                org_id=row.organization_id,
                level="warn",
                message="The job's worker stopped responding; the job was re-queued"
                + (" and will resume from its last checkpoint" if row.last_checkpoint else ""),
                dedup_key=f"requeued:{requeued.queue_generation}",
            )
            await enqueue(ctx["redis"], settings.queue_name, row.id, requeued.queue_generation)
    return reaped


async def announce(ctx: dict[str, Any]) -> None:
    """Tell the gateways this worker is alive and how many devices it owns (a job larger than every live
    worker is refused at creation)."""
    await store.announce(
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


def build_worker(settings: Settings) -> Worker:
    """The arq worker for these settings."""
    assert settings.redis_url
    devices = DevicePool(parse_devices(settings.devices, cpu_slots=settings.training_slots))
    every = max(1, settings.requeue_interval_s)
    seconds = set(range(0, 60, every))
    return Worker(
        functions=[run_job, run_eval, run_tinker_model],
        cron_jobs=[
            cron(requeue_missed, second=seconds, run_at_startup=True, unique=True, timeout=60),
            cron(reap_stale, second=seconds, run_at_startup=True, unique=True, timeout=60),
            cron(requeue_missed_runs, second=seconds, run_at_startup=True, unique=True, timeout=60),
            cron(reap_stale_runs, second=seconds, run_at_startup=True, unique=True, timeout=60),
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

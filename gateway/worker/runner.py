"""One claimed job's run: a state machine over the stages of `gateway.worker.job`.

```
claimed ─> spec written ─> trainer runs ──┬─ result ───────────────> succeeded (adapter published)
           (gateway.worker.job.spec)      ├─ error, not stopping ──> failed
           events ingested (each step:    ├─ anything else ────────> released: paused | cancelled
           max_cost and guards checked),  │                          | queued again
           and each heartbeat: key        │
           renewed, budget and hang       └─ worker shutdown ──────> handed back: queued again
           checked (may pause)
```

`JobRun.train` writes the spec, runs the trainer process (its events ingested, its attempt metered), then
leaves the job in exactly one of those states. Each end is one transaction guarded by this worker still
holding the job, which also writes the attempt's usage row; it is retried through a PostgreSQL restart and
shielded from the worker's own cancellation. A paused or handed-back job keeps its checkpoints: the next
attempt resumes from the last one.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import hashlib
import io
import logging
import shutil
from typing import Any

import asyncpg
from arq.connections import ArqRedis

from gateway.ids import new_id
from gateway.jobs import running
from gateway.jobs import store as jobs_store
from gateway.jobs.store import JobRow
from gateway.limits.buckets import Buckets
from gateway.models import store as models_store
from gateway.queue import enqueue
from gateway.serving.engines import AdapterLoader
from gateway.serving.versions import adapter_version
from gateway.work import lease
from gateway.work.devices import Device, cpu_devices, generation_devices, strategy
from gateway.work.resilience import until_database_answers
from gateway.worker.context import JobContext, OutsideWorkdir
from gateway.worker.job.generation import generation_server
from gateway.worker.job.guards import Guards
from gateway.worker.job.ingest import Ingest, Progress, ProgressEvent
from gateway.worker.job.metering import Meter
from gateway.worker.job.process import RunOutcome, TrainerProcess
from gateway.worker.job.spec import calls_models, fine_tuned_model_name, write_spec
from trainer.contract import ErrorEvent, MetricsEvent, ResultEvent

logger = logging.getLogger(__name__)


class JobRun:
    """Runs one claimed job from its start to the state the worker leaves it in."""

    def __init__(
        self,
        ctx: JobContext[JobRow],
        *,
        queue: ArqRedis | None,
        spend: Buckets | None = None,
        devices: list[Device] | None = None,
    ) -> None:
        self.ctx = ctx
        self.queue = queue
        self.workdir = ctx.workdir
        devices = devices or cpu_devices(1)
        extra = generation_devices(ctx.settings, ctx.row.method.type)
        self.devices = devices[: len(devices) - extra] if extra else devices
        """The trainer's devices (one process each)."""
        self.generation = devices[len(devices) - extra :] if extra else []
        """A reinforcement job's devices for its vLLM generation server (server mode)."""
        job = ctx.row
        self.progress = Progress(step=job.current_step, start_step=job.current_step or 0)
        self.meter = Meter(ctx, progress=self.progress, spend=spend)
        self.ingest = Ingest(ctx, progress=self.progress, cost=self.meter.event_cost)
        self.guards = Guards(ctx, progress=self.progress, pause=self.meter.pause)
        self.process = TrainerProcess(
            ctx,
            workdir=self.workdir,
            progress=self.progress,
            on_running=self._on_running,
            devices=self.devices,
        )

    async def train(self) -> str:
        """Run the job to its end; returns the state it was left in (`succeeded`, `failed`, `paused`...)."""
        job = self.ctx.row
        await jobs_store.add_event(
            self.ctx.pool,
            job_id=self.ctx.id,
            org_id=self.ctx.org_id,
            message=f"Fine-tuning job started (attempt {job.attempts})"
            + (f", resuming from step {job.current_step}" if job.last_checkpoint else ""),
            dedup_key=f"started:{job.attempts}",
        )
        await jobs_store.add_event(
            self.ctx.pool,
            job_id=self.ctx.id,
            org_id=self.ctx.org_id,
            message=self._placement(),
            dedup_key=f"devices:{job.attempts}",
            data={"worker": self.ctx.worker_id, "devices": [str(d) for d in self.devices + self.generation]},
        )
        try:
            outcome = await self._run_trainer()
        except asyncio.CancelledError:
            # The worker is shutting down: let the trainer checkpoint, then hand the job back to the queue.
            await asyncio.shield(self._hand_back())
            raise
        except Exception as exc:
            logger.exception("job %s: worker error", self.ctx.id)
            await self.fail("worker_error", f"{type(exc).__name__}: {exc}")
            return "failed"
        finishing = until_database_answers(
            lambda: self._finish(outcome),
            what=f"job {self.ctx.id}: finishing",
            within_s=self.ctx.settings.stale_after_s,
            on_retry=self.meter.forget_usage,  # the transaction that wrote the usage row was rolled back
        )
        return await asyncio.shield(finishing)

    async def _run_trainer(self) -> RunOutcome:
        """Run the attempt's trainer to its end; none when the key that created the job is over its spend
        limit (the job is paused then, and the attempt trains nothing)."""
        job = self.ctx.row
        try:
            if await self.meter.check_key_limit():
                return RunOutcome(None)
        except (OSError, asyncpg.PostgresError) as exc:  # checked again at the first beat and every step
            logger.warning("job %s: spend-limit check failed: %s", self.ctx.id, exc)
        async with contextlib.AsyncExitStack() as stack:
            server = None
            if self.generation and self.devices[0].kind == "cuda":
                base = str(self.ctx.settings.base_model_path(job.model))
                serving = generation_server(self.generation, base, self.workdir)
                server = await stack.enter_async_context(serving)
            spec = await write_spec(self.ctx, workdir=self.workdir, vllm_server=server)
            return await self.process.run(spec, with_key=calls_models(job), record=self._record)

    def _placement(self) -> str:
        """The job's devices, in words (an event of each attempt)."""
        how = {"single": "", "ddp": ", data-parallel (DDP)", "fsdp": ", sharded (FSDP)"}[
            strategy(len(self.devices), self.process.parameters)
        ]
        text = f"Training on {len(self.devices)} device(s) ({', '.join(map(str, self.devices))}){how}"
        if self.generation:
            text += f"; generating with vLLM on {', '.join(map(str, self.generation))}"
        return text

    async def _record(self, event: ProgressEvent) -> None:
        """Record one of the trainer's events; a step's metrics also check the job's `max_cost`, its key's
        spend limit and its guards, and stop the trainer (it checkpoints) at the step that reaches a limit or
        trips a guard."""
        await self.ingest.record(event)
        if isinstance(event, MetricsEvent) and self.process.stop_reason is None:
            data = {**event.data, "step": event.step}
            meter = self.meter
            if (
                await meter.check_max_cost()
                or await meter.check_key_limit()
                or await self.guards.on_metrics(data)
            ):
                await self.process.stop("paused")

    async def _on_running(self) -> None:
        """Each heartbeat of a running job: pause it, and stop its trainer, when it reached the budget or its
        trainer hangs."""
        if await self.meter.check_budget_when_due() or await self.guards.on_beat():
            await self.process.stop("paused")

    async def _finish(self, outcome: RunOutcome) -> str:
        if isinstance(outcome.event, ResultEvent):
            try:
                self.ctx.trainer_path(outcome.event.adapter_path)
            except OutsideWorkdir as exc:
                await self.fail("worker_error", f"The adapter was not stored: {exc}.")
                return "failed"
            row = await self.succeed(outcome.event)
            if row is not None:
                self.cleanup()
                return "succeeded"
        elif isinstance(outcome.event, ErrorEvent) and self.process.stop_reason is None:
            await self.fail(outcome.event.code, outcome.event.message)
            return "failed"
        # Stopped (pause, cancel) or overtaken: give the job up; a paused job keeps its checkpoints to resume.
        # The attempt's training usage is written in the same transaction that lets the job go.
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            released = await running.release(conn, job_id=self.ctx.id, worker_id=self.ctx.worker_id)
            if released is not None:
                await self.meter.record_usage(conn, released.status)
        if released is None:
            return "lost"
        if released.status == "running":
            await running.requeue_own(self.ctx.pool, job_id=self.ctx.id, worker_id=self.ctx.worker_id)
        if released.status == "queued":
            await enqueue(self.queue, self.ctx.settings.queue_name, self.ctx.id, released.queue_generation)
        if released.status == "cancelled":
            self.cleanup()
        if released.status == "paused":
            await self.guards.roll_back()
        return released.status

    async def _hand_back(self) -> None:
        """The worker is shutting down: stop the trainer (it checkpoints) and queue the job again."""
        await self.process.stop("worker shutdown")
        await self.process.exited()
        host = {
            "pool": self.ctx.pool,
            "redis": self.queue,
            "settings": self.ctx.settings,
            "worker_id": self.ctx.worker_id,
        }
        await lease.hand_back(
            host,
            running.JOB_LEASE,
            self.ctx.id,
            within=lambda conn: self.meter.record_usage(conn, "handed_back"),
        )

    async def succeed(self, event: ResultEvent) -> JobRow | None:
        """Store the adapter, register the model and the result file, and mark the job succeeded — one
        transaction, guarded by this worker still holding a running job."""
        model = fine_tuned_model_name(self.ctx.row)
        adapter = await asyncio.to_thread(
            self.ctx.blobs.put_tree,
            self.ctx.trainer_path(event.adapter_path),
            f"adapters/{self.ctx.org_id}/{self.ctx.id}",
        )
        version = await asyncio.to_thread(adapter_version, adapter)
        # Serve the new model before the job reports success: every engine of the base model loads it now.
        async with AdapterLoader(self.ctx.settings) as loader:
            loaded = await loader.load_everywhere(model, self.ctx.row.model, str(adapter), version)
        for upstream, problem in loaded.items():
            if problem:
                logger.warning(
                    "job %s: %s could not load the adapter yet: %s", self.ctx.id, upstream, problem
                )
        csv_bytes = _metrics_csv(await running.job_metrics(self.ctx.pool, job_id=self.ctx.id))
        file_id = new_id("file-")
        file_key = f"files/{self.ctx.org_id}/{file_id}"
        temp = self.ctx.blobs.new_temp()
        temp.write_bytes(csv_bytes)
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            row = await running.succeed_own(
                conn,
                job_id=self.ctx.id,
                worker_id=self.ctx.worker_id,
                model=model,
                trained_tokens=event.trained_tokens,
                result_files=[file_id],
                step=event.steps or self.progress.step or 0,
            )
            if row is None:
                temp.unlink(missing_ok=True)
                return None
            await self.meter.record_usage(conn, "succeeded", total_tokens=event.trained_tokens)
            await running.add_result_file(
                conn,
                file_id=file_id,
                org_id=self.ctx.org_id,
                filename="step_metrics.csv",
                size=len(csv_bytes),
                sha256=hashlib.sha256(csv_bytes).hexdigest(),
                blob_key=file_key,
            )
            await models_store.insert(
                conn,
                model_id=model,
                org_id=self.ctx.org_id,
                base_model=self.ctx.row.model,
                job_id=self.ctx.id,
                adapter_path=str(adapter),
                version=version,
            )
            for message, key in (
                (f"New fine-tuned model created: {model}", "model_created"),
                ("The job has successfully completed", "succeeded"),
            ):
                await jobs_store.add_event(
                    conn, job_id=self.ctx.id, org_id=self.ctx.org_id, message=message, dedup_key=key
                )
            self.ctx.blobs.commit(temp, file_key)
        return row

    async def fail(self, code: str, message: str) -> JobRow | None:
        """Mark the job failed with `code` (guarded by this worker holding a running job), usage included."""
        error = {"code": code, "message": message, "param": None}
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            row = await running.fail_own(conn, job_id=self.ctx.id, worker_id=self.ctx.worker_id, error=error)
            if row is not None:
                await self.meter.record_usage(conn, "failed")
        if row is not None:
            await jobs_store.add_event(
                self.ctx.pool,
                job_id=self.ctx.id,
                org_id=self.ctx.org_id,
                level="error",
                message=f"Job failed: {message}",
                dedup_key="failed",
            )
        return row

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def _metrics_csv(rows: list[dict[str, Any]]) -> bytes:
    """OpenAI's result file: one row per step."""
    columns = ["step"] + sorted(
        {k for r in rows for k in r if k != "step" and not isinstance(r[k], dict | list)}
    )
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=columns, extrasaction="ignore")
    writer.writeheader()
    for r in rows:
        writer.writerow(r)
    return out.getvalue().encode()

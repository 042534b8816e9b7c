"""Ingesting events: the trainer's typed progress events (`trainer.contract`, parsed by the process stage) to
rows, and the attempt's progress as the trainer reported it.

Every event is written so that a replay (a job resumed after a lost worker) records it once: metrics by
step (each with the job's cost so far), checkpoints by step, milestones by name. A checkpoint is copied into
the blob store and registered as a servable model, `<fine-tuned model>:ckpt-step-N`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import Counter, Histogram

from gateway.jobs import running
from gateway.jobs import store as jobs_store
from gateway.jobs.store import JobRow
from gateway.serving.versions import adapter_version
from gateway.worker.context import JobContext
from gateway.worker.job.spec import fine_tuned_model_name
from trainer.contract import CheckpointEvent, MessageEvent, MetricsEvent

ProgressEvent = MetricsEvent | CheckpointEvent | MessageEvent
"""The events a run records as it goes; `result`, `error` and `stopped` end it instead."""
ENV_WAIT = Histogram(
    "tunegate_trainer_env_wait_seconds",
    "Time a training step waited on its environment (its own sandbox or the env servers)",
    buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
)
ENV_RETRIES = Counter(
    "tunegate_trainer_env_retries_total", "Environment requests a trainer sent again to another env server"
)


@dataclass
class Progress:
    """What the trainer of this attempt reported: its steps and cumulative tokens, and the time from the
    trainer's start to its last reported step (what the attempt is metered by)."""

    step: int | None
    """The last step reported (the job's current step before the first report)."""
    start_step: int
    """The step the attempt started from."""
    tokens_seen: int | None = None
    """The trainer's cumulative count of trained tokens, from its last metrics event."""
    started_mono: float | None = None
    """Monotonic time the trainer started."""
    progress_mono: float | None = None
    """Monotonic time of its last metrics event."""
    event_mono: float | None = None
    """Monotonic time of its last event of any kind (the hang guard's clock)."""

    @property
    def seconds(self) -> float:
        """Training time so far: the trainer's start to its last reported step."""
        if self.started_mono is None or self.progress_mono is None:
            return 0.0
        return max(0.0, self.progress_mono - self.started_mono)


class Ingest:
    """Records one job's progress events."""

    def __init__(
        self,
        ctx: JobContext[JobRow],
        *,
        progress: Progress,
        cost: Callable[[], Awaitable[dict[str, float] | None]] | None = None,
    ) -> None:
        self.ctx = ctx
        self.progress = progress
        self.cost = cost
        """The job's cost so far, put on each step's metrics event as `cost`."""
        self.env_retries = 0.0

    async def record(self, event: ProgressEvent) -> None:
        """Record one event (once, also when a resumed run replays it)."""
        self.progress.event_mono = time.monotonic()
        if isinstance(event, MetricsEvent):
            await self._metrics(event)
        elif isinstance(event, CheckpointEvent):
            await self._checkpoint(event.step, self.ctx.trainer_path(event.path), event.metrics)
        else:
            await jobs_store.add_event(
                self.ctx.pool,
                job_id=self.ctx.id,
                org_id=self.ctx.org_id,
                level=event.level,
                message=event.message[:4000],
                data=event.data,
            )

    async def _metrics(self, event: MetricsEvent) -> None:
        self.progress.step = event.step
        self.progress.progress_mono = time.monotonic()
        data = dict(event.data)
        if isinstance(data.get("tokens"), int):
            self.progress.tokens_seen = data["tokens"]
        data.setdefault("step", event.step)
        data["total_steps"] = event.total_steps
        self._env_metrics(data)
        cost = await self.cost() if self.cost is not None else None
        if cost is not None:
            data["cost"] = cost
        await jobs_store.add_event(
            self.ctx.pool,
            job_id=self.ctx.id,
            org_id=self.ctx.org_id,
            type="metrics",
            data=data,
            message=_metrics_message(event.step, event.total_steps, data),
            dedup_key=f"metrics:{event.step}",
        )

    def _env_metrics(self, data: dict[str, Any]) -> None:
        """The step's environment wait and the trainer's retries, on the worker's Prometheus metrics."""
        wait, retries = data.get("env_wait_s"), data.get("env_retries")
        if isinstance(wait, int | float):
            ENV_WAIT.observe(wait)
        if isinstance(retries, int | float) and retries > self.env_retries:
            ENV_RETRIES.inc(retries - self.env_retries)
            self.env_retries = float(retries)

    async def _checkpoint(self, step: int, path: Path, metrics: dict[str, Any]) -> None:
        key = f"checkpoints/{self.ctx.org_id}/{self.ctx.id}/step-{step}"
        stored = await asyncio.to_thread(self.ctx.blobs.put_tree, path, key)
        version = await asyncio.to_thread(adapter_version, stored)
        name = f"{fine_tuned_model_name(self.ctx.row)}:ckpt-step-{step}"
        await running.add_checkpoint(
            self.ctx.pool,
            job_id=self.ctx.id,
            org_id=self.ctx.org_id,
            step=step,
            metrics={"step": step, **metrics},
            model_name=name,
            path=str(stored),
            version=version,
        )
        await jobs_store.add_event(
            self.ctx.pool,
            job_id=self.ctx.id,
            org_id=self.ctx.org_id,
            message=f"Checkpoint saved at step {step}",
            dedup_key=f"checkpoint:{step}",
        )


def _metrics_message(step: int, total: Any, data: dict[str, Any]) -> str:
    parts = [f"Step {step}/{total}" if total else f"Step {step}"]
    for key in ("train_loss", "reward_mean", "kl"):
        if isinstance(data.get(key), int | float):
            parts.append(f"{key}={data[key]:.4f}")
    return ": ".join([parts[0], ", ".join(parts[1:])]) if len(parts) > 1 else parts[0]

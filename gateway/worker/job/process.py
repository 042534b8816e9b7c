"""The trainer process of one attempt: spawn `python -m trainer run SPEC.json`, read its events, heartbeat
the job, and stop the trainer when the job is cancelled or paused.

The trainer dies with the worker (`PR_SET_PDEATHSIG`) and gets an environment of its own
(:func:`trainer_env`). Each stdout line is one `TrainerEvent`, parsed by `trainer.contract.EVENT`: progress
events go to the caller's `record` (retried while PostgreSQL is away), and the last `result`, `error` or
`stopped` ends the run; a trainer that exits without one has crashed, and its stderr's tail says why.

The heartbeat, every `heartbeat_interval_s`, proves this worker still holds the job and reads its status:
anything but `running` stops the trainer (SIGTERM: it checkpoints and exits; SIGKILL after `stop_grace_s`).
While the job runs, each beat also calls the caller's `on_running` (the budget check).

A job whose grader calls a model (`score_model`, `label_model`) gets a key minted for its organisation
(`gateway.tenancy.scoped`, kind `job`) for the life of its trainer: the trainer's model graders call the
gateway's own `/v1/chat/completions` with it (`inference_base_url` in the spec, the key in the trainer's
environment, `trainer.contract.INFERENCE_KEY_ENV`), never an engine, so the grader's model must be the
organisation's, and its calls are rate-limited, held to the budget and metered under the key's id. The
heartbeat renews the key; it is revoked when the trainer ends (however it ends), and by the reaper that takes
the job back from a worker that died first (`gateway.work.lease.reap_stale`, which finds it by its name,
`key_name`); a key nobody revoked expires within `KEY_TTL_S`.

An environment job's trainer on a deployment with Redis reaches the env servers' pool with a Redis user of
its own (`gateway.worker.redis_acl`): its organisation's namespace of the pool and nothing else, made before
the trainer starts, renewed by the heartbeat and deleted when the trainer ends.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from pydantic import ValidationError
from redis.asyncio import Redis
from redis.exceptions import RedisError

from envsdk.venvs import builder_env
from gateway.jobs import running
from gateway.jobs.method import JobMethod, as_method
from gateway.jobs.running import key_name
from gateway.jobs.store import JobRow
from gateway.settings import Settings
from gateway.tenancy import scoped
from gateway.work.devices import Device, cpu_devices, free_port, launch
from gateway.work.process import die_with_parent, trainer_env
from gateway.work.resilience import until_database_answers
from gateway.worker import redis_acl
from gateway.worker.context import JobContext
from gateway.worker.job.ingest import Progress, ProgressEvent
from trainer.contract import (
    EVENT,
    ErrorEvent,
    ResultEvent,
    StoppedEvent,
    model_defaults,
)

logger = logging.getLogger(__name__)

KEY_TTL_S = 300.0
"""Life of a job's key between renewals (the heartbeat renews it every third of that)."""


def is_environment_job(method: JobMethod | Mapping[str, Any]) -> bool:
    """Whether the job's reward is an uploaded environment (its method, or the method's stored shape)."""
    return as_method(method).environment is not None


def environment_env(settings: Settings, method: JobMethod | Mapping[str, Any]) -> dict[str, str]:
    """An environment job's `method`: where its trainer finds, or builds, its package's venv
    (`envsdk.venvs`, the same cache as the uploads')."""
    return builder_env(settings.venv_builder()) if is_environment_job(method) else {}


def uses_env_pool(settings: Settings, method: JobMethod | Mapping[str, Any]) -> bool:
    """Whether the job's trainer gets a Redis user for the env servers' pool (`trainer.envpool` runs the
    environment there when a server of the pool is registered)."""
    return bool(settings.redis_url) and is_environment_job(method)


@dataclass
class RunOutcome:
    """How a trainer run ended: its last event, or ``None`` when the trainer died without one."""

    event: ResultEvent | ErrorEvent | StoppedEvent | None
    stderr_tail: str = ""

    @property
    def kind(self) -> str:
        """``result``, ``error``, ``stopped`` or ``crashed``."""
        return self.event.type if self.event is not None else "crashed"


class TrainerProcess:
    """The trainer child of one attempt of one job, held by the context's worker."""

    def __init__(
        self,
        ctx: JobContext[JobRow],
        *,
        workdir: Path,
        progress: Progress,
        on_running: Callable[[], Awaitable[None]],
        devices: list[Device] | None = None,
    ) -> None:
        self.ctx = ctx
        self.workdir = workdir
        self.progress = progress
        """Its step goes with each heartbeat; its start time is set here."""
        self.on_running = on_running
        self.devices = devices or cpu_devices(1)
        """The devices the trainer runs on (one process each)."""
        self.parameters = model_defaults(ctx.settings.base_model_path(ctx.row.model)).parameters
        self.proc: asyncio.subprocess.Process | None = None
        self.stop_reason: str | None = None
        """Why the trainer was asked to stop (a job status, or `worker shutdown`); None while it may run."""
        self.key_id: str | None = None
        """The key minted for this run's model graders, while the trainer runs."""
        self.key_renewed = 0.0
        self.environment = environment_env(ctx.settings, ctx.row.method)
        """Where an environment job's trainer finds its package's venv."""
        self.pool_grant: redis_acl.PoolGrant | None = None
        """The trainer's Redis user for the env servers' pool, while it runs."""
        self._pool_redis: Redis | None = None

    async def run(
        self, spec: Path, *, with_key: bool, record: Callable[[ProgressEvent], Awaitable[None]]
    ) -> RunOutcome:
        """Run the trainer on `spec` to its end, `record`ing its progress events; `with_key`: mint the job's
        key for the trainer's life."""
        if not with_key:
            return await self._run(spec, trainer_env(self.workdir), record)
        key = await scoped.mint(
            self.ctx.pool, org_id=self.ctx.org_id, kind="job", name=key_name(self.ctx.id), ttl_s=KEY_TTL_S
        )
        self.key_id, self.key_renewed = key.id, time.monotonic()
        try:
            return await self._run(spec, trainer_env(self.workdir, key.secret), record)
        finally:
            self.key_id = None
            revoking = until_database_answers(
                functools.partial(scoped.revoke, self.ctx.pool, key.id),
                what=f"job {self.ctx.id}: revoking its key",
                within_s=self.ctx.settings.stale_after_s,
            )
            try:
                await asyncio.shield(revoking)
            except (OSError, asyncpg.PostgresError) as exc:  # the reaper or KEY_TTL_S ends it then
                logger.warning("job %s: could not revoke its key %s: %s", self.ctx.id, key.id, exc)

    async def _run(
        self, spec: Path, env: dict[str, str], record: Callable[[ProgressEvent], Awaitable[None]]
    ) -> RunOutcome:
        pool_env = await self._grant_pool()
        try:
            return await self._run_trainer(spec, {**env, **self.environment, **pool_env}, record)
        finally:
            await asyncio.shield(self._revoke_pool())

    async def _grant_pool(self) -> dict[str, str]:
        """The trainer's variables for the env servers' pool, with a Redis user made for this run; none when
        the job uses no pool, or Redis does not answer (the trainer then runs its environment itself)."""
        settings = self.ctx.settings
        if not settings.redis_url or not uses_env_pool(settings, self.ctx.row.method):
            return {}
        self._pool_redis = Redis.from_url(settings.redis_url, socket_timeout=10, socket_connect_timeout=10)
        try:
            self.pool_grant = await redis_acl.grant(
                self._pool_redis,
                redis_url=settings.redis_url,
                pool=settings.env_pool,
                org_id=self.ctx.org_id,
                job_id=self.ctx.id,
            )
        except (RedisError, OSError) as exc:
            logger.warning("job %s: no access to the env servers' pool (%s)", self.ctx.id, exc)
            return {}
        return self.pool_grant.env

    async def _revoke_pool(self) -> None:
        client, granted = self._pool_redis, self.pool_grant
        self._pool_redis = self.pool_grant = None
        if client is None:
            return
        try:
            if granted is not None:
                await redis_acl.revoke(client, granted)
        except (RedisError, OSError) as exc:  # its lease runs out and a later grant or revoke sweeps it
            logger.warning("job %s: could not revoke its env pool user: %s", self.ctx.id, exc)
        finally:
            await client.aclose()

    async def _run_trainer(
        self, spec: Path, env: dict[str, str], record: Callable[[ProgressEvent], Awaitable[None]]
    ) -> RunOutcome:
        stderr_path = self.workdir / "trainer.log"
        plan = launch(self.devices, str(spec), parameters=self.parameters, port=free_port())
        with open(stderr_path, "ab") as stderr:  # noqa: ASYNC230 - opening a log file is instant
            self.proc = await asyncio.create_subprocess_exec(
                *plan.argv,
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env={**env, **plan.env},
                cwd=str(self.workdir),
                preexec_fn=functools.partial(die_with_parent, plan.cpus),
                limit=16 * 1024 * 1024,
            )
            self.progress.started_mono = time.monotonic()
            beat = asyncio.create_task(self._heartbeat())
            outcome: RunOutcome | None = None
            try:
                assert self.proc.stdout is not None
                async for raw in self.proc.stdout:
                    line = raw.decode("utf-8", "replace").strip()
                    if not line:
                        continue
                    try:
                        event = EVENT.validate_json(line)
                    except ValidationError:
                        logger.warning("job %s: trainer wrote a non-event line: %.200s", self.ctx.id, line)
                        continue
                    if isinstance(event, ResultEvent | ErrorEvent | StoppedEvent):
                        outcome = RunOutcome(event)
                        continue
                    await until_database_answers(
                        functools.partial(record, event),
                        what=f"job {self.ctx.id}",
                        within_s=self.ctx.settings.stale_after_s,
                    )
                await self.proc.wait()
            finally:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
        if outcome is None:
            tail = log_tail(stderr_path)
            message = tail or f"trainer exited with code {self.proc.returncode}"
            outcome = RunOutcome(ErrorEvent(code="trainer_crashed", message=message), tail)
        return outcome

    async def stop(self, reason: str) -> None:
        """Ask the trainer to checkpoint and exit (SIGTERM); kill it if it does not within the grace time."""
        self.stop_reason = reason
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(signal.SIGTERM)

        async def _kill_later() -> None:
            await asyncio.sleep(self.ctx.settings.stop_grace_s)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

        asyncio.get_running_loop().create_task(_kill_later())

    async def exited(self) -> None:
        """Wait up to `stop_grace_s` for a stopped trainer to exit."""
        if self.proc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self.proc.wait(), self.ctx.settings.stop_grace_s)

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.ctx.settings.heartbeat_interval_s)
            try:
                status = await running.heartbeat(
                    self.ctx.pool, job_id=self.ctx.id, worker_id=self.ctx.worker_id, step=self.progress.step
                )
                if self.key_id is not None and time.monotonic() - self.key_renewed > KEY_TTL_S / 3:
                    await scoped.renew(self.ctx.pool, self.key_id, ttl_s=KEY_TTL_S)
                    self.key_renewed = time.monotonic()
            except (OSError, asyncpg.PostgresError) as exc:
                logger.warning("job %s: heartbeat failed: %s", self.ctx.id, exc)
                continue
            if self.pool_grant is not None and self._pool_redis is not None:
                try:
                    await redis_acl.renew(self._pool_redis, self.pool_grant)
                except (RedisError, OSError) as exc:
                    logger.warning("job %s: could not renew its env pool user: %s", self.ctx.id, exc)
            if status != "running" and self.stop_reason is None:
                logger.info("job %s is %s: stopping its trainer", self.ctx.id, status)
                await self.stop(status or "lost")
            elif status == "running" and self.stop_reason is None:
                await self.on_running()


def log_tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    meaningful = [t for t in text if t.strip()]
    return " ".join(meaningful[-lines:])[-500:]

"""One training run: prepare the work dir, spawn `python -m trainer run SPEC.json`, turn its events into
rows, heartbeat, and stop the trainer when the job is cancelled or paused.

Every `budget_check_interval_s` the heartbeat also prices the organisation's month-to-date spend plus this
attempt's progress (not yet recorded as usage) against its monthly budget; a job that reaches it is paused,
so its trainer checkpoints and the job resumes from there once the budget is raised.

Every event is written so that a replay (a job resumed after a lost worker) records it once: metrics by
step, checkpoints by step, milestones by name.

A job whose grader calls a model (`score_model`, `label_model`) gets a key minted for its organisation
(`gateway.tenancy.scoped`, kind `job`) for the life of its trainer: the trainer's model graders call the
gateway's own `/v1/chat/completions` with it (`inference_base_url` in the spec, the key in the trainer's
environment, `trainer.spec.INFERENCE_KEY_ENV`), never an engine, so the grader's model must be the
organisation's, and its calls are rate-limited, held to the budget and metered under the key's id. The
heartbeat renews the key; it is revoked when the trainer ends, and expires within `KEY_TTL_S` when the worker
dies first.
"""

from __future__ import annotations

import asyncio
import contextlib
import csv
import ctypes
import functools
import hashlib
import io
import logging
import os
import shutil
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
from pydantic import ValidationError

from envsdk.graders import model_fields
from gateway.blobstore import BlobStore
from gateway.ids import new_id
from gateway.jobs import store as jobs_store
from gateway.limits.buckets import Buckets, month_key, to_micro
from gateway.limits.budget import month_spend_usd, monthly_budget_usd
from gateway.models import store as models_store
from gateway.serving.service import load_adapter_everywhere
from gateway.settings import Settings
from gateway.tenancy import scoped
from gateway.usage.pricing import training_cost
from gateway.worker import store
from gateway.worker.resilience import until_database_answers
from trainer.spec import (
    EVENT,
    INFERENCE_KEY_ENV,
    CheckpointEvent,
    ErrorEvent,
    MessageEvent,
    MetricsEvent,
    ResultEvent,
    StoppedEvent,
    TrainerEvent,
    TrainerSpec,
)

logger = logging.getLogger(__name__)

KEY_TTL_S = 300.0
"""Life of a job's key between renewals (the heartbeat renews it every third of that)."""
_PR_SET_PDEATHSIG = 1
BUDGET_PAUSED = "Paused: the organisation's monthly budget is reached"


def _die_with_parent() -> None:
    """In the trainer child: get SIGKILL when the worker dies, so no orphan trains on."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()


TRAINER_ENV_PASSED = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "LD_LIBRARY_PATH")
"""Host variables the trainer gets as they are (with those of `TRAINER_ENV_PREFIXES`)."""
TRAINER_ENV_PREFIXES = (
    "CUDA_",
    "NVIDIA_",
    "HF_",
    "TRANSFORMERS_",
    "TORCH",
    "PYTORCH_",
    "VLLM_",
    "NCCL_",
    "OMP_",
    "MKL_",
)


def trainer_env(workdir: Path, inference_key: str | None = None) -> dict[str, str]:
    """The trainer's whole environment: what Python, PyTorch, CUDA and Hugging Face read, and nothing of the
    worker's settings. The trainer reads its spec; the database and Redis URLs, the admin key and the Stripe
    key stay in the worker. `inference_key`, the job's own key for its model graders, is the one secret it
    gets."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name in TRAINER_ENV_PASSED or name.startswith(TRAINER_ENV_PREFIXES)
    }
    env.setdefault("PATH", "/usr/bin:/bin")
    env.update(PYTHONUNBUFFERED="1", HOME=str(workdir))
    if inference_key is not None:
        env[INFERENCE_KEY_ENV] = inference_key
    return env


def calls_models(job: asyncpg.Record) -> bool:
    """Whether the job's grader calls a model (and so its trainer needs the gateway and a key)."""
    method = job["method"]
    grader = (method.get(method["type"]) or {}).get("grader")
    return isinstance(grader, dict) and bool(model_fields(grader))


def fine_tuned_model_name(job: asyncpg.Record) -> str:
    """`ft:<base>:<org>:<suffix>:<job>` (an empty suffix leaves an empty field, as OpenAI does)."""
    return f"ft:{job['model']}:{job['organization_id']}:{job['suffix'] or ''}:{job['id']}"


@dataclass
class RunOutcome:
    """How a trainer run ended: its last event, or ``None`` when the trainer died without one."""

    event: ResultEvent | ErrorEvent | StoppedEvent | None
    stderr_tail: str = ""

    @property
    def kind(self) -> str:
        """``result``, ``error``, ``stopped`` or ``crashed``."""
        return self.event.type if self.event is not None else "crashed"


class JobRun:
    """Runs one claimed job to the end of its trainer process."""

    def __init__(
        self,
        job: asyncpg.Record,
        *,
        pool: asyncpg.Pool,
        blobs: BlobStore,
        settings: Settings,
        worker_id: str,
        spend: Buckets | None = None,
    ) -> None:
        self.job = job
        self.spend = spend
        """The serving guard's month counters: training spend is added there as it is recorded."""
        self.job_id: str = job["id"]
        self.org_id: str = job["organization_id"]
        self.pool = pool
        self.blobs = blobs
        self.settings = settings
        self.worker_id = worker_id
        self.workdir = settings.data_dir / "work" / self.job_id
        self.metrics_rows: list[dict[str, Any]] = []
        self.step: int | None = job["current_step"]
        self.proc: asyncio.subprocess.Process | None = None
        self.stop_reason: str | None = None
        # Metering of this attempt: progress is what the trainer reported (steps, cumulative tokens), and
        # time runs from the trainer's start to its last reported step.
        self.started_mono: float | None = None
        self.progress_mono: float | None = None
        self.start_step: int = job["current_step"] or 0
        self.tokens_seen: int | None = None
        self.usage_recorded = False
        self.budget_due = 0.0
        """Monotonic time of the next budget check."""
        self.key_id: str | None = None
        """The key minted for this run's model graders, while the trainer runs."""
        self.key_renewed = 0.0

    # ---- preparation -------------------------------------------------------------------------
    async def _file_path(self, file_id: str) -> Path:
        row = await self.pool.fetchrow(
            "SELECT blob_key FROM files WHERE id = $1 AND organization_id = $2", file_id, self.org_id
        )
        if row is None:
            raise FileNotFoundError(f"file {file_id} was deleted before training started")
        return self.blobs.path(row["blob_key"])

    async def write_spec(self) -> Path:
        job = self.job
        self.workdir.mkdir(parents=True, exist_ok=True)
        method = job["method"]
        kind = method["type"]
        body = method.get(kind, {})
        environment = None
        if body.get("environment"):
            # The uploaded package, unpacked again under the same caps as its upload check.
            package_dir = self.workdir / "environment"
            archive = await self._file_path(body["environment"]["file_id"])
            await asyncio.to_thread(self._extract_environment, archive, package_dir)
            environment = {"package_dir": str(package_dir), "config": body["environment"].get("config", {})}
        gateway = f"{self.settings.internal_gateway_url()}/v1" if calls_models(job) else None
        spec = TrainerSpec.model_validate(
            {
                "job_id": self.job_id,
                "method": kind,
                "base_model": str(self.settings.base_model_path(job["model"])),
                "training_file": str(await self._file_path(job["training_file"])),
                "validation_file": str(await self._file_path(job["validation_file"]))
                if job["validation_file"]
                else None,
                "output_dir": str(self.workdir / "out"),
                "resume_from_checkpoint": job["last_checkpoint"],
                "seed": job["seed"],
                "hyperparameters": body["hyperparameters"],
                "grader": body.get("grader"),
                "environment": environment,
                "inference_base_url": gateway,
                "inference_api_key": None,  # in the trainer's environment, not in this file
                "allow_unsandboxed": self.settings.allow_unsandboxed_environments,
                "sandbox_maxima": self.settings.sandbox_maxima().as_dict(),
            }
        )
        path = self.workdir / "spec.json"
        path.write_text(spec.model_dump_json(indent=2))
        return path

    def _extract_environment(self, archive: Path, package_dir: Path) -> None:
        """Unpack an environment package for the trainer (blocking; run in a thread)."""
        from envsdk.archive import safe_extract

        shutil.rmtree(package_dir, ignore_errors=True)
        self.workdir.chmod(0o755)  # the sandbox's own uid reads the package
        safe_extract(
            archive,
            package_dir,
            max_entries=self.settings.environment_max_entries,
            max_total_bytes=self.settings.environment_max_unpacked_bytes,
            max_ratio=self.settings.environment_max_ratio,
        )

    # ---- the run -------------------------------------------------------------------------------
    async def run(self) -> RunOutcome:
        spec = await self.write_spec()
        if not calls_models(self.job):
            return await self._run_trainer(spec, trainer_env(self.workdir))
        key = await scoped.mint(
            self.pool, org_id=self.org_id, kind="job", name=f"job {self.job_id}", ttl_s=KEY_TTL_S
        )
        self.key_id, self.key_renewed = key.id, time.monotonic()
        try:
            return await self._run_trainer(spec, trainer_env(self.workdir, key.secret))
        finally:
            self.key_id = None
            try:
                await asyncio.shield(scoped.revoke(self.pool, key.id))
            except (OSError, asyncpg.PostgresError) as exc:  # it expires within KEY_TTL_S anyway
                logger.warning("job %s: could not revoke its key %s: %s", self.job_id, key.id, exc)

    async def _run_trainer(self, spec: Path, env: dict[str, str]) -> RunOutcome:
        stderr_path = self.workdir / "trainer.log"
        with open(stderr_path, "ab") as stderr:  # noqa: ASYNC230 - opening a log file is instant
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "trainer",
                "run",
                str(spec),
                stdout=asyncio.subprocess.PIPE,
                stderr=stderr,
                env=env,
                cwd=str(self.workdir),
                preexec_fn=_die_with_parent,
                limit=16 * 1024 * 1024,
            )
            self.started_mono = time.monotonic()
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
                        logger.warning("job %s: trainer wrote a non-event line: %.200s", self.job_id, line)
                        continue
                    final = await until_database_answers(
                        functools.partial(self.handle, event),
                        what=f"job {self.job_id}",
                        within_s=self.settings.stale_after_s,
                    )
                    if final is not None:
                        outcome = final
                await self.proc.wait()
            finally:
                beat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await beat
        if outcome is None:
            tail = _tail(stderr_path)
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
            await asyncio.sleep(self.settings.stop_grace_s)
            if proc.returncode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)

        asyncio.get_running_loop().create_task(_kill_later())

    async def _heartbeat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                status = await store.heartbeat(
                    self.pool, job_id=self.job_id, worker_id=self.worker_id, step=self.step
                )
                if self.key_id is not None and time.monotonic() - self.key_renewed > KEY_TTL_S / 3:
                    await scoped.renew(self.pool, self.key_id, ttl_s=KEY_TTL_S)
                    self.key_renewed = time.monotonic()
            except (OSError, asyncpg.PostgresError) as exc:
                logger.warning("job %s: heartbeat failed: %s", self.job_id, exc)
                continue
            if status != "running" and self.stop_reason is None:
                logger.info("job %s is %s: stopping its trainer", self.job_id, status)
                await self.stop(status or "lost")
            elif status == "running" and self.stop_reason is None and time.monotonic() >= self.budget_due:
                self.budget_due = time.monotonic() + self.settings.budget_check_interval_s
                try:
                    await self.check_budget()
                except (OSError, asyncpg.PostgresError) as exc:
                    logger.warning("job %s: budget check failed: %s", self.job_id, exc)

    async def attempt_cost_usd(self, conn: asyncpg.Connection | asyncpg.Pool) -> float:
        """What this attempt has trained so far costs, priced as its usage will be when it is recorded."""
        earlier = await store.recorded_tokens(conn, job_id=self.job_id)
        tokens = max(0, (self.tokens_seen or 0) - earlier)
        seconds = 0.0
        if self.started_mono is not None and self.progress_mono is not None:
            seconds = max(0.0, self.progress_mono - self.started_mono)
        return training_cost(self.settings, self.job["model"], tokens, seconds)

    async def check_budget(self) -> bool:
        """Pause the job (and stop its trainer) when month-to-date spend plus this attempt's cost reaches the
        organisation's monthly budget. True when it paused the job."""
        budget = await monthly_budget_usd(self.pool, org_id=self.org_id)
        if budget is None:
            return False
        spent = await month_spend_usd(self.pool, self.settings, org_id=self.org_id)
        cost = await self.attempt_cost_usd(self.pool)
        if spent + cost < budget:
            return False
        async with self.pool.acquire() as conn, conn.transaction():
            row = await store.pause_own(conn, job_id=self.job_id, worker_id=self.worker_id)
            if row is None:
                return False  # cancelled, paused or taken meanwhile: the next beat sees it
            await jobs_store.add_event(
                conn,
                job_id=self.job_id,
                org_id=self.org_id,
                level="warn",
                message=BUDGET_PAUSED,
                dedup_key=f"budget_paused:{self.job['attempts']}",
            )
        logger.info(
            "job %s paused: month-to-date $%.6f + this run $%.6f reaches the budget $%.6f",
            self.job_id,
            spent,
            cost,
            budget,
        )
        await self.stop("paused")
        return True

    # ---- events -----------------------------------------------------------------------------------
    async def handle(self, event: TrainerEvent) -> RunOutcome | None:
        """Record one trainer event (once, also when a resumed run replays it); the last one ends the run."""
        if isinstance(event, MetricsEvent):
            self.step = event.step
            self.progress_mono = time.monotonic()
            data = dict(event.data)
            if isinstance(data.get("tokens"), int):
                self.tokens_seen = data["tokens"]
            data.setdefault("step", event.step)
            data["total_steps"] = event.total_steps
            self.metrics_rows.append(data)
            await jobs_store.add_event(
                self.pool,
                job_id=self.job_id,
                org_id=self.org_id,
                type="metrics",
                data=data,
                message=_metrics_message(event.step, event.total_steps, data),
                dedup_key=f"metrics:{event.step}",
            )
        elif isinstance(event, CheckpointEvent):
            await self._checkpoint(event.step, Path(event.path), event.metrics)
        elif isinstance(event, MessageEvent):
            await jobs_store.add_event(
                self.pool,
                job_id=self.job_id,
                org_id=self.org_id,
                level=event.level,
                message=event.message[:4000],
                data=event.data,
            )
        elif isinstance(event, ResultEvent | ErrorEvent | StoppedEvent):
            return RunOutcome(event)
        return None

    async def _checkpoint(self, step: int, path: Path, metrics: dict[str, Any]) -> None:
        key = f"checkpoints/{self.org_id}/{self.job_id}/step-{step}"
        stored = await asyncio.to_thread(self.blobs.put_tree, path, key)
        name = f"{fine_tuned_model_name(self.job)}:ckpt-step-{step}"
        metrics = {"step": step, **metrics}
        await store.add_checkpoint(
            self.pool,
            job_id=self.job_id,
            org_id=self.org_id,
            step=step,
            metrics=metrics,
            model_name=name,
            path=str(stored),
        )
        await jobs_store.add_event(
            self.pool,
            job_id=self.job_id,
            org_id=self.org_id,
            message=f"Checkpoint saved at step {step}",
            dedup_key=f"checkpoint:{step}",
        )

    # ---- the end ------------------------------------------------------------------------------------
    async def succeed(self, event: ResultEvent) -> asyncpg.Record | None:
        """Store the adapter, register the model and the result file, and mark the job succeeded — one
        transaction, guarded by this worker still holding a running job."""
        model = fine_tuned_model_name(self.job)
        adapter = await asyncio.to_thread(
            self.blobs.put_tree, Path(event.adapter_path), f"adapters/{self.org_id}/{self.job_id}"
        )
        # Serve the new model before the job reports success: every engine of the base model loads it now.
        loaded = await load_adapter_everywhere(self.settings, model, self.job["model"], str(adapter))
        for upstream, problem in loaded.items():
            if problem:
                logger.warning(
                    "job %s: %s could not load the adapter yet: %s", self.job_id, upstream, problem
                )
        csv_bytes = _metrics_csv(await self._all_metrics())
        file_id = new_id("file-")
        file_key = f"files/{self.org_id}/{file_id}"
        temp = self.blobs.new_temp()
        temp.write_bytes(csv_bytes)
        async with self.pool.acquire() as conn, conn.transaction():
            row = await store.succeed_own(
                conn,
                job_id=self.job_id,
                worker_id=self.worker_id,
                model=model,
                trained_tokens=event.trained_tokens,
                result_files=[file_id],
                step=event.steps or self.step or 0,
            )
            if row is None:
                temp.unlink(missing_ok=True)
                return None
            await self.record_usage(conn, "succeeded", total_tokens=event.trained_tokens)
            await store.add_result_file(
                conn,
                file_id=file_id,
                org_id=self.org_id,
                filename="step_metrics.csv",
                size=len(csv_bytes),
                sha256=hashlib.sha256(csv_bytes).hexdigest(),
                blob_key=file_key,
            )
            await models_store.insert(
                conn,
                model_id=model,
                org_id=self.org_id,
                base_model=self.job["model"],
                job_id=self.job_id,
                adapter_path=str(adapter),
            )
            await jobs_store.add_event(
                conn,
                job_id=self.job_id,
                org_id=self.org_id,
                message=f"New fine-tuned model created: {model}",
                dedup_key="model_created",
            )
            await jobs_store.add_event(
                conn,
                job_id=self.job_id,
                org_id=self.org_id,
                message="The job has successfully completed",
                dedup_key="succeeded",
            )
            self.blobs.commit(temp, file_key)
        return row

    async def _all_metrics(self) -> list[dict[str, Any]]:
        rows = await self.pool.fetch(
            "SELECT data FROM fine_tuning_job_events WHERE job_id = $1 AND type = 'metrics' ORDER BY seq",
            self.job_id,
        )
        return [r["data"] for r in rows if r["data"]]

    async def fail(self, code: str, message: str) -> asyncpg.Record | None:
        error = {"code": code, "message": message, "param": None}
        async with self.pool.acquire() as conn, conn.transaction():
            row = await store.fail_own(conn, job_id=self.job_id, worker_id=self.worker_id, error=error)
            if row is not None:
                await self.record_usage(conn, "failed")
        if row is not None:
            await jobs_store.add_event(
                self.pool,
                job_id=self.job_id,
                org_id=self.org_id,
                level="error",
                message=f"Job failed: {message}",
                dedup_key="failed",
            )
        return row

    async def record_usage(self, conn: asyncpg.Connection, outcome: str, *, total_tokens: int = 0) -> None:
        """Write this attempt's training usage (once), in the caller's transaction.

        Tokens: the trainer's cumulative count (its result, else its last metrics event) less what earlier
        attempts already recorded; time: the trainer's start to its last reported step.
        """
        if self.usage_recorded:
            return
        self.usage_recorded = True
        cumulative = max(total_tokens, self.tokens_seen or 0)
        earlier = await store.recorded_tokens(conn, job_id=self.job_id)
        seconds = 0.0
        if self.started_mono is not None and self.progress_mono is not None:
            seconds = max(0.0, self.progress_mono - self.started_mono)
        tokens = max(0, cumulative - earlier)
        await store.add_training_usage(
            conn,
            org_id=self.org_id,
            job_id=self.job_id,
            base_model=self.job["model"],
            method=self.job["method"]["type"],
            trained_tokens=tokens,
            steps=max(0, (self.step or 0) - self.start_step),
            seconds=seconds,
            outcome=outcome,
        )
        # The request guard's month counter in Redis counts this spend too, so completions see the budget that
        # training used (a rolled-back transaction would over-count: budgets err on the strict side).
        cost = training_cost(self.settings, self.job["model"], tokens, seconds)
        if self.spend is not None and cost > 0:
            await self.spend.add_spent(month_key(self.org_id), to_micro(cost))

    def cleanup(self) -> None:
        shutil.rmtree(self.workdir, ignore_errors=True)


def _metrics_message(step: int, total: Any, data: dict[str, Any]) -> str:
    parts = [f"Step {step}/{total}" if total else f"Step {step}"]
    for key in ("train_loss", "reward_mean", "kl"):
        if isinstance(data.get(key), int | float):
            parts.append(f"{key}={data[key]:.4f}")
    return ": ".join([parts[0], ", ".join(parts[1:])]) if len(parts) > 1 else parts[0]


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


def _tail(path: Path, lines: int = 1) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    meaningful = [t for t in text if t.strip()]
    return " ".join(meaningful[-lines:])[-500:]

"""The worker side of the Tinker API: one training model held by one worker, in one training process.

The worker's `take_work` (`gateway.worker.main`) claims a model waiting for a holder as it claims jobs (the
same devices, the same fairness across organisations) and runs a `Holder`, which starts
`python -m trainer.tinker_session` (it dies with the worker) and answers the model's requests one at a time
in `seq` order, writing each result to its row. While it holds the model it beats; a model whose holder
stops beating for `stale_after_s` is lost (`gateway.tinker.futures` fails its requests, so the SDK raises
instead of waiting). A model idle for `tinker_idle_timeout_s`, or with no open request once its session's
client reported it finished, is saved (adapter, optimizer and the gradients of a `forward_backward` not yet
stepped) and let go; its next request starts a process that loads that state first, so the client's next
`optim_step` steps on what it computed before. A model does not keep the slot from others: once it has held
it for `tinker_max_hold_s` (busy or not), or been idle for `tinker_yield_idle_s`, while work that the claim's
fair order puts first waits for a device, it is saved and let go the same way after the request in hand, and
its requests wait their turn (`gateway.work.store.FAIREST`). A training process that dies fails the model's
open requests with its last log line and marks the model lost: the client goes on from its last saved state
(`create_training_client_from_state`).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import shutil
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import asyncpg
import orjson
from arq.connections import ArqRedis

from gateway.blobstore import BlobStore
from gateway.notices import Notices
from gateway.queue import enqueue
from gateway.serving.engines import AdapterLoader
from gateway.serving.versions import adapter_version
from gateway.settings import Settings
from gateway.tinker import store, wire
from gateway.tinker.paths import (
    RUN_TINKER_MODEL,
    SEGMENT,
    checkpoint_key,
    served_model_id,
    tinker_path,
    workdir_key,
)
from gateway.tinker.rows import RequestRow, TrainingModelRow
from gateway.work import store as work_store
from gateway.work.devices import Device, DevicePool, confine, generation_devices
from gateway.work.process import die_with_parent, trainer_env

logger = logging.getLogger(__name__)

RECHECK_S = 1.0
"""Longest an idle holder goes without reading its model's requests (between wake-ups)."""


class ProcessDied(Exception):
    """The training process exited; its last log line says why."""


class TrainingProcess:
    """`python -m trainer.tinker_session` and its one-request-at-a-time pipe."""

    def __init__(self, workdir: Path, device: Device) -> None:
        self.workdir = workdir
        self.device = device
        self.log = workdir / "session.log"
        self.proc: asyncio.subprocess.Process | None = None

    async def start(self) -> None:
        env, cpus = confine([self.device])
        with open(self.log, "ab") as stderr:  # noqa: ASYNC230 - opening a log file is instant
            self.proc = await asyncio.create_subprocess_exec(
                sys.executable, "-m", "trainer.tinker_session",
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=stderr,
                env={**trainer_env(self.workdir), **env}, cwd=str(self.workdir),
                preexec_fn=functools.partial(die_with_parent, cpus),
                limit=256 * 1024 * 1024,
            )  # fmt: skip

    async def call(self, request: dict[str, Any]) -> dict[str, Any]:
        """Send one request and wait for its reply (`ok`, then `result` or `error` and `category`)."""
        proc = self.proc
        assert proc is not None and proc.stdin is not None and proc.stdout is not None
        try:
            proc.stdin.write(json.dumps(request).encode() + b"\n")
            await proc.stdin.drain()
            line = await proc.stdout.readline()
        except (BrokenPipeError, ConnectionResetError):
            line = b""
        if not line:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(proc.wait(), 5)
            raise ProcessDied(self.last_log_line() or f"exited with code {proc.returncode}")
        reply: dict[str, Any] = json.loads(line)
        return reply

    def last_log_line(self) -> str:
        with contextlib.suppress(OSError):
            lines = [ln for ln in self.log.read_text(errors="replace").splitlines() if ln.strip()]
            return lines[-1][-500:] if lines else ""
        return ""

    async def stop(self) -> None:
        proc = self.proc
        if proc is None or proc.returncode is not None:
            return
        assert proc.stdin is not None
        proc.stdin.close()
        try:
            await asyncio.wait_for(proc.wait(), 10)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()


class Holder:
    """One held model: its process, its beat, its requests."""

    def __init__(self, model: TrainingModelRow, ctx: dict[str, Any], device: Device) -> None:
        self.model = model
        self.model_id = model.id
        self.org_id = model.organization_id
        self.settings: Settings = ctx["settings"]
        self.pool: asyncpg.Pool = ctx["pool"]
        self.blobs: BlobStore = ctx["blobs"]
        self.worker_id: str = ctx["worker_id"]
        self.notices: Notices = ctx["notices"]
        # named by the row's number, not its id: nothing a client sent is in a host path
        self.workdir = self.blobs.path(workdir_key(model.seq))
        self.process = TrainingProcess(self.workdir, device)
        self.devices: DevicePool = ctx["devices"]
        """The worker's devices: whether waiting work needs this model's (`_others_first`)."""
        self.queue: ArqRedis | None = ctx.get("redis")
        """Where a model let go with requests open gets its wake-up."""
        self._next_look = 0.0

    async def run(self) -> str:
        self.workdir.mkdir(parents=True, exist_ok=True)
        await self.process.start()
        beat = asyncio.create_task(self._beat())
        try:
            init = {"op": "init", "base_path": str(self.settings.base_model_path(self.model.base_model))}
            init.update(self.model.lora_config)
            await self._must(init)
            if self.model.resume_path:
                await self._must(
                    {
                        "op": "load_state",
                        "dir": self.model.resume_path,
                        "optimizer": "if_saved",
                        "grads": True,
                    }
                )
            return await self._serve()
        except ProcessDied as exc:
            reason = (
                f"The training process of model {self.model_id} died ({exc}); its unsaved weights are lost."
            )
            logger.warning(reason)
            await store.lose(self.pool, model_id=self.model_id, reason=reason)
            return "lost"
        finally:
            beat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await beat
            await self.process.stop()

    async def _must(self, request: dict[str, Any]) -> None:
        reply = await self.process.call(request)
        if not reply["ok"]:
            raise ProcessDied(reply["error"])

    async def _beat(self) -> None:
        while True:
            await asyncio.sleep(self.settings.heartbeat_interval_s)
            try:
                await store.beat(self.pool, model_id=self.model_id, worker_id=self.worker_id)
            except (OSError, asyncpg.PostgresError) as exc:
                logger.warning("tinker model %s: beat failed: %s", self.model_id, exc)

    async def _serve(self) -> str:
        taken = idle_since = time.monotonic()
        while True:
            with self.notices.watching(store.REQUEST_CHANNEL, self.model_id) as queued:  # before the read
                req = await store.next_request(self.pool, model_id=self.model_id)
                now = time.monotonic()
                idle = req is None and now - idle_since >= self.settings.tinker_idle_timeout_s
                if req is None and not idle:
                    if await self._others_first(held_s=now - taken, idle_s=now - idle_since):
                        return await self._let_go_for_others(now - taken)
                    if not await store.session_finished(self.pool, model_id=self.model_id):
                        # woken by the next request; reads again at least every RECHECK_S (a finished
                        # session, a lost notice, work that waits for this slot)
                        await self.notices.wait(queued, RECHECK_S)
                        continue
            if req is None:
                saved = await self._save_to_resume()
                if await store.release(
                    self.pool, model_id=self.model_id, worker_id=self.worker_id, resume_path=saved
                ):
                    await self._wake_if_asked()
                    return "idle"
                continue
            idle_since = time.monotonic()
            await self._answer(req)
            if await self._others_first(held_s=time.monotonic() - taken, idle_s=0.0):
                return await self._let_go_for_others(time.monotonic() - taken)

    async def _others_first(self, *, held_s: float, idle_s: float) -> bool:
        """Whether this model should let its slot go now: it has held it for `tinker_max_hold_s`, or been idle
        for `tinker_yield_idle_s`, and work that waits for a device (a queued job, another model) would have
        this one's first by the claim's fair order. Busy or idle, every request counts toward the hold, so a
        client that keeps sending cheap ones (optimizer steps) does not keep the slot from others. Asked at
        most every RECHECK_S."""
        settings = self.settings
        if held_s < settings.tinker_max_hold_s and idle_s < settings.tinker_yield_idle_s:
            return False
        now = time.monotonic()
        if now < self._next_look:
            return False
        self._next_look = now + RECHECK_S
        free = len(self.devices.free)
        generation = generation_devices(settings, "reinforcement")
        if free and await work_store.fairest(self.pool, free=free, generation=generation) is not None:
            return False  # it fits the devices free here: this worker takes it without this one's
        first = await work_store.fairest(
            self.pool, free=free + 1, generation=generation, holding=self.model_id
        )
        return first is not None and first != work_store.Work("tinker", self.model_id)

    async def _let_go_for_others(self, held_s: float) -> str:
        """Save the model (as when idle: `_save_to_resume`) and give its slot to the work that waits; its open
        and later requests wait for the next holder, which loads that state first."""
        saved = await self._save_to_resume()
        if not await store.hand_back_model(
            self.pool, model_id=self.model_id, worker_id=self.worker_id, resume_path=saved
        ):
            return "lost"  # taken from this worker meanwhile (its beat was late): nothing of it is here
        logger.info("tinker model %s let its slot go after %.0f s for work that waits", self.model_id, held_s)
        await self._wake_if_asked()
        return "yielded"

    async def _save_to_resume(self) -> str:
        """Save the model where its next holder resumes from; returns the path. Everything a later request
        depends on: the adapter, the optimizer (moments and step count) and the gradients accumulated since
        the last `optim_step`, as a client may be let go between its `forward_backward` and its step. Only
        these saves hold gradients; a user's checkpoint (`save_weights`) does not."""
        key = checkpoint_key(self.org_id, self.model_id, "idle", "resume")
        return await self._save("save_state", key, optimizer=True, grads=True)

    async def _wake_if_asked(self) -> None:
        """After the model was let go: when a request of it is open (it came while the model was let go, or
        the model was let go for others with requests queued), a worker's wake-up, as the API sends one for
        a request of a model no worker holds. Read after the release, so none falls between the two."""
        if await store.model_asked(self.pool, model_id=self.model_id):
            await enqueue(
                self.queue, self.settings.queue_name, self.model_id, time.time_ns(), function=RUN_TINKER_MODEL
            )

    @contextlib.asynccontextmanager
    async def _written(self, op: str, *, optimizer: bool = False, grads: bool = False) -> AsyncIterator[Path]:
        """A temporary directory the training process wrote with `op`, removed afterwards."""
        temp = self.blobs.new_temp()
        try:
            reply = await self.process.call(
                {"op": op, "dir": str(temp), "optimizer": optimizer, "grads": grads}
            )
            if not reply["ok"]:
                raise RuntimeError(reply["error"])
            yield temp
        finally:
            shutil.rmtree(temp, ignore_errors=True)

    async def _save(self, op: str, key: str, *, optimizer: bool = False, grads: bool = False) -> str:
        async with self._written(op, optimizer=optimizer, grads=grads) as temp:
            return str(self.blobs.put_tree(temp, key))

    async def _answer(self, req: RequestRow) -> None:
        kind = req.kind
        try:
            result, result_type = await self._run(kind, req.payload)
        except ProcessDied:
            raise
        except _UserError as exc:
            await store.finish(self.pool, request_id=req.id, error=str(exc), category="user")
            return
        except Exception as exc:  # noqa: BLE001 — the request's answer; the model lives on
            logger.exception("tinker request %s (%s) failed", req.id, kind)
            await store.finish(self.pool, request_id=req.id, error=str(exc), category="server")
            return
        await store.finish(self.pool, request_id=req.id, result=result, result_type=result_type)

    async def _run(self, kind: str, payload: dict[str, Any]) -> tuple[bytes, str]:
        if kind in ("forward", "forward_backward"):
            reply = await self.process.call({"op": "forward_backward", **payload})
            _raise(reply)
            out = reply["result"]
            await store.meter(
                self.pool, org_id=self.org_id, key_id=self.model.api_key_id,
                model=f"tinker-{kind}:{self.model_id}", base_model=self.model.base_model,
                tokens=out["tokens"],
            )  # fmt: skip
            return wire.encode_forward_output(out["outputs"], out["metrics"]), "proto"
        if kind == "optim_step":
            reply = await self.process.call({"op": "optim_step", **payload})
            _raise(reply)
            return orjson.dumps({"metrics": reply["result"]["metrics"]}), "json"
        if kind == "load_weights":
            reply = await self.process.call({"op": "load_state", **payload})
            _raise(reply)
            return orjson.dumps(
                {"path": payload["path"], "model_id": self.model_id, "type": "load_weights"}
            ), "json"
        if kind == "save_weights":
            name = payload["name"]
            key = checkpoint_key(self.org_id, self.model_id, SEGMENT["training"], name)
            path = await self._save("save_state", key, optimizer=True)
            await store.add_checkpoint(
                self.pool, org_id=self.org_id, model_id=self.model_id, kind="training", name=name, path=path,
                served_model=None, with_optimizer=True, size_bytes=_size(Path(path)),
                base_model=self.model.base_model, ttl_s=payload.get("ttl_seconds"),
            )  # fmt: skip
            return orjson.dumps(
                {"path": tinker_path(self.model_id, "training", name), "type": "save_weights"}
            ), "json"
        if kind == "save_weights_for_sampler":
            return await self._save_sampler(payload), "json"
        raise RuntimeError(f"unknown request kind {kind!r}")

    async def _save_sampler(self, payload: dict[str, Any]) -> bytes:
        name = payload["name"]
        base = self.model.base_model
        key = checkpoint_key(self.org_id, self.model_id, SEGMENT["sampler"], name)
        async with self._written("save_sampler") as temp:
            version = await asyncio.to_thread(adapter_version, temp)
            # A folder a version: saved again under its name, a sampler's earlier version keeps its files, so
            # a request admitted for it before this save never loads the new weights under the old id.
            path = str(self.blobs.put_tree(temp, f"{key}/{version}"))
        served = served_model_id(base, self.org_id, self.model_id, name)
        await store.add_checkpoint(
            self.pool, org_id=self.org_id, model_id=self.model_id, kind="sampler", name=name, path=path,
            served_model=served, with_optimizer=False, size_bytes=_size(Path(path)), base_model=base,
            ttl_s=payload.get("ttl_seconds"), version=version,
        )  # fmt: skip
        await asyncio.to_thread(_drop_older_versions, Path(path))
        # the engines load it now, as after a fine-tuning job (a miss loads it on the first request anyway)
        async with AdapterLoader(self.settings) as loader:
            await loader.load_everywhere(served, base, path, version)
        body: dict[str, Any] = {
            "path": tinker_path(self.model_id, "sampler", name),
            "type": "save_weights_for_sampler",
        }
        sampler_id = payload.get("sampler_id")
        if sampler_id is not None:
            await store.create_sampler(
                self.pool, sampler_id=sampler_id, org_id=self.org_id, session_id=payload["session_id"],
                base_model=base, model_path=body["path"], served_model=served,
            )  # fmt: skip
            body["sampling_session_id"] = sampler_id
        return orjson.dumps(body)


class _UserError(Exception):
    """The training process refused a request as the caller's mistake."""


def _raise(reply: dict[str, Any]) -> None:
    if reply["ok"]:
        return
    if reply.get("category") == "user":
        raise _UserError(reply["error"])
    raise RuntimeError(reply["error"])


VERSION_GRACE_S = 300.0
"""How long the files of a sampler's earlier version outlive a save under its name: requests admitted for it
before the save may still be loading it."""


def _drop_older_versions(current: Path) -> None:
    """Remove the folders of a sampler name's earlier versions (beside `current`) older than the grace."""
    cutoff = time.time() - VERSION_GRACE_S
    for sibling in current.parent.iterdir():
        with contextlib.suppress(OSError):
            if sibling != current and sibling.is_dir() and sibling.stat().st_mtime < cutoff:
                shutil.rmtree(sibling)


def _size(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())

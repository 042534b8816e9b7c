"""vLLM in server mode for a reinforcement job: `trl vllm-serve` on generation devices of the job's own,
started before its trainer and stopped after it. The trainer (`vllm_mode="server"`) sends its prompts there
and pushes its weights after each step; TRL merges the LoRA adapter into the weights it sends (it has no
adapter-only sync)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import time
from collections.abc import AsyncIterator
from pathlib import Path

import httpx

from gateway.work.devices import Device, free_port, vllm_serve
from gateway.work.process import die_with_parent, trainer_env
from gateway.worker.job.process import log_tail

STARTUP_TIMEOUT_S = 600.0
"""Longest wait for a generation server to answer its health check (it loads the model first)."""


@contextlib.asynccontextmanager
async def generation_server(devices: list[Device], base_model: str, workdir: Path) -> AsyncIterator[str]:
    """A `trl vllm-serve` on `devices` for the time of the block; yields its `host:port`. Its log is
    `workdir/vllm.log`; a server that exits or stays unhealthy fails the job with that log's tail."""
    port = free_port()
    plan = vllm_serve(devices, base_model, port)
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    with open(workdir / "vllm.log", "ab") as log:  # noqa: ASYNC230 - opening a log file is instant
        proc = await asyncio.create_subprocess_exec(
            *plan.argv,
            stdout=log,
            stderr=log,
            env={**trainer_env(workdir), **plan.env},
            cwd=str(workdir),
            preexec_fn=functools.partial(die_with_parent, None),
        )
    try:
        await _healthy(f"http://127.0.0.1:{port}/health", proc, workdir / "vllm.log")
        yield f"127.0.0.1:{port}"
    finally:
        if proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(proc.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                await proc.wait()


async def _healthy(url: str, proc: asyncio.subprocess.Process, log: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    async with httpx.AsyncClient(trust_env=False, timeout=5) as client:
        while time.monotonic() < deadline:
            if proc.returncode is not None:
                break
            with contextlib.suppress(httpx.HTTPError):
                if (await client.get(url)).status_code == 200:
                    return
            await asyncio.sleep(1.0)
    tail = await asyncio.to_thread(log_tail, log)
    raise RuntimeError(f"the vLLM generation server did not start: {tail or 'no output'}")

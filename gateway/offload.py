"""Heavy work off the gateway's event loop, and at most so much of it per organisation at once.

Two kinds of work leave the loop:

* **Blocking work** (`Offload.thread`): sandboxed calls (`environments/run`, `graders/run` with python or
  model graders, the upload check of an environment package) wait on a child process or an engine for up
  to a minute. They run on threads of their own, at most `sandbox_slots` at once, never on anyio's default
  thread pool, which file uploads and every other request share. A call that finds every slot taken waits
  for one up to `sandbox_wait_s`, then gets 503 `sandbox_busy` with `retry-after`.
* **Computation** (`Offload.cpu`): a single C call that holds the interpreter's lock for its whole run
  (`ast.parse` of a large python grader source, fuzzy matching or ROUGE of long texts, decoding a large
  Tinker `forward_backward` body) stalls the loop even from a thread. It runs in a small pool of processes
  (`cpu_processes`, spawned on first use) instead. Spawned, like any multiprocessing pool: a program that
  embeds the gateway guards its main module (`if __name__ == "__main__":`); `tunegate gateway`, `tunegate
  up` and uvicorn do.

Both count against the calling organisation on this process: it may have `sandbox_slots_per_organization`
calls of either kind running, and one more is refused at once with 429 `concurrency_limit_exceeded`. So one
tenant holds at most its share of the slots and of the pool's queue, whatever it sends; the slots are
this process's (each gateway process guards its own threads and loop).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import multiprocessing
import os
import threading
from collections.abc import AsyncIterator, Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from typing import Any, TypeVar

import anyio

from gateway.errors import RateLimited, ServiceUnavailable
from gateway.settings import Settings

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Offload:
    """The gateway process's slots for sandboxed work, its CPU pool, and each organisation's share."""

    def __init__(self, settings: Settings) -> None:
        self.slots = settings.sandbox_slots
        self.per_organization = settings.sandbox_slots_per_organization
        self.wait_s = settings.sandbox_wait_s
        self.processes = settings.cpu_processes
        self._gate = anyio.CapacityLimiter(self.slots)
        self._threads = anyio.CapacityLimiter(self.slots)  # never contended: the gate admits no more
        self._running: dict[str, int] = {}
        self._pool: ProcessPoolExecutor | None = None

    def running(self, org_id: str) -> int:
        """Calls of the organisation running now (sandboxed and computed)."""
        return self._running.get(org_id, 0)

    def admit(self, org_id: str) -> None:
        """429 at once when the organisation has all its calls running: checked before a request does any
        work of its own (a lookup, an unpacking), which `share` would then refuse."""
        held = self._running.get(org_id, 0)
        if held >= self.per_organization:
            raise self._refusal(held)

    def _refusal(self, held: int) -> RateLimited:
        return RateLimited(
            f"Your organization already has {held} sandboxed or CPU-heavy calls running on this gateway "
            "(environments/run, graders/run, grader checks, environment uploads, large Tinker "
            "forward_backward bodies), the most it may run at once; retry when one finishes.",
            code="concurrency_limit_exceeded",
            headers={"retry-after": "1"},
        )

    @contextlib.asynccontextmanager
    async def share(self, org_id: str) -> AsyncIterator[None]:
        """Hold one of the organisation's `sandbox_slots_per_organization` for the block; 429 when it has
        them all."""
        held = self._running.get(org_id, 0)
        if held >= self.per_organization:
            raise self._refusal(held)
        self._running[org_id] = held + 1
        try:
            yield
        finally:
            left = self._running[org_id] - 1
            if left:
                self._running[org_id] = left
            else:
                del self._running[org_id]

    async def thread(self, org_id: str, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` on a sandbox thread, as one of the organisation's calls."""
        async with self.share(org_id):
            with anyio.move_on_after(self.wait_s) as waiting:
                await self._gate.acquire()
            if waiting.cancelled_caught:
                raise ServiceUnavailable(
                    f"All {self.slots} sandbox slots of this gateway are busy; retry shortly.",
                    code="sandbox_busy",
                    headers={"retry-after": "5"},
                )
            try:
                return await anyio.to_thread.run_sync(functools.partial(fn, *args), limiter=self._threads)
            finally:
                self._gate.release()

    async def cpu(self, org_id: str, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the CPU pool, as one of the organisation's calls. `fn`, its arguments,
        its result and its exceptions cross a process boundary: module-level functions and plain data."""
        async with self.share(org_id):
            return await self.compute(fn, *args, **kwargs)

    async def compute(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` in the CPU pool, for a caller that already holds a share."""
        pool = self._pool
        if pool is None:
            # spawned, not forked: the gateway has threads, and a child needs only envsdk
            context = multiprocessing.get_context("spawn")
            pool = self._pool = ProcessPoolExecutor(
                max_workers=self.processes, mp_context=context, initializer=_start_pool_process
            )
        call = functools.partial(fn, *args, **kwargs)
        try:
            return await asyncio.get_running_loop().run_in_executor(pool, call)
        except BrokenProcessPool:
            logger.warning("the CPU pool lost a process; starting a new pool")
            if self._pool is pool:
                self._pool = None
                pool.shutdown(wait=False, cancel_futures=True)
            raise ServiceUnavailable(
                "A check process of this gateway died; retry shortly.",
                code="cpu_pool_unavailable",
                headers={"retry-after": "1"},
            ) from None

    def close(self) -> None:
        """Stop the CPU pool's processes and wait for them (work still queued is dropped). Blocking: the
        server may end the process with its signal right after the lifespan, before any exit handler."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


POOL_NICENESS = 10
"""How much lower the CPU pool's processes run than the gateway's: a tenant's checks take the CPU that
serving leaves."""


def _start_pool_process() -> None:
    """In each pool process: run at a lower priority than serving, and exit as soon as the gateway process
    is gone, however it went (a process left waiting on the pool's queue would never learn it)."""
    with contextlib.suppress(OSError):
        os.nice(POOL_NICENESS)
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        parent.join()
        os._exit(0)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()

"""Background tasks a resource keeps for its life: stopping one at shutdown."""

from __future__ import annotations

import asyncio
import contextlib
from typing import Any


async def stop(task: asyncio.Task[Any] | None) -> None:
    """Cancel `task` (None: nothing to stop) and wait until it has ended."""
    if task is None:
        return
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def finish(task: asyncio.Task[Any] | None, *, within_s: float) -> None:
    """Wait up to `within_s` for `task` to end by itself (its owner has told it to: a write in progress is
    not cut in two), then stop it."""
    if task is None:
        return
    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(task), within_s)
    await stop(task)

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

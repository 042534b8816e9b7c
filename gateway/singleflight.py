"""One run of some work per key at a time, shared by everyone who asks for it meanwhile.

The first caller starts the work as a task of its own, so a caller that goes away (a client that left)
cancels nothing the others wait for; the rest await the same task. A cache that expires under load thus
makes one database query, not one per request waiting on it.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Coroutine, Hashable
from typing import Any, Generic, TypeVar

K = TypeVar("K", bound=Hashable)
T = TypeVar("T")


class SingleFlight(Generic[K, T]):
    """Concurrent `run(key, work)` calls for one key share one `work()`."""

    def __init__(self) -> None:
        self._running: dict[K, asyncio.Task[T]] = {}

    def __contains__(self, key: K) -> bool:
        return key in self._running

    def start(self, key: K, work: Callable[[], Coroutine[Any, Any, T]]) -> asyncio.Task[T]:
        """The task running `work` for `key`: the one already running, else a new one."""
        task = self._running.get(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(work())
            self._running[key] = task
            task.add_done_callback(lambda done: self._forget(key, done))
        return task

    async def run(self, key: K, work: Callable[[], Coroutine[Any, Any, T]]) -> T:
        """`work()`'s result, from the run for `key` already going on if there is one."""
        return await asyncio.shield(self.start(key, work))

    def _forget(self, key: K, done: asyncio.Task[T]) -> None:
        if self._running.get(key) is done:
            del self._running[key]
        if not done.cancelled():
            done.exception()  # retrieved here: a failure nobody waited for is not reported twice

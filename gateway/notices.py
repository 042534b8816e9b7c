"""Wake-ups through PostgreSQL's LISTEN/NOTIFY: a waiter on `(channel, key)` is woken when a statement
notifies that channel with that key as its payload (`pg_notify(channel, key)`, sent at its commit).

One connection per process listens; `watching()` registers interest *before* the caller reads the database,
so a notice sent between that read and the wait is not missed. A wake-up is only a hint: callers still read
the database, and wait with a timeout, so a lost notice or a dropped listening connection (re-opened on the
next wait) costs latency, never correctness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Iterator
from typing import Any

import asyncpg

logger = logging.getLogger(__name__)

RECONNECT_S = 1.0
"""Least time between two attempts to re-open a lost listening connection."""


class Notices:
    """The listening side of some channels (see the module's docstring)."""

    def __init__(self, dsn: str, channels: tuple[str, ...]) -> None:
        self.dsn = dsn
        self.channels = channels
        self._conn: asyncpg.Connection | None = None
        self._waiters: dict[tuple[str, str], set[asyncio.Future[None]]] = {}
        self._tried = 0.0
        self._lock = asyncio.Lock()

    async def _listen(self) -> None:
        if self._conn is not None and not self._conn.is_closed():
            return
        async with self._lock:
            listening = self._conn is not None and not self._conn.is_closed()
            if listening or time.monotonic() - self._tried < RECONNECT_S:
                return
            self._tried = time.monotonic()
            try:
                conn = await asyncpg.connect(self.dsn)
                for channel in self.channels:
                    await conn.add_listener(channel, self._notified)
            except (OSError, asyncpg.PostgresError) as exc:
                logger.warning("cannot listen for notices (%s); waits fall back to their timeouts", exc)
                return
            self._conn = conn

    def _notified(self, _conn: Any, _pid: int, channel: str, payload: str) -> None:
        for future in self._waiters.pop((channel, payload), ()):
            if not future.done():
                future.set_result(None)

    @contextlib.contextmanager
    def watching(self, channel: str, key: str) -> Iterator[asyncio.Future[None]]:
        """A future done at the next notice of `key` on `channel`, for the `with` block; enter it before
        reading the database."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.setdefault((channel, key), set()).add(future)
        try:
            yield future
        finally:
            waiting = self._waiters.get((channel, key))
            if waiting is not None:
                waiting.discard(future)
                if not waiting:
                    del self._waiters[(channel, key)]

    async def wait(self, future: asyncio.Future[None], timeout_s: float) -> bool:
        """Wait for `future` (from `watching`) at most `timeout_s`; True when the notice came."""
        await self._listen()
        try:
            await asyncio.wait_for(asyncio.shield(future), timeout_s)
        except TimeoutError:
            return False
        return True

    async def aclose(self) -> None:
        if self._conn is not None:
            with contextlib.suppress(Exception):
                await self._conn.close()
        self._conn = None

"""Captured calls written off the request path: `CaptureWriter`, a bounded buffer of `CapturedRow`s (one call,
as migration 0018 holds it) that a background task writes in batches (one `executemany` per batch, by size
and by time, and on shutdown), as `gateway.usage.buffer` does for usage. When the buffer is full (the
database down for long) new records are dropped and counted rather than slowing serving. The same task
deletes records past their retention now and then.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

import asyncpg

from gateway import tasks
from gateway.capture import store
from gateway.capture.store import CapturedRow

logger = logging.getLogger(__name__)

CLOSE_WAIT_S = 10.0
"""How long closing waits for the write in progress before it cuts it short."""

PURGE_EVERY_S = 600.0
"""How often a gateway deletes records past their retention (reads never show them anyway)."""
PURGE_BATCH = 1000


class CaptureWriter:
    """Records waiting to be written; `start(pool)` begins the background writes (as `UsageBuffer`)."""

    def __init__(
        self, *, max_rows: int = 10_000, flush_rows: int = 32, flush_interval_s: float = 1.0
    ) -> None:
        self.max_rows = max_rows
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self._rows: list[CapturedRow] = []
        self.dropped = 0
        """Records dropped because the buffer was full (the database down for long)."""
        self.written = 0
        self._pool: asyncpg.Pool | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        """Set by `aclose`: the background task ends after the write it is doing."""
        self._lock = asyncio.Lock()
        self._purged_at = 0.0

    def add(self, rec: CapturedRow) -> None:
        """Queue one record; never blocks (drops and counts when full)."""
        if len(self._rows) >= self.max_rows:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("capture buffer full: %d records dropped so far", self.dropped)
            return
        self._rows.append(rec)
        if len(self._rows) >= self.flush_rows:
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._rows)

    def start(self, pool: asyncpg.Pool) -> None:
        self._pool = pool
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="capture-writer")

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            self._wake.clear()
            try:
                await self.flush()
                if time.monotonic() - self._purged_at >= PURGE_EVERY_S and self._pool is not None:
                    self._purged_at = time.monotonic()
                    await store.purge_expired(self._pool, most=PURGE_BATCH)
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
                logger.warning("could not write captures (%d wait): %s", len(self._rows), exc)

    async def flush(self) -> int:
        """Write every waiting record now; returns how many. On failure they go back to the buffer."""
        if self._pool is None:
            return 0
        async with self._lock:
            if not self._rows:
                return 0
            batch, self._rows = self._rows, []
            try:
                await store.insert_many(self._pool, batch)
            except BaseException:
                room = max(0, self.max_rows - len(self._rows))
                self.dropped += max(0, len(batch) - room)
                self._rows[:0] = batch[:room]
                raise
            self.written += len(batch)
            return len(batch)

    async def aclose(self) -> None:
        """Stop the background task (after the write it is doing: a batch cut in two at shutdown could lose
        rows that no longer fit the buffer) and write what is left."""
        self._closing = True
        self._wake.set()
        await tasks.finish(self._task, within_s=CLOSE_WAIT_S)
        self._task = None
        try:
            await self.flush()
        except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as exc:
            logger.error("captures lost at shutdown (%d): %s", len(self._rows), exc)

"""Rows written off the request path: a bounded buffer that a background task writes in batches, by size
(`flush_rows` waiting) and by time (`flush_interval_s`), and on shutdown.

`add()` is a list append (no await, no lock): a request never waits for the database. When the buffer is full
(the database down for long) new rows are dropped and counted in `dropped` rather than slowing serving. A
failed write puts its batch back (what still fits). Closing lets the write in progress finish (a batch cut in
two at shutdown could lose rows that no longer fit the buffer), then writes what is left. A subclass says how
a batch is written (`_write`), and may add work after each flush (`_after_flush`) or at close (`_closed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Generic, TypeVar

import asyncpg

from gateway import tasks

logger = logging.getLogger(__name__)

T = TypeVar("T")

CLOSE_WAIT_S = 10.0
"""How long closing waits for the write in progress before it cuts it short."""
DB_ERRORS = (OSError, asyncpg.PostgresError, asyncpg.InterfaceError)


class BatchWriter(Generic[T]):
    """Rows of type `T` waiting to be written; `start(pool)` begins the background writes."""

    what = "rows"
    """What the rows are, in log lines."""

    def __init__(self, *, max_rows: int, flush_rows: int = 32, flush_interval_s: float = 1.0) -> None:
        self.max_rows = max_rows
        self.flush_rows = flush_rows
        self.flush_interval_s = flush_interval_s
        self._rows: list[T] = []
        self.dropped = 0
        """Rows dropped because the buffer was full."""
        self.written = 0
        """Rows written to the database."""
        self._pool: asyncpg.Pool | None = None
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closing = False
        """Set by `aclose`: the background task ends after the write it is doing."""
        self._flush_lock = asyncio.Lock()

    def add(self, row: T) -> None:
        """Queue one row; never blocks (drops and counts when full)."""
        if len(self._rows) >= self.max_rows:
            self.dropped += 1
            if self.dropped == 1 or self.dropped % 1000 == 0:
                logger.warning("%s buffer full: %d dropped so far", self.what, self.dropped)
            return
        self._rows.append(row)
        if len(self._rows) >= self.flush_rows:
            self._wake.set()

    @property
    def pending(self) -> int:
        return len(self._rows)

    def start(self, pool: asyncpg.Pool) -> None:
        """Begin writing to `pool` in the background."""
        self._pool = pool
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name=f"{self.what}-writer")

    async def _run(self) -> None:
        while not self._closing:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.flush_interval_s)
            self._wake.clear()
            try:
                await self.flush()
                await self._after_flush()
            except DB_ERRORS as exc:
                logger.warning("could not write %s (%d wait): %s", self.what, len(self._rows), exc)

    async def flush(self) -> int:
        """Write every waiting row now; returns how many. On failure the rows go back to the buffer."""
        if self._pool is None:
            return 0
        async with self._flush_lock:
            if not self._rows:
                return 0
            batch, self._rows = self._rows, []
            try:
                await self._write(self._pool, batch)
            except BaseException:
                await self._failed()
                room = max(0, self.max_rows - len(self._rows))
                self.dropped += max(0, len(batch) - room)
                self._rows[:0] = batch[:room]
                raise
            self.written += len(batch)
            return len(batch)

    async def aclose(self) -> None:
        """Stop the background task (after the write it is doing) and write what is left."""
        self._closing = True
        self._wake.set()
        await tasks.finish(self._task, within_s=CLOSE_WAIT_S)
        self._task = None
        try:
            await self.flush()
        except DB_ERRORS as exc:
            logger.error("%s lost at shutdown (%d): %s", self.what, len(self._rows), exc)
        await self._closed()

    async def _write(self, pool: asyncpg.Pool, batch: list[T]) -> None:
        raise NotImplementedError

    async def _failed(self) -> None:
        """A write failed (or was cut short)."""

    async def _after_flush(self) -> None:
        """Work of the background task after each flush."""

    async def _closed(self) -> None:
        """Work at the end of `aclose`."""

"""Completion metering off the request path: a bounded buffer flushed by size and by time.

`record()` is a list append (no await, no lock): the request never waits for the database. A background task
writes waiting rows with one `COPY` (asyncpg `copy_records_to_table`) whenever `flush_rows` are waiting or
`flush_interval_s` has passed, on a connection of the pool it keeps, handing the rows to the COPY a slice of
`YIELD_EVERY` at a time so that requests run between slices (a 500-row batch encoded in one go held the
event loop for 2 ms, the gateway's largest stall); `aclose()` writes what is left. When the buffer is full
(the database is down for long), new rows are dropped and counted in `dropped` rather than slowing serving;
the default size holds minutes of heavy load.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import asyncpg

from gateway.batches import BatchWriter

logger = logging.getLogger(__name__)

YIELD_EVERY = 64
"""Rows encoded between two turns of the event loop while a batch is written."""

COLUMNS = (
    "organization_id",
    "api_key_id",
    "model",
    "base_model",
    "prompt_tokens",
    "completion_tokens",
    "latency_ms",
    "status",
    "created_at",
)


@dataclass(slots=True)
class UsageRecord:
    """Token usage of one completion (not frozen: a frozen dataclass's `__init__` costs three times as much,
    and one is made on every request)."""

    organization_id: str
    api_key_id: str
    model: str
    """The model id the client asked for (a base model, an `ft:` model or a checkpoint)."""
    prompt_tokens: int
    completion_tokens: int
    at: float
    """Unix time the request arrived."""
    base_model: str = ""
    """The base model that served it (prices are per base model)."""
    latency_ms: int = 0
    """From arrival to the last byte of the answer."""
    status: int = 200
    """HTTP status of the answer (a stream that broke after it started keeps its 200)."""

    def row(self) -> tuple[Any, ...]:
        return (
            self.organization_id,
            self.api_key_id,
            self.model,
            self.base_model or self.model,
            self.prompt_tokens,
            self.completion_tokens,
            self.latency_ms,
            self.status,
            datetime.fromtimestamp(self.at, UTC),
        )


async def _rows(batch: list[UsageRecord]) -> AsyncIterator[tuple[Any, ...]]:
    """The batch's rows, with a turn of the event loop every `YIELD_EVERY`."""
    for i, rec in enumerate(batch):
        if i and not i % YIELD_EVERY:
            await asyncio.sleep(0)
        yield rec.row()


class UsageBuffer(BatchWriter[UsageRecord]):
    """Usage rows waiting to be written; `start(pool)` begins the background flushes."""

    what = "usage"

    def __init__(
        self,
        *,
        max_rows: int = 100_000,
        flush_rows: int = 32,
        flush_interval_s: float = 1.0,
        recent: int = 1000,
    ) -> None:
        super().__init__(max_rows=max_rows, flush_rows=flush_rows, flush_interval_s=flush_interval_s)
        self.records: deque[UsageRecord] = deque(maxlen=recent)
        """The last few records (for introspection and the ops endpoints); not the write queue."""
        self._conn: Any = None
        """The pool connection flushes write through, kept between them (a connection back in the pool is
        reset with a query of its own: one more round trip per flush); handed back after an error."""

    # ---- the request side ---------------------------------------------------------------------------
    def add(self, row: UsageRecord) -> None:
        """Queue one record; never blocks (drops and counts when full)."""
        self.records.append(row)
        super().add(row)

    def record(
        self,
        organization_id: str,
        api_key_id: str,
        model: str,
        usage: dict[str, Any] | None,
        *,
        base_model: str = "",
        started: float | None = None,
        status: int = 200,
    ) -> UsageRecord:
        """Queue the usage of one completion (`usage` as the engine reported it, None for none)."""
        now = time.time()
        usage = usage or {}
        rec = UsageRecord(
            organization_id=organization_id,
            api_key_id=api_key_id,
            model=model,
            prompt_tokens=int(usage.get("prompt_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens") or 0),
            at=started if started is not None else now,
            base_model=base_model or model,
            latency_ms=int((now - started) * 1000) if started is not None else 0,
            status=status,
        )
        self.add(rec)
        return rec

    # ---- the writing side -----------------------------------------------------------------------------
    async def _write(self, pool: asyncpg.Pool, batch: list[UsageRecord]) -> None:
        if self._conn is None:
            self._conn = await pool.acquire()
        await self._conn.copy_records_to_table("completion_usage", records=_rows(batch), columns=COLUMNS)

    async def _failed(self) -> None:
        await self._release()  # in an unknown state: the pool resets it, or drops it if broken

    async def _closed(self) -> None:
        await self._release()

    async def _release(self) -> None:
        """Hand the flushes' connection back to the pool."""
        conn, self._conn = self._conn, None
        if conn is not None and self._pool is not None:
            with contextlib.suppress(Exception):
                await self._pool.release(conn)

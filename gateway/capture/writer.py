"""Captured calls written off the request path: `CaptureWriter`, a `gateway.batches.BatchWriter` of
`CapturedRow`s (one call, as migration 0018 holds it; one `executemany` per batch), as `gateway.usage.buffer`
is for usage. The same task deletes records past their retention now and then.
"""

from __future__ import annotations

import logging
import time

import asyncpg

from gateway.batches import BatchWriter
from gateway.capture import store
from gateway.capture.store import CapturedRow

logger = logging.getLogger(__name__)


PURGE_EVERY_S = 600.0
"""How often a gateway deletes records past their retention (reads never show them anyway)."""
PURGE_BATCH = 1000


class CaptureWriter(BatchWriter[CapturedRow]):
    """Records waiting to be written; `start(pool)` begins the background writes."""

    what = "captures"

    def __init__(
        self, *, max_rows: int = 10_000, flush_rows: int = 32, flush_interval_s: float = 1.0
    ) -> None:
        super().__init__(max_rows=max_rows, flush_rows=flush_rows, flush_interval_s=flush_interval_s)
        self._purged_at = 0.0

    async def _write(self, pool: asyncpg.Pool, batch: list[CapturedRow]) -> None:
        await store.insert_many(pool, batch)

    async def _after_flush(self) -> None:
        """Delete records past their retention, every `PURGE_EVERY_S`."""
        if time.monotonic() - self._purged_at >= PURGE_EVERY_S and self._pool is not None:
            self._purged_at = time.monotonic()
            await store.purge_expired(self._pool, most=PURGE_BATCH)

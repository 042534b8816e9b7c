"""Captured calls written off the request path: `CaptureWriter`, a `gateway.batches.BatchWriter` of
`CapturedRow`s (one call, as migrations 0018-0019 hold it; one `executemany` per batch), as
`gateway.usage.buffer` is for usage. The same task deletes records past their retention now and then.

A call of an episode is stored as a delta on the episode's turn it extends (`gateway.capture.sequences`):
the writer keeps the last `TURNS_KEPT` whole turns of up to `EPISODES_KEPT` recent episodes in memory, and
reads an episode's records back from the database (once) when it has none of its turns, such as after a
restart or when another gateway served its earlier calls. The episodes that calls name are made (or
touched: `last_call_at`) in the same transaction as the calls.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from datetime import timedelta

import asyncpg

from gateway.batches import BatchWriter
from gateway.capture import store
from gateway.capture.codec import answer_of
from gateway.capture.sequences import Turn, place, rebuild, turn_of
from gateway.capture.store import CapturedRow

logger = logging.getLogger(__name__)


PURGE_EVERY_S = 600.0
"""How often a gateway deletes records past their retention (reads never show them anyway)."""
PURGE_BATCH = 1000
TURNS_KEPT = 4
"""Whole turns kept per episode: a call extends the newest of them its prompt starts with."""
EPISODES_KEPT = 512
"""Episodes whose recent turns are kept in memory (the least recently written are let go)."""


class CaptureWriter(BatchWriter[CapturedRow]):
    """Records waiting to be written; `start(pool)` begins the background writes."""

    what = "captures"

    def __init__(
        self, *, max_rows: int = 10_000, flush_rows: int = 32, flush_interval_s: float = 1.0
    ) -> None:
        super().__init__(max_rows=max_rows, flush_rows=flush_rows, flush_interval_s=flush_interval_s)
        self._purged_at = 0.0
        self.turns: OrderedDict[tuple[str, str], list[Turn]] = OrderedDict()
        """Recent whole turns of recent episodes, by (organisation, episode id)."""
        self.answers: dict[tuple[str, str], dict[str, str | None]] = {}
        """The text each of those turns answered, by turn id (`codec.answer_of`)."""

    async def _write(self, pool: asyncpg.Pool, batch: list[CapturedRow]) -> None:
        touched: set[tuple[str, str]] = set()
        answers: dict[str, str | None] = {}
        try:
            async with pool.acquire() as conn:
                rows = [await self._placed(conn, row, touched, answers) for row in batch]
                episodes = {
                    (r.organization_id, r.episode_id): (
                        r.organization_id,
                        r.episode_id,
                        r.parent_episode_id,
                        r.created_at,
                        r.created_at + timedelta(milliseconds=r.latency_ms),
                        r.expires_at,
                    )
                    for r in rows
                    if r.episode_id is not None
                }
                async with conn.transaction():
                    await store.upsert_episodes(conn, sorted(episodes.values(), key=lambda e: e[4]))
                    await store.insert_many(conn, rows, answers)
        except BaseException:
            for key in touched:  # their turns may not have been written: read them back next time
                self.turns.pop(key, None)
                self.answers.pop(key, None)
            raise

    async def _placed(
        self,
        conn: asyncpg.Connection,
        row: CapturedRow,
        touched: set[tuple[str, str]],
        answers: dict[str, str | None],
    ) -> CapturedRow:
        """The record as stored: a delta on its episode's turn it extends (`sequences.link`); `answers` gets
        the text that turn answered (`store.insert_many`)."""
        if row.episode_id is None:
            return row
        key = (row.organization_id, row.episode_id)
        touched.add(key)
        turns = self.turns.pop(key, None)
        answered = self.answers.pop(key, None)
        if turns is None or answered is None:
            records = await store.episode_records(conn, org_id=key[0], episode_id=key[1])
            turns = list(rebuild(records).values())[-TURNS_KEPT:]
            answered = {r.id: answer_of(r.response) for r in records}
        kept = [*turns, turn_of(row)][-TURNS_KEPT:]
        answered[row.id] = answer_of(row.response)
        self.turns[key] = kept
        self.answers[key] = {t.id: answered.get(t.id) for t in kept}
        while len(self.turns) > EPISODES_KEPT:
            gone, _ = self.turns.popitem(last=False)
            self.answers.pop(gone, None)
        placed = place(turns, row)
        if placed.previous_id is not None:
            answers[row.id] = answered.get(placed.previous_id)
        return placed

    async def _after_flush(self) -> None:
        """Delete records past their retention, every `PURGE_EVERY_S`."""
        if time.monotonic() - self._purged_at >= PURGE_EVERY_S and self._pool is not None:
            self._purged_at = time.monotonic()
            await store.purge_expired(self._pool, most=PURGE_BATCH)

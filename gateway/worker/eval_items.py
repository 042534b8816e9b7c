"""The items of an eval run it still lacks, read from the run's file a few at a time as the run's lanes take
them (`PendingItems`): a worker never holds a file whole, whatever its size. A run over stored completions
reads them by id, a few at a time, likewise (`StoredItems`)."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections import deque
from collections.abc import Collection, Iterator

from gateway.errors import InvalidRequest
from gateway.evals import stored
from gateway.evals.datasource import Row, iter_rows_of_file, rows_of_content
from gateway.evals.rows import RunRow
from gateway.evals.stored_source import STORED_IDS
from gateway.files import store as files_store
from gateway.worker.context import JobContext

ITEMS_IN_FLIGHT = 4
"""Items of one run sampled and graded at once (the engines batch concurrent requests)."""
ITEMS_READ_AHEAD = 2 * ITEMS_IN_FLIGHT
"""Items read from a run's file in one step (in a thread): with those in flight, all of the file a worker
holds at once. Each item costs a completion and a database write: next to them, a small step costs nothing."""


class PendingItems:
    """The items of a run it still lacks, `(index, row)` in the data source's order, read from the run's file
    `ITEMS_READ_AHEAD` at a time as the run's lanes take them (a file is never held whole).

    The run's create checked every item with the same code (`gateway.evals.datasource`), so a file fails
    here only if it changed since, or the limits did: the items before the line that fails are taken, then
    none, and `error` says why (the run then fails with it, as a file that fails at its first line fails the
    run before any item)."""

    def __init__(self, rows: Iterator[Row], *, threaded: bool, done: Collection[int] = ()) -> None:
        self._rows = rows
        self._threaded = threaded
        """Whether a step reads a file (in a thread, off the event loop) or a list in memory."""
        self._done = done
        self._ahead: deque[tuple[int, Row]] = deque()
        self._read = 0
        """Rows read so far: the index of the next one."""
        self._ended = False
        self._lock = asyncio.Lock()  # the lanes take from one reader, each item once
        self.error: dict[str, str] | None = None
        """`{"code", "message"}` of the line that broke the rules; None while the file reads well."""

    @classmethod
    async def open(cls, ctx: JobContext[RunRow], *, done: Collection[int] = ()) -> PendingItems:
        """The run's pending items, with a first step read (a file that cannot be opened fails here, not in
        a lane); `InvalidRequest` when the run's file was deleted. `done`: the indexes the run recorded."""
        source = ctx.row.data_source["source"]
        if source["type"] == "stored_completions":  # the ids its create selected, read by id a few at a time
            items: PendingItems = StoredItems(ctx, ctx.row.data_source[STORED_IDS], done=done)
        elif source["type"] == "file_content":  # in the run's row already, checked at create
            items = cls(iter(rows_of_content(source["content"])), threaded=False, done=done)
        else:
            file = await files_store.get(ctx.pool, org_id=ctx.org_id, file_id=source["id"])
            if file is None:
                raise InvalidRequest(
                    f"File '{source['id']}' was deleted before the run read it.", code="invalid_file"
                )
            rows = iter_rows_of_file(
                ctx.blobs.path(file.blob_key),
                max_line_bytes=ctx.settings.max_jsonl_line_bytes,
                max_depth=ctx.settings.max_json_depth,  # the rules the create checked the file with
            )
            items = cls(rows, threaded=True, done=done)
        try:
            await items._step()
        except BaseException:
            items.close()
            raise
        return items

    async def take(self) -> tuple[int, Row] | None:
        """The next pending item, or None when there is none left (or the file failed: see `error`)."""
        async with self._lock:
            while True:
                while self._ahead:
                    index, row = self._ahead.popleft()
                    if index not in self._done:
                        return index, row
                if self._ended:
                    return None
                await self._step()

    async def _step(self) -> None:
        if self._threaded:
            batch, error = await asyncio.to_thread(_next_rows, self._rows, ITEMS_READ_AHEAD)
        else:
            batch, error = _next_rows(self._rows, ITEMS_READ_AHEAD)
        for row in batch:
            self._ahead.append((self._read, row))
            self._read += 1
        if error is not None:
            self.error = {"code": error.code or "invalid_data_source", "message": error.message}
        if error is not None or len(batch) < ITEMS_READ_AHEAD:
            self._ended = True
            self.close()

    def close(self) -> None:
        """Close the file (a reader left unfinished holds it open)."""
        close = getattr(self._rows, "close", None)
        if close is not None:
            # A step still running in its thread (the run was cancelled mid-read) cannot be closed: the file
            # then closes when that step ends and the reader is collected.
            with contextlib.suppress(ValueError):
                close()


class StoredItems(PendingItems):
    """The pending items of a run over stored completions: its ids read `ITEMS_READ_AHEAD` at a time from
    the run's organisation's stored completions (`gateway.evals.stored.rows_by_ids`)."""

    def __init__(self, ctx: JobContext[RunRow], ids: list[str], *, done: Collection[int] = ()) -> None:
        super().__init__(iter(()), threaded=False, done=done)
        self._ctx = ctx
        self._ids = ids

    async def _step(self) -> None:
        indexes = [
            i
            for i in range(self._read, min(self._read + ITEMS_READ_AHEAD, len(self._ids)))
            if i not in self._done
        ]
        rows = await stored.rows_by_ids(
            self._ctx.pool, org_id=self._ctx.org_id, ids=[self._ids[i] for i in indexes]
        )
        self._ahead.extend(zip(indexes, rows, strict=True))
        self._read = min(self._read + ITEMS_READ_AHEAD, len(self._ids))
        if self._read >= len(self._ids):
            self._ended = True


def _next_rows(rows: Iterator[Row], count: int) -> tuple[list[Row], InvalidRequest | None]:
    """Up to `count` rows, and the refusal of the line that stopped them short, if one did."""
    batch: list[Row] = []
    try:
        for row in itertools.islice(rows, count):
            batch.append(row)
    except InvalidRequest as exc:
        return batch, exc
    return batch, None

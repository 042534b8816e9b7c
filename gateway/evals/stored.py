"""The Evals API's `stored_completions` source: the calling organisation's stored completions (capture's
`captured_completions`, migration 0018) as an eval run's items.

A run create selects the completions once (`select_ids`: the eval's and the run's metadata, the model, the
creation window, the newest `limit`, oldest first) and the run keeps their ids, so the run grades the same
completions however their metadata changes later, and a run taken back by another worker resumes on the same
items. The worker reads them a few at a time by id (`rows_by_ids`), always within the run's organisation:
another organisation's completions are never read, whatever the ids. A completion deleted (or past its
retention) after the create is an errored item.

Each completion is one item (`item_of`): `{"id", "model", "created", "metadata", "input"}`, `input` being
the request's messages; its sample is the stored answer (`sample_of`), which the run grades as it is unless
the run names a `model` to sample anew (with `input_messages`, e.g. `{"type": "item_reference",
"item_reference": "item.input"}`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gateway.capture import store as capture_store
from gateway.capture.sequences import messages_of, rebuild
from gateway.capture.store import CapturedRow
from gateway.db import Conn
from gateway.evals.datasource import Row
from gateway.evals.samples import sample_of
from gateway.evals.stored_source import STORED_ITEM_SCHEMA

READ_CHUNK = 200
"""Stored completions read at once when a run create checks its items."""

LIVE = "(expires_at IS NULL OR expires_at > now())"
# Answered calls only (a captured call the engine refused has no answer to grade). The newest `$7` when a
# limit is given, returned oldest first.
SELECT_IDS = f"""
SELECT id FROM (
    SELECT id, created_at, seq FROM captured_completions
    WHERE organization_id = $1 AND {LIVE} AND status = 200
      AND metadata @> $2::jsonb AND metadata @> $3::jsonb
      AND ($4::text IS NULL OR model = $4)
      AND ($5::timestamptz IS NULL OR created_at >= $5)
      AND ($6::timestamptz IS NULL OR created_at < $6)
    ORDER BY created_at DESC, seq DESC
    LIMIT $7
) newest
ORDER BY created_at, seq"""

ITEM_KEYS = frozenset(STORED_ITEM_SCHEMA["properties"])
"""What every item of a stored completion holds."""


def _time(seconds: int | None) -> datetime | None:
    return None if seconds is None else datetime.fromtimestamp(seconds, UTC)


async def select_ids(
    conn: Conn,
    *,
    org_id: str,
    eval_metadata: dict[str, str],
    run_metadata: dict[str, str],
    model: str | None,
    created_after: int | None,
    created_before: int | None,
    limit: int,
) -> list[str]:
    """The ids of the organisation's stored completions whose metadata holds every pair of the eval's and of
    the run's, of `model`, created at or after `created_after` and before `created_before` (Unix seconds):
    the newest `limit`, oldest first."""
    records = await conn.fetch(
        SELECT_IDS,
        org_id,
        eval_metadata,
        run_metadata,
        model,
        _time(created_after),
        _time(created_before),
        limit,
    )
    return [r["id"] for r in records]


async def rows_by_ids(conn: Conn, *, org_id: str, ids: list[str]) -> list[Row]:
    """The items of stored completions `ids` (of the organisation `org_id` only), in the order of `ids`; a
    completion that is gone is an item with its id alone and a sample that says so. A call of an episode
    stored as a delta on an earlier turn (`gateway.capture.sequences`) has its whole messages as `input`."""
    found = {r.id: r for r in await capture_store.by_ids(conn, org_id=org_id, ids=ids)}
    whole: dict[str, list[Any]] = {}
    for episode in sorted({r.episode_id for r in found.values() if r.episode_id and r.messages_prefix}):
        turns = rebuild(await capture_store.episode_records(conn, org_id=org_id, episode_id=episode))
        whole |= {i: turns[i].messages for i in found if i in turns and found[i].messages_prefix}
    return [_row(found[i], whole.get(i)) if i in found else _gone(i) for i in ids]


def item_of(row: CapturedRow, messages: list[Any] | None = None) -> dict[str, Any]:
    """The item of a stored completion (`messages`: its whole messages, where the record keeps a delta)."""
    response = row.response
    created = response.get("created")
    return {
        "id": row.id,
        "model": row.model,
        "created": created if isinstance(created, int) else int(row.created_at.timestamp()),
        "metadata": row.metadata,
        "input": [m for m in messages_of(row.request) if isinstance(m, dict)]
        if messages is None
        else messages,
    }


def _row(row: CapturedRow, messages: list[Any] | None) -> Row:
    item = item_of(row, messages)
    request = row.request
    sampling = {
        "temperature": request.get("temperature"),
        "top_p": request.get("top_p"),
        "max_completion_tokens": request.get("max_completion_tokens", request.get("max_tokens")),
        "seed": request.get("seed"),
    }
    sampling = {k: v for k, v in sampling.items() if v is not None}
    record, namespace = sample_of(item["input"], sampling, row.response, None, model=row.model)
    return Row(item, namespace, record)


def _gone(completion_id: str) -> Row:
    error = {
        "code": "stored_completion_not_found",
        "message": f"The stored completion '{completion_id}' was deleted (or expired) after the run began.",
    }
    record, namespace = sample_of([], {}, None, error, model="")
    return Row({"id": completion_id}, namespace, record)

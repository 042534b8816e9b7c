"""SQL of capture: the settings of organisations and keys, and the captured completions."""

from __future__ import annotations

from dataclasses import dataclass, fields
from datetime import datetime
from typing import Any

import orjson

from gateway.db import Conn, maybe_row_to, row_to, rows_to


@dataclass(frozen=True, slots=True)
class SettingRow:
    organization_id: str
    api_key_id: str
    """'' for the organisation's own setting."""
    enabled: bool
    retention_days: int | None
    updated_at: datetime


@dataclass(frozen=True, slots=True)
class CapturedRow:
    """One captured call (migration 0018), as written and as read."""

    organization_id: str
    id: str
    api_key_id: str
    episode_id: str | None
    parent_episode_id: str | None
    stored: bool
    streamed: bool
    model: str
    base_model: str
    served_version: str
    request: dict[str, Any]
    response: dict[str, Any]
    metadata: dict[str, str]
    prompt_token_ids: list[int] | None
    completion_token_ids: list[list[int]] | None
    logprobs: list[list[float]] | None
    finish_reason: str | None
    prompt_tokens: int
    completion_tokens: int
    latency_ms: int
    status: int
    created_at: datetime
    expires_at: datetime | None
    previous_id: str | None = None
    """The episode's turn this call's prompt extends (`gateway.capture.sequences`)."""
    prompt_prefix_tokens: int = 0
    """How many of the prompt's ids are that turn's sequence (`prompt_token_ids` holds the rest)."""
    messages_prefix: int = 0
    """How many of the request's messages are that turn's (`request["messages"]` holds the rest)."""
    segment_break: dict[str, Any] | None = None
    """Why the prompt extends no earlier turn of the episode, where it does not."""
    stored_bytes: int = 0
    """The bytes the record stores (its JSON fields, as written)."""
    cost_usd: float | None = None
    """What the call cost the organisation (its tokens at the price table's prices)."""


CAPTURED_FIELDS = tuple(f.name for f in fields(CapturedRow))


SET = """
INSERT INTO capture_settings (organization_id, api_key_id, enabled, retention_days)
VALUES ($1, $2, $3, $4)
ON CONFLICT (organization_id, api_key_id)
DO UPDATE SET enabled = EXCLUDED.enabled, retention_days = EXCLUDED.retention_days, updated_at = now()
RETURNING *
"""
GET = "SELECT * FROM capture_settings WHERE organization_id = $1 AND api_key_id = $2"
ALL_SETTINGS = "SELECT * FROM capture_settings"
ORG_OF_KEY = "SELECT organization_id FROM api_keys WHERE id = $1"

INSERT = """
INSERT INTO captured_completions (
    organization_id, id, api_key_id, episode_id, parent_episode_id, stored, streamed, model, base_model,
    served_version, request, response, metadata, prompt_token_ids, completion_token_ids, logprobs,
    finish_reason, prompt_tokens, completion_tokens, latency_ms, status, created_at, expires_at, previous_id,
    prompt_prefix_tokens, messages_prefix, segment_break, stored_bytes, cost_usd
) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11::text::jsonb, $12::text::jsonb,
          $13::text::jsonb, $14::text::jsonb, $15::text::jsonb, $16::text::jsonb, $17, $18, $19, $20, $21,
          $22, $23, $24, $25, $26, $27::text::jsonb, $28, $29)
ON CONFLICT (organization_id, id) DO NOTHING
"""
"""A repeated id (an engine told to reuse one) keeps the first record: a batch never fails on it. The JSON
columns come encoded (`encoded`): each is serialised once, which also gives the record's `stored_bytes`."""
JSON_FIELDS = frozenset(
    (
        "request",
        "response",
        "metadata",
        "prompt_token_ids",
        "completion_token_ids",
        "logprobs",
        "segment_break",
    )
)

# An episode named by a captured call: made by its first call, its last call's end kept.
UPSERT_EPISODE = """
INSERT INTO episodes (organization_id, id, parent_episode_id, created_at, last_call_at, expires_at)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (organization_id, id)
DO UPDATE SET last_call_at = greatest(episodes.last_call_at, EXCLUDED.last_call_at)
"""
EPISODE_CLOSED = """
SELECT closed_at IS NOT NULL OR (on_idle = 'close'
       AND coalesce(last_call_at, created_at) + make_interval(secs => idle_timeout_s) < now())
FROM episodes WHERE organization_id = $1 AND id = $2
"""

LIVE = "(expires_at IS NULL OR expires_at > now())"
GET_ONE = f"SELECT * FROM captured_completions WHERE organization_id = $1 AND id = $2 AND {LIVE}"
LIST = f"""
SELECT * FROM captured_completions c
WHERE organization_id = $1 AND {LIVE}
  AND ($2::text IS NULL OR model = $2)
  AND ($3::jsonb IS NULL OR metadata @> $3::jsonb)
  AND ($4::text IS NULL OR (created_at, seq) {{op}} (
        SELECT created_at, seq FROM captured_completions WHERE organization_id = $1 AND id = $4))
ORDER BY created_at {{dir}}, seq {{dir}}
LIMIT $5
"""
EPISODE_RECORDS = f"""
SELECT * FROM captured_completions
WHERE organization_id = $1 AND episode_id = $2 AND {LIVE}
ORDER BY seq
"""
STORE_WHOLE = """
UPDATE captured_completions
SET prompt_token_ids = $3, request = $4, previous_id = NULL, prompt_prefix_tokens = 0, messages_prefix = 0
WHERE organization_id = $1 AND id = $2
"""
LIST_ASC = LIST.format(op=">", dir="ASC")
LIST_DESC = LIST.format(op="<", dir="DESC")
UPDATE_METADATA = f"""
UPDATE captured_completions SET metadata = $3
WHERE organization_id = $1 AND id = $2 AND {LIVE}
RETURNING *
"""
DELETE = f"DELETE FROM captured_completions WHERE organization_id = $1 AND id = $2 AND {LIVE} RETURNING id"
PURGE = """
DELETE FROM captured_completions WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM captured_completions WHERE expires_at <= now() LIMIT $1))
"""

# Episodes past their retention go with their rewards; thumbs on a completion outside any episode go with it.
PURGE_EPISODES = """
WITH gone AS (
    DELETE FROM episodes WHERE ctid = ANY(ARRAY(SELECT ctid FROM episodes WHERE expires_at <= now() LIMIT $1))
    RETURNING organization_id, id)
DELETE FROM episode_rewards r USING gone
WHERE r.organization_id = gone.organization_id AND r.episode_id = gone.id
"""
PURGE_LOOSE_REWARDS = """
DELETE FROM episode_rewards WHERE ctid = ANY(ARRAY(
    SELECT r.ctid FROM episode_rewards r
    WHERE r.episode_id IS NULL AND NOT EXISTS (
        SELECT 1 FROM captured_completions c
        WHERE c.organization_id = r.organization_id AND c.id = r.completion_id)
    LIMIT $1))
"""


async def set_setting(
    conn: Conn, *, org_id: str, key_id: str, enabled: bool, retention_days: int | None
) -> SettingRow:
    return row_to(SettingRow, await conn.fetchrow(SET, org_id, key_id, enabled, retention_days))


async def get_setting(conn: Conn, *, org_id: str, key_id: str) -> SettingRow | None:
    return maybe_row_to(SettingRow, await conn.fetchrow(GET, org_id, key_id))


async def all_settings(conn: Conn) -> list[SettingRow]:
    return rows_to(SettingRow, await conn.fetch(ALL_SETTINGS))


async def org_of_key(conn: Conn, *, key_id: str) -> str | None:
    value = await conn.fetchval(ORG_OF_KEY, key_id)
    return str(value) if value is not None else None


def encoded(row: CapturedRow) -> tuple[Any, ...]:
    """A record's `INSERT` arguments (`CapturedRow`'s fields in their order), its JSON fields serialised, and
    its `stored_bytes` their size."""
    values = []
    size = 0
    for name in CAPTURED_FIELDS:
        value = getattr(row, name)
        if name in JSON_FIELDS and value is not None:
            text = orjson.dumps(value)
            size += len(text)
            value = text.decode()
        values.append(value)
    values[CAPTURED_FIELDS.index("stored_bytes")] = size
    return tuple(values)


def stored_bytes(row: CapturedRow) -> int:
    """The bytes a record stores: its JSON fields, as written."""
    return int(encoded(row)[CAPTURED_FIELDS.index("stored_bytes")])


async def insert_many(conn: Conn, rows: list[CapturedRow]) -> None:
    """Write captured calls."""
    await conn.executemany(INSERT, [encoded(r) for r in rows])


async def upsert_episodes(conn: Conn, episodes: list[tuple[Any, ...]]) -> None:
    """Make (or touch) the episodes that captured calls name: `(org_id, id, parent_id, created_at,
    last_call_at, expires_at)` each."""
    await conn.executemany(UPSERT_EPISODE, episodes)


async def episode_closed(conn: Conn, *, org_id: str, episode_id: str) -> bool:
    """Whether the episode is closed (an unknown one is not)."""
    return bool(await conn.fetchval(EPISODE_CLOSED, org_id, episode_id))


async def episode_records(conn: Conn, *, org_id: str, episode_id: str) -> list[CapturedRow]:
    """Every live record of an episode, oldest first."""
    return rows_to(CapturedRow, await conn.fetch(EPISODE_RECORDS, org_id, episode_id))


async def store_whole(
    conn: Conn, *, org_id: str, completion_id: str, prompt: list[int] | None, request: dict[str, Any]
) -> None:
    """Store a record whole (its prompt ids and messages no longer a delta on an earlier turn)."""
    await conn.execute(STORE_WHOLE, org_id, completion_id, prompt, request)


async def get(conn: Conn, *, org_id: str, completion_id: str) -> CapturedRow | None:
    return maybe_row_to(CapturedRow, await conn.fetchrow(GET_ONE, org_id, completion_id))


async def list_page(
    conn: Conn,
    *,
    org_id: str,
    model: str | None,
    metadata: dict[str, str] | None,
    after: str | None,
    limit: int,
    descending: bool,
) -> list[CapturedRow]:
    sql = LIST_DESC if descending else LIST_ASC
    return rows_to(CapturedRow, await conn.fetch(sql, org_id, model, metadata, after, limit))


async def update_metadata(
    conn: Conn, *, org_id: str, completion_id: str, metadata: dict[str, str]
) -> CapturedRow | None:
    return maybe_row_to(CapturedRow, await conn.fetchrow(UPDATE_METADATA, org_id, completion_id, metadata))


async def delete(conn: Conn, *, org_id: str, completion_id: str) -> bool:
    return await conn.fetchval(DELETE, org_id, completion_id) is not None


async def purge_expired(conn: Conn, *, most: int) -> int:
    """Delete up to `most` records past their retention, and up to `most` episodes with their rewards (and
    the thumbs of completions outside episodes that are gone); how many records."""
    status = await conn.execute(PURGE, most)
    await conn.execute(PURGE_EPISODES, most)
    await conn.execute(PURGE_LOOSE_REWARDS, most)
    return int(status.split()[-1])

"""SQL of capture: the settings of organisations and keys, and the captured completions."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, fields
from datetime import UTC, datetime
from typing import Any

import asyncpg
import orjson

from gateway.capture import codec
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
    text_completion: bool = False
    """A text completion (`POST /v1/completions`), which the stored chat completions API does not show."""


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

STORED_COLUMNS = (
    *(f.name for f in fields(CapturedRow)),
    "form",
    "derived",
    "prompt_ids",
    "completion_ids",
    "logprob_values",
)
"""The columns a record is written to (`encoded` gives their values in this order)."""
INSERT = f"""
INSERT INTO captured_completions ({", ".join(STORED_COLUMNS)})
VALUES ({
    ", ".join(
        f"${i}::text::jsonb" if c in codec.JSON_COLUMNS else f"${i}" for i, c in enumerate(STORED_COLUMNS, 1)
    )
})
ON CONFLICT (organization_id, id) DO NOTHING
"""
"""A repeated id (an engine told to reuse one) keeps the first record: a batch never fails on it. The values
come encoded (`encoded`, `gateway.capture.codec`): each field is serialised once, which also gives the
record's `stored_bytes`."""

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

# What other stores read of a record in SQL, in either form (`gateway.capture.codec`).
RESPONSE_CREATED = f"""CASE WHEN form = 1 AND (derived & 4) <> 0
    THEN to_jsonb(floor(extract(epoch FROM created_at))::bigint
                  + ((derived >> {codec.CREATED_SHIFT}) & 15) + ({codec.CREATED_OFFSETS.start}))
    ELSE response -> 'created' END"""
RESPONSE_USAGE = """CASE WHEN form = 1 AND (derived & 32) <> 0
    THEN jsonb_build_object('prompt_tokens', prompt_tokens, 'completion_tokens', completion_tokens,
                            'total_tokens', prompt_tokens + completion_tokens)
    ELSE response -> 'usage' END"""
_BREAK = f"""CASE WHEN (derived & {codec.BREAK_LIST}) <> 0
    THEN jsonb_strip_nulls(jsonb_build_object({
    ", ".join(f"'{k}', segment_break -> {i}" for i, k in enumerate(codec.BREAK_KEYS))
}))
    ELSE segment_break END"""
SEGMENT_BREAK = f"""CASE WHEN (derived & {codec.BREAK_EXTENDS}) <> 0
         THEN ({_BREAK}) || jsonb_build_object('extends', previous_id)
    WHEN (derived & {codec.BREAK_PREVIOUS}) <> 0
         THEN ({_BREAK}) || jsonb_build_object('previous_id', previous_id)
    ELSE {_BREAK} END"""
FIRST_COMPLETION_LENGTH = """CASE
    WHEN completion_ids IS NULL OR length(completion_ids) < 2 THEN NULL
    WHEN get_byte(completion_ids, 1) < 128 THEN get_byte(completion_ids, 1)
    WHEN get_byte(completion_ids, 2) < 128
         THEN (get_byte(completion_ids, 1) & 127) + get_byte(completion_ids, 2) * 128
    ELSE (get_byte(completion_ids, 1) & 127) + (get_byte(completion_ids, 2) & 127) * 128
         + get_byte(completion_ids, 3) * 16384 END"""
"""The length of choice 0's ids in `completion_ids` (`gateway.capture.codec`: a varint after the width byte;
up to 2**21)."""

READ = """
SELECT c.*, b.settings AS request_base, p.response AS previous_response
FROM captured_completions c
LEFT JOIN capture_request_bases b ON b.organization_id = c.organization_id AND b.episode_id = c.episode_id
LEFT JOIN captured_completions p ON p.organization_id = c.organization_id AND p.id = c.previous_id
"""
"""Records as `row_of` reads them: with their episode's base settings and the answer of the turn each
extends (`gateway.capture.codec`)."""
LIVE_C = "(c.expires_at IS NULL OR c.expires_at > now())"
GET_ONE = f"{READ} WHERE c.organization_id = $1 AND c.id = $2 AND {LIVE_C} AND NOT c.text_completion"
BY_IDS = f"{READ} WHERE c.organization_id = $1 AND c.id = ANY($2::text[]) AND {LIVE_C}"
LIST = f"""
{READ}
WHERE c.organization_id = $1 AND {LIVE_C} AND NOT c.text_completion
  AND ($2::text IS NULL OR c.model = $2)
  AND ($3::jsonb IS NULL OR c.metadata @> $3::jsonb)
  AND ($4::text IS NULL OR (c.created_at, c.seq) {{op}} (
        SELECT created_at, seq FROM captured_completions WHERE organization_id = $1 AND id = $4))
ORDER BY c.created_at {{dir}}, c.seq {{dir}}
LIMIT $5
"""
EPISODE_RECORDS = f"""
{READ}
WHERE c.organization_id = $1 AND c.episode_id = $2 AND {LIVE_C}
ORDER BY c.seq
"""
FOR_REWRITE = f"{READ} WHERE c.organization_id = $1 AND c.id = $2 FOR UPDATE OF c"
_REWRITTEN = STORED_COLUMNS[2:]
"""Every column but the key (`organization_id`, `id`) is written again."""
REWRITE = f"""
UPDATE captured_completions
SET ({", ".join(_REWRITTEN)}) = ROW({
    ", ".join(
        f"${i}::text::jsonb" if c in codec.JSON_COLUMNS else f"${i}" for i, c in enumerate(_REWRITTEN, 3)
    )
})
WHERE organization_id = $1 AND id = $2
"""
UPSERT_BASES = """
INSERT INTO capture_request_bases AS b (organization_id, episode_id, settings, expires_at)
SELECT o, e, s::jsonb, x FROM unnest($1::text[], $2::text[], $3::text[], $4::timestamptz[]) AS t(o, e, s, x)
ON CONFLICT (organization_id, episode_id) DO UPDATE
SET expires_at = CASE WHEN b.expires_at IS NULL OR EXCLUDED.expires_at IS NULL THEN NULL
                      ELSE greatest(b.expires_at, EXCLUDED.expires_at) END
RETURNING organization_id, episode_id, settings, xmax = 0 AS made
"""
"""Episodes' base settings (one statement a batch): made by each one's first call written (whichever gateway
wrote it), kept as long as the episode's longest-kept record."""
ANSWER_DEPENDENTS = f"""
SELECT c.organization_id, c.id FROM captured_completions c
JOIN captured_completions p ON p.organization_id = c.organization_id AND p.id = c.previous_id
WHERE (c.derived & {codec.ANSWER_FIRST}) <> 0 AND p.expires_at <= now() AND {LIVE_C}
LIMIT $1
"""
"""Live records whose first message is the answer of a turn past its retention (kept whole before it goes)."""
PURGE_BASES = """
DELETE FROM capture_request_bases WHERE ctid = ANY(ARRAY(
    SELECT ctid FROM capture_request_bases WHERE expires_at <= now() LIMIT $1))
"""
LIST_ASC = LIST.format(op=">", dir="ASC")
LIST_DESC = LIST.format(op="<", dir="DESC")
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


def encoded(
    row: CapturedRow, *, base: dict[str, Any] | None = None, previous_answer: str | None = None
) -> tuple[Any, ...]:
    """A record's `INSERT` arguments (`STORED_COLUMNS`' values in `gateway.capture.codec`'s form 1, against
    its episode's `base` settings and the `previous_answer` of the turn it extends), `stored_bytes` what
    they store."""
    values, size = codec.encode(row, base=base, previous_answer=previous_answer)
    return tuple(
        size if name == "stored_bytes" else values[name] if name in values else getattr(row, name)
        for name in STORED_COLUMNS
    )


def stored_bytes(
    row: CapturedRow, *, base: dict[str, Any] | None = None, previous_answer: str | None = None
) -> int:
    """The bytes a record stores (`gateway.capture.codec`)."""
    return codec.encode(row, base=base, previous_answer=previous_answer)[1]


def row_of(record: Mapping[str, Any]) -> CapturedRow:
    """A record as the `CapturedRow` it stores, in either form (`gateway.capture.codec.decode`; `READ`)."""
    return row_to(CapturedRow, codec.decode(record))


def maybe_row_of(record: Mapping[str, Any] | None) -> CapturedRow | None:
    return None if record is None else row_of(record)


def rows_of(records: Iterable[Mapping[str, Any]]) -> list[CapturedRow]:
    return [row_of(r) for r in records]


async def insert_many(
    conn: asyncpg.Connection, rows: list[CapturedRow], answers: Mapping[str, str | None] | None = None
) -> None:
    """Write captured calls (in the caller's transaction), one organisation after another (each insert
    locks its organisation's `capture_storage` row until the transaction ends: in one order, two writers
    never deadlock). `answers`: by record id, the text answered by the turn it extends (`previous_id`). The
    episodes' base settings are made by the first call written of each (its bytes counted in that call's)."""
    ordered = sorted(rows, key=lambda r: r.organization_id)  # stable: an episode's calls keep their order
    firsts: dict[tuple[str, str], CapturedRow] = {}
    expiry: dict[tuple[str, str], datetime | None] = {}
    for r in ordered:
        if r.episode_id is not None:
            key = (r.organization_id, r.episode_id)
            firsts.setdefault(key, r)
            old = expiry.get(key, r.expires_at)
            expiry[key] = None if old is None or r.expires_at is None else max(old, r.expires_at)
    bases: dict[tuple[str, str], dict[str, Any]] = {}
    made: set[str] = set()
    if firsts:
        keys = sorted(firsts)  # one order: two writers never deadlock on the same episodes
        records = await conn.fetch(
            UPSERT_BASES,
            [k[0] for k in keys],
            [k[1] for k in keys],
            [orjson.dumps(codec.settings_of(firsts[k].request)).decode() for k in keys],
            [expiry[k] for k in keys],
        )
        for record in records:
            key = (record["organization_id"], record["episode_id"])
            bases[key] = record["settings"]
            if record["made"]:
                made.add(firsts[key].id)
    args = []
    size_at = STORED_COLUMNS.index("stored_bytes")
    for r in ordered:
        base = bases.get((r.organization_id, r.episode_id)) if r.episode_id is not None else None
        values = encoded(r, base=base, previous_answer=(answers or {}).get(r.id))
        if r.id in made and base is not None:
            values = (*values[:size_at], values[size_at] + len(orjson.dumps(base)), *values[size_at + 1 :])
        args.append(values)
    await conn.executemany(INSERT, args)


async def upsert_episodes(conn: Conn, episodes: list[tuple[Any, ...]]) -> None:
    """Make (or touch) the episodes that captured calls name: `(org_id, id, parent_id, created_at,
    last_call_at, expires_at)` each."""
    await conn.executemany(UPSERT_EPISODE, episodes)


async def episode_closed(conn: Conn, *, org_id: str, episode_id: str) -> bool:
    """Whether the episode is closed (an unknown one is not)."""
    return bool(await conn.fetchval(EPISODE_CLOSED, org_id, episode_id))


async def episode_records(conn: Conn, *, org_id: str, episode_id: str) -> list[CapturedRow]:
    """Every live record of an episode, oldest first."""
    return rows_of(await conn.fetch(EPISODE_RECORDS, org_id, episode_id))


async def by_ids(conn: Conn, *, org_id: str, ids: list[str]) -> list[CapturedRow]:
    """The live records of these ids (any order)."""
    return rows_of(await conn.fetch(BY_IDS, org_id, ids))


async def store_whole(
    conn: Conn, *, org_id: str, completion_id: str, prompt: list[int] | None, request: dict[str, Any]
) -> None:
    """Store a record whole (its prompt ids and messages no longer a delta on an earlier turn)."""
    await _rewrite(
        conn,
        org_id,
        completion_id,
        lambda row: dataclasses.replace(
            row,
            prompt_token_ids=prompt,
            request=request,
            previous_id=None,
            prompt_prefix_tokens=0,
            messages_prefix=0,
        ),
    )


async def _rewrite(
    conn: Conn,
    org_id: str,
    completion_id: str,
    change: Callable[[CapturedRow], CapturedRow | None],
    *,
    keep_answer: bool = True,
) -> CapturedRow | None:
    """Write a record again as `change` makes it (nothing when it answers None, or there is no record), its
    `stored_bytes` with it; the record as it is now. `keep_answer=False`: its messages keep the answer of the
    turn it extends (that turn is going)."""
    if isinstance(conn, asyncpg.Pool):
        async with conn.acquire() as one:
            return await _rewrite(one, org_id, completion_id, change, keep_answer=keep_answer)
    async with conn.transaction():
        record = await conn.fetchrow(FOR_REWRITE, org_id, completion_id)
        row = maybe_row_of(record)
        new = change(row) if row is not None else None
        if record is None or row is None or new is None:
            return None
        previous = record["previous_response"]
        answer = (
            codec.answer_of(previous)
            if keep_answer and previous is not None and new.previous_id == row.previous_id
            else None
        )
        base = record["request_base"] if new.episode_id is not None else None
        values = encoded(new, base=base, previous_answer=answer)
        await conn.execute(REWRITE, org_id, completion_id, *values[2:])
        return dataclasses.replace(new, stored_bytes=values[STORED_COLUMNS.index("stored_bytes")])


async def get(conn: Conn, *, org_id: str, completion_id: str) -> CapturedRow | None:
    return maybe_row_of(await conn.fetchrow(GET_ONE, org_id, completion_id))


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
    return rows_of(await conn.fetch(sql, org_id, model, metadata, after, limit))


async def update_metadata(
    conn: Conn, *, org_id: str, completion_id: str, metadata: dict[str, str]
) -> CapturedRow | None:
    now = datetime.now(UTC)

    def change(row: CapturedRow) -> CapturedRow | None:
        live = row.expires_at is None or row.expires_at > now
        return dataclasses.replace(row, metadata=metadata) if live and not row.text_completion else None

    return await _rewrite(conn, org_id, completion_id, change)


async def delete(conn: Conn, *, org_id: str, completion_id: str) -> bool:
    return await conn.fetchval(DELETE, org_id, completion_id) is not None


async def purge_expired(conn: Conn, *, most: int) -> int:
    """Delete up to `most` records past their retention (the later turns that begin with one's answer keep
    it first), episodes' base settings no record needs any more, and up to `most` episodes with their
    rewards (and the thumbs of completions outside episodes that are gone); how many records."""
    for record in await conn.fetch(ANSWER_DEPENDENTS, most):
        await _rewrite(conn, record["organization_id"], record["id"], lambda row: row, keep_answer=False)
    status = await conn.execute(PURGE, most)
    await conn.execute(PURGE_BASES, most)
    await conn.execute(PURGE_EPISODES, most)
    await conn.execute(PURGE_LOOSE_REWARDS, most)
    return int(status.split()[-1])

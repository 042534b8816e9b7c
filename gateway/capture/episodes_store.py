"""SQL of episodes (migration 0019): the episodes of an organisation with their state, their calls, and
their append-only rewards.

An episode's state is never stored but read, here, in SQL (`EPISODE`): `closed` once `closed_at` is set;
else, once no call came for `idle_timeout_s` (since its last call, or since it was made), `abandoned`, or
`closed` where `on_idle` says so (its `closed_at` is then the moment it went idle); else `open`. Every read
leaves out what is past its retention (`expires_at`).
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.capture import store as capture_store
from gateway.db import Conn, maybe_row_to, row_to, rows_to


@dataclass(frozen=True, slots=True)
class EpisodeRow:
    """One episode, its state and the number of its calls read with it."""

    organization_id: str
    id: str
    api_key_id: str | None
    """The episode key minted for it; None for an episode named by a call's header."""
    parent_episode_id: str | None
    metadata: dict[str, str]
    idle_timeout_s: int
    on_idle: str
    created_at: datetime
    last_call_at: datetime | None
    closed_at: datetime | None
    """When it was closed, by `POST .../close` or by going idle where `on_idle` is `close`."""
    expires_at: datetime | None
    state: str
    """`open`, `closed` or `abandoned` (computed, see the module's docstring)."""
    calls: int


@dataclass(frozen=True, slots=True)
class CallRow:
    """One call of an episode, as `GET /v1/episodes/{id}` lists it."""

    id: str
    created_at: datetime
    created: Any
    """The answer's own `created` (unix seconds), as the client saw it."""
    model: str
    served_version: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    previous_id: str | None
    prompt_prefix_tokens: int
    segment_break: dict[str, Any] | None
    latency_ms: int


@dataclass(frozen=True, slots=True)
class CompletionRef:
    """What a reward needs of the completion it targets: its episode and how many tokens it sampled."""

    episode_id: str | None
    completion_tokens: int
    """Choice 0's sampled token ids (the usage's count where the engine returned no ids)."""


@dataclass(frozen=True, slots=True)
class RewardRow:
    organization_id: str
    id: str
    episode_id: str | None
    completion_id: str | None
    span_start: int | None
    span_end: int | None
    name: str
    value: float
    source: str | None
    idempotency_key: str | None
    api_key_id: str
    created_at: datetime
    comment: str | None
    """Thumbs feedback's comment (migration 0020)."""


LIVE = "(expires_at IS NULL OR expires_at > now())"
IDLE_END = "coalesce(e.last_call_at, e.created_at) + make_interval(secs => e.idle_timeout_s)"
"""When an episode without a call since goes idle."""
STATE = f"""CASE WHEN e.closed_at IS NOT NULL THEN 'closed'
            WHEN {IDLE_END} < now() THEN CASE e.on_idle WHEN 'close' THEN 'closed' ELSE 'abandoned' END
            ELSE 'open' END"""
"""An episode's state (the table's alias is `e`)."""
EPISODE = f"""
SELECT e.organization_id, e.id, e.seq, e.api_key_id, e.parent_episode_id, e.metadata, e.idle_timeout_s,
       e.on_idle, e.created_at, e.last_call_at, e.expires_at,
       CASE WHEN e.closed_at IS NOT NULL THEN e.closed_at
            WHEN e.on_idle = 'close' AND {IDLE_END} < now() THEN {IDLE_END} END AS closed_at,
       {STATE} AS state,
       (SELECT count(*) FROM captured_completions c
        WHERE c.organization_id = e.organization_id AND c.episode_id = e.id
          AND (c.expires_at IS NULL OR c.expires_at > now())) AS calls
FROM episodes e
WHERE e.organization_id = $1 AND (e.expires_at IS NULL OR e.expires_at > now())
"""
"""Every live episode of organisation $1, with its state and number of calls."""

INSERT = """
INSERT INTO episodes (organization_id, id, api_key_id, parent_episode_id, metadata, idle_timeout_s, on_idle,
                      expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, now() + make_interval(days => $8))
ON CONFLICT (organization_id, id) DO NOTHING
RETURNING id
"""
"""A new episode (`$8` days of retention, null: for ever); nothing when the id is taken."""
GET = EPISODE + " AND e.id = $2"
LIST = f"""
SELECT * FROM ({EPISODE}) x
WHERE ($2::text IS NULL OR state = $2)
  AND ($3::jsonb IS NULL OR metadata @> $3::jsonb)
  AND ($4::text IS NULL OR EXISTS (
        SELECT 1 FROM captured_completions c
        WHERE c.organization_id = $1 AND c.episode_id = x.id AND c.model = $4 AND {LIVE}))
  AND ($5::bigint IS NULL OR created_at > to_timestamp($5))
  AND ($6::bigint IS NULL OR created_at < to_timestamp($6))
  AND ($7::text IS NULL OR (created_at, seq) {{op}} (
        SELECT created_at, seq FROM episodes WHERE organization_id = $1 AND id = $7))
ORDER BY created_at {{dir}}, seq {{dir}}
LIMIT $8
"""
LIST_ASC = LIST.format(op=">", dir="ASC")
LIST_DESC = LIST.format(op="<", dir="DESC")
CLOSE = f"""
UPDATE episodes e
SET closed_at = coalesce(e.closed_at,
                         CASE WHEN e.on_idle = 'close' AND {IDLE_END} < now() THEN {IDLE_END} ELSE now() END)
WHERE e.organization_id = $1 AND e.id = $2 AND {LIVE}
RETURNING e.id
"""
"""Close an episode once: closing it again keeps the time it closed (an idle one closed when it went idle)."""
DELETE_REWARDS = "DELETE FROM episode_rewards WHERE organization_id = $1 AND episode_id = $2"
DELETE_CALLS = "DELETE FROM captured_completions WHERE organization_id = $1 AND episode_id = $2"
DELETE = f"DELETE FROM episodes WHERE organization_id = $1 AND id = $2 RETURNING api_key_id, {LIVE} AS live"
CALLS = f"""
SELECT id, created_at, {capture_store.RESPONSE_CREATED} AS created, model, served_version, finish_reason,
       {capture_store.RESPONSE_USAGE} AS usage, previous_id, prompt_prefix_tokens,
       {capture_store.SEGMENT_BREAK} AS segment_break, latency_ms
FROM captured_completions
WHERE organization_id = $1 AND episode_id = $2 AND {LIVE}
ORDER BY created_at, seq
"""
COMPLETION = f"""
SELECT episode_id,
       coalesce(CASE WHEN jsonb_typeof(completion_token_ids -> 0) = 'array'
                     THEN jsonb_array_length(completion_token_ids -> 0) END,
                {capture_store.FIRST_COMPLETION_LENGTH},
                completion_tokens) AS completion_tokens
FROM captured_completions
WHERE organization_id = $1 AND id = $2 AND {LIVE}
"""

INSERT_REWARD = """
INSERT INTO episode_rewards (organization_id, id, episode_id, completion_id, span_start, span_end, name,
                             value, source, idempotency_key, api_key_id, comment)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12)
ON CONFLICT (organization_id, coalesce(episode_id, ''), idempotency_key) WHERE idempotency_key IS NOT NULL
DO NOTHING
RETURNING *
"""
"""A new reward; nothing when its idempotency key was used in the episode already."""
REWARD_BY_KEY = """
SELECT * FROM episode_rewards
WHERE organization_id = $1 AND coalesce(episode_id, '') = coalesce($2, '') AND idempotency_key = $3
"""
REWARDS = """
SELECT * FROM episode_rewards WHERE organization_id = $1 AND episode_id = $2
  AND ($3::text IS NULL OR seq {op} (
        SELECT seq FROM episode_rewards WHERE organization_id = $1 AND episode_id = $2 AND id = $3))
ORDER BY seq {dir}
LIMIT $4
"""
KEY_EXPIRES_AT = "SELECT expires_at FROM api_keys WHERE id = $1"
REWARDS_ASC = REWARDS.format(op=">", dir="ASC")
REWARDS_DESC = REWARDS.format(op="<", dir="DESC")


async def insert(
    conn: Conn,
    *,
    org_id: str,
    episode_id: str,
    api_key_id: str | None,
    parent_episode_id: str | None,
    metadata: dict[str, str],
    idle_timeout_s: int,
    on_idle: str,
    retention_days: int | None,
) -> bool:
    """A new episode; False when the organisation has one of that id."""
    made = await conn.fetchval(
        INSERT,
        org_id,
        episode_id,
        api_key_id,
        parent_episode_id,
        metadata,
        idle_timeout_s,
        on_idle,
        retention_days,
    )
    return made is not None


async def get(conn: Conn, *, org_id: str, episode_id: str) -> EpisodeRow | None:
    return maybe_row_to(EpisodeRow, await conn.fetchrow(GET, org_id, episode_id))


async def list_page(
    conn: Conn,
    *,
    org_id: str,
    state: str | None,
    metadata: dict[str, str] | None,
    model: str | None,
    created_after: int | None,
    created_before: int | None,
    after: str | None,
    limit: int,
    descending: bool,
) -> list[EpisodeRow]:
    sql = LIST_DESC if descending else LIST_ASC
    records = await conn.fetch(
        sql, org_id, state, metadata, model, created_after, created_before, after, limit
    )
    return rows_to(EpisodeRow, records)


async def close(conn: Conn, *, org_id: str, episode_id: str) -> bool:
    """Set `closed_at` unless set; False for an unknown episode."""
    return await conn.fetchval(CLOSE, org_id, episode_id) is not None


async def delete(conn: Conn, *, org_id: str, episode_id: str) -> tuple[bool, str | None]:
    """Delete an episode with its calls and rewards (`conn` in a transaction, which the caller rolls back
    when the episode was not found): whether it was there and live, and its key's id."""
    row = await conn.fetchrow(DELETE, org_id, episode_id)
    if row is None:
        return False, None
    await conn.execute(DELETE_REWARDS, org_id, episode_id)
    await conn.execute(DELETE_CALLS, org_id, episode_id)
    return bool(row["live"]), row["api_key_id"]


async def calls(conn: Conn, *, org_id: str, episode_id: str) -> list[CallRow]:
    """The episode's calls, in the order they were made."""
    return rows_to(CallRow, await conn.fetch(CALLS, org_id, episode_id))


async def completion(conn: Conn, *, org_id: str, completion_id: str) -> CompletionRef | None:
    return maybe_row_to(CompletionRef, await conn.fetchrow(COMPLETION, org_id, completion_id))


async def insert_reward(
    conn: Conn,
    *,
    org_id: str,
    reward_id: str,
    episode_id: str | None,
    completion_id: str | None,
    span: tuple[int, int] | None,
    name: str,
    value: float,
    source: str | None,
    idempotency_key: str | None,
    api_key_id: str,
    comment: str | None = None,
) -> RewardRow:
    """A new reward, or the one posted before with the same idempotency key in the episode."""
    start, end = span if span is not None else (None, None)
    record = await conn.fetchrow(
        INSERT_REWARD,
        org_id,
        reward_id,
        episode_id,
        completion_id,
        start,
        end,
        name,
        value,
        source,
        idempotency_key,
        api_key_id,
        comment,
    )
    if record is None:  # the key was taken: its reward (rewards are never deleted but with their episode)
        record = await conn.fetchrow(REWARD_BY_KEY, org_id, episode_id, idempotency_key)
    return row_to(RewardRow, record)


async def rewards(
    conn: Conn, *, org_id: str, episode_id: str, after: str | None, limit: int | None, descending: bool
) -> list[RewardRow]:
    """The episode's rewards in the order they were posted (`limit` None: all)."""
    sql = REWARDS_DESC if descending else REWARDS_ASC
    return rows_to(RewardRow, await conn.fetch(sql, org_id, episode_id, after, limit))


async def key_expires_at(conn: Conn, *, key_id: str) -> datetime | None:
    """When an episode's key stops working."""
    value: datetime | None = await conn.fetchval(KEY_EXPIRES_AT, key_id)
    return value

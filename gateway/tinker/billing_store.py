"""SQL of Tinker's billing reports (`gateway.tinker.billing`): an organisation's usage in hourly buckets and
its checkpoints now.

Hours are `date_bin('1 hour', created_at, start)` with an hour-aligned `start`, so every bucket is a UTC hour.
The usage read is the usage billing reads (`gateway.billing.store`): `completion_usage` (completions, and the
tokens of Tinker's `forward` / `forward_backward`, metered as prompt tokens of the model
`tinker-<kind>:<model id>` by `gateway.tinker.store.meter`) and `training_usage` (fine-tuning jobs), every row
whatever its status, as billing counts them.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any

from gateway.db import Conn, rows_to

TINKER_PASSES = ("tinker-forward:", "tinker-forward_backward:")
"""Prefixes of the usage rows of Tinker's passes (`gateway.tinker.store.meter`): the model id follows."""


@dataclass(frozen=True, slots=True)
class CompletionHour:
    """Tokens of one hour, base model and kind: Tinker passes (`tinker_pass`, with the session of their
    training model where it is known) or completions (`tinker_pass` false, no session)."""

    bucket: datetime
    base_model: str
    tinker_pass: bool
    session_id: str | None
    prompt_tokens: int
    completion_tokens: int


@dataclass(frozen=True, slots=True)
class TrainingHour:
    """Tokens fine-tuning jobs trained, of one hour and base model (recorded when an attempt ends)."""

    bucket: datetime
    base_model: str
    trained_tokens: int


@dataclass(frozen=True, slots=True)
class CheckpointHour:
    """Tinker checkpoints saved in one hour, by the base model and session of their training model."""

    bucket: datetime
    base_model: str | None
    session_id: str | None
    count: int


@dataclass(frozen=True, slots=True)
class SessionMetadata:
    id: str
    user_metadata: dict[str, Any] | None


@dataclass(frozen=True, slots=True)
class CheckpointStorage:
    """The organisation's checkpoints not expired: how many, and their bytes as recorded at save (a
    checkpoint whose size was not recorded counts 0 bytes)."""

    checkpoint_count: int
    size_bytes: int


COMPLETION_HOURS = f"""
WITH u AS (
    SELECT date_bin('1 hour'::interval, created_at, $2::timestamptz) AS bucket, organization_id, base_model,
           prompt_tokens, completion_tokens,
           CASE WHEN starts_with(model, '{TINKER_PASSES[0]}') OR starts_with(model, '{TINKER_PASSES[1]}')
                THEN substr(model, strpos(model, ':') + 1) END AS tinker_model
    FROM completion_usage
    WHERE organization_id = $1 AND created_at >= $2 AND created_at < $3)
SELECT u.bucket, u.base_model, u.tinker_model IS NOT NULL AS tinker_pass, m.session_id,
       sum(u.prompt_tokens)::bigint AS prompt_tokens, sum(u.completion_tokens)::bigint AS completion_tokens
FROM u LEFT JOIN tinker_models m ON m.id = u.tinker_model AND m.organization_id = u.organization_id
GROUP BY 1, 2, 3, 4"""
TRAINING_HOURS = """
SELECT date_bin('1 hour'::interval, created_at, $2::timestamptz) AS bucket, base_model,
       sum(trained_tokens)::bigint AS trained_tokens
FROM training_usage
WHERE organization_id = $1 AND created_at >= $2 AND created_at < $3
GROUP BY 1, 2"""
CHECKPOINT_HOURS = """
SELECT date_bin('1 hour'::interval, c.created_at, $2::timestamptz) AS bucket, m.base_model, m.session_id,
       count(*)::bigint AS count
FROM tinker_checkpoints c
LEFT JOIN tinker_models m ON m.id = c.model_id AND m.organization_id = c.organization_id
WHERE c.organization_id = $1 AND c.created_at >= $2 AND c.created_at < $3
GROUP BY 1, 2, 3"""
SESSIONS = "SELECT id, user_metadata FROM tinker_sessions WHERE organization_id = $1 AND id = ANY($2::text[])"
STORAGE_NOW = """
SELECT count(*)::bigint AS checkpoint_count, coalesce(sum(size_bytes), 0)::bigint AS size_bytes
FROM tinker_checkpoints
WHERE organization_id = $1 AND (expires_at IS NULL OR expires_at > now())"""


async def completion_hours(
    conn: Conn, *, org_id: str, start: datetime, end: datetime
) -> list[CompletionHour]:
    """Token sums of `[start, end)` per hour, base model, kind and session."""
    return rows_to(CompletionHour, await conn.fetch(COMPLETION_HOURS, org_id, start, end))


async def training_hours(conn: Conn, *, org_id: str, start: datetime, end: datetime) -> list[TrainingHour]:
    """Fine-tuning jobs' trained tokens of `[start, end)` per hour and base model."""
    return rows_to(TrainingHour, await conn.fetch(TRAINING_HOURS, org_id, start, end))


async def checkpoint_hours(
    conn: Conn, *, org_id: str, start: datetime, end: datetime
) -> list[CheckpointHour]:
    """Checkpoints saved in `[start, end)` per hour, base model and session, as the table holds them now: a
    checkpoint saved again under its name counts at its last save, and one deleted at its expiry no longer
    counts."""
    return rows_to(CheckpointHour, await conn.fetch(CHECKPOINT_HOURS, org_id, start, end))


async def session_metadata(conn: Conn, *, org_id: str, session_ids: list[str]) -> list[SessionMetadata]:
    """The `user_metadata` of the organisation's sessions among `session_ids`."""
    return rows_to(SessionMetadata, await conn.fetch(SESSIONS, org_id, session_ids))


async def storage_now(conn: Conn, *, org_id: str) -> CheckpointStorage:
    """The organisation's checkpoints that have not expired."""
    record = await conn.fetchrow(STORAGE_NOW, org_id)
    assert record is not None  # an aggregate without GROUP BY always answers one row
    return CheckpointStorage(int(record["checkpoint_count"]), int(record["size_bytes"]))

"""SQL of the Tinker API: sessions, training models, requests (futures), checkpoints and samplers.

Every query of the API side filters by organisation. The holder side (`gateway.tinker.holder`, in the
worker) addresses a model by id and guards each change by `worker_id`, as the job pipeline does. A model or
sampler id that is taken already is not an error here: `create_model` and `create_sampler` say so (None,
False) and the service answers it as the caller's mistake. The holder side also exports the models' lease
(`MODEL_LEASE`, `gateway.work.lease`).

Size: over 450 lines, and left whole: it holds the SQL of all five Tinker tables, each section small; the
seam when it grows is the holder side (claim, beat, release, hand back, the lease) apart from the API side.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import asyncpg

from gateway.db import Conn, maybe_row_to, row_to, rows_to
from gateway.settings import Settings
from gateway.tinker.paths import RUN_TINKER_MODEL
from gateway.tinker.rows import (
    CheckpointRow,
    FutureRow,
    HolderRow,
    ModelCheckpointRow,
    RequestRow,
    SamplerRow,
    TrainingModelRow,
)
from gateway.work.lease import Lease, StaleWork

# ---------------------------------------------------------------------------------------------- sessions
INSERT_SESSION = """
INSERT INTO tinker_sessions (id, organization_id, api_key_id, tags, user_metadata, sdk_version)
VALUES ($1, $2, $3, $4, $5, $6)"""
BEAT_SESSION = """
UPDATE tinker_sessions SET last_heartbeat_at = now() WHERE id = $1 AND organization_id = $2 RETURNING id"""

OWN_SESSION = "SELECT true FROM tinker_sessions WHERE id = $1 AND organization_id = $2"
FINISH_SESSION = """
UPDATE tinker_sessions
SET finished_at = coalesce(finished_at, now()),
    finish_reason = coalesce(finish_reason, $3),
    finish_detail = CASE WHEN finish_reason IS NULL THEN $4 ELSE finish_detail END
WHERE id = $1 AND organization_id = $2
RETURNING id"""


async def create_session(
    conn: Conn, *, session_id: str, org_id: str, key_id: str, tags: list[str], metadata: object, sdk: str
) -> None:
    await conn.execute(INSERT_SESSION, session_id, org_id, key_id, tags, metadata, sdk)


async def own_session(conn: Conn, *, session_id: str, org_id: str) -> bool:
    """Whether `session_id` is a session of the organisation `org_id`."""
    return bool(await conn.fetchval(OWN_SESSION, session_id, org_id))


async def beat_session(conn: Conn, *, session_id: str, org_id: str) -> bool:
    return await conn.fetchval(BEAT_SESSION, session_id, org_id) is not None


async def finish_session(
    conn: Conn, *, session_id: str, org_id: str, reason: str, detail: str | None
) -> bool:
    """Record how the session ended; a session that already has a reason keeps it. False: no such session."""
    return await conn.fetchval(FINISH_SESSION, session_id, org_id, reason, detail) is not None


# ---------------------------------------------------------------------------------------------- models
INSERT_MODEL = """
INSERT INTO tinker_models (id, organization_id, api_key_id, session_id, base_model, lora_rank, lora_config,
                           user_metadata, resume_path)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (id) DO NOTHING
RETURNING *"""
GET_MODEL = "SELECT * FROM tinker_models WHERE id = $1 AND organization_id = $2"
LIST_MODELS = """
SELECT * FROM tinker_models WHERE organization_id = $1 ORDER BY seq DESC LIMIT $2 OFFSET $3"""
COUNT_MODELS = "SELECT count(*) FROM tinker_models WHERE organization_id = $1"


async def create_model(
    conn: Conn,
    *,
    model_id: str,
    org_id: str,
    key_id: str,
    session_id: str,
    base_model: str,
    rank: int,
    lora_config: dict[str, Any],
    metadata: object,
    resume_path: str | None = None,
) -> TrainingModelRow | None:
    """The new model's row; None when `model_id` is taken (the caller checked that its session is the
    organisation's own, so only the organisation itself can have taken it)."""
    record = await conn.fetchrow(
        INSERT_MODEL,
        model_id,
        org_id,
        key_id,
        session_id,
        base_model,
        rank,
        lora_config,
        metadata,
        resume_path,
    )
    return maybe_row_to(TrainingModelRow, record)


async def get_model(conn: Conn, *, model_id: str, org_id: str) -> TrainingModelRow | None:
    return maybe_row_to(TrainingModelRow, await conn.fetchrow(GET_MODEL, model_id, org_id))


async def list_models(
    conn: Conn, *, org_id: str, limit: int, offset: int
) -> tuple[list[TrainingModelRow], int]:
    rows = rows_to(TrainingModelRow, await conn.fetch(LIST_MODELS, org_id, limit, offset))
    return rows, int(await conn.fetchval(COUNT_MODELS, org_id))


# ---------------------------------------------------------------------------------------------- requests
REQUEST_CHANNEL = "tinker_request"
"""Notified with a model's id when a request of it is queued (its holder wakes, `gateway.notices`)."""
ANSWER_CHANNEL = "tinker_answer"
"""Notified with a request's id when it is answered (its `retrieve_future` wakes)."""
INSERT_REQUEST = """
INSERT INTO tinker_requests (id, organization_id, model_id, kind, payload) VALUES ($1, $2, $3, $4, $5)"""
INSERT_ENCODED_REQUEST = """
INSERT INTO tinker_requests (id, organization_id, model_id, kind, payload)
VALUES ($1, $2, $3, $4, $5::text::jsonb)"""
TOUCH_MODEL = f"""
WITH touched AS (UPDATE tinker_models SET last_request_at = now() WHERE id = $1 RETURNING id)
SELECT pg_notify('{REQUEST_CHANNEL}', id) FROM touched"""
HOLDER = """
SELECT worker_id, (heartbeat_at > now() - make_interval(secs => $2)) AS alive, lost
FROM tinker_models WHERE id = $1"""
GET_REQUEST = """
SELECT *, extract(epoch FROM now() - created_at)::float8 AS age_s FROM tinker_requests
WHERE id = $1 AND organization_id = $2"""
FINISH = f"""
WITH answered AS (
    UPDATE tinker_requests SET status = $2, result = $3, result_type = $4, error = $5, category = $6,
           finished_at = now(), payload = '{{}}'  -- a request's data is of no use once it is answered
    WHERE id = $1 AND status IN ('pending', 'running') RETURNING id)
SELECT pg_notify('{ANSWER_CHANNEL}', id) FROM answered"""
FORGET_FINISHED = """
DELETE FROM tinker_requests WHERE id IN (
    SELECT id FROM tinker_requests
    WHERE status IN ('done', 'failed') AND finished_at < now() - make_interval(secs => $1)
    LIMIT $2)"""


async def forget_finished(conn: Conn, *, older_than_s: float, most: int = 10_000) -> int:
    """Delete up to `most` answered requests (futures) finished more than `older_than_s` ago; how many."""
    status = await conn.execute(FORGET_FINISHED, older_than_s, most)
    return int(status.rsplit(" ", 1)[-1])


@dataclass(frozen=True, slots=True)
class JsonText:
    """A request's payload already encoded as JSON (a large one, encoded off the event loop): stored as it
    is, where any other payload is encoded by the pool's JSON codec."""

    text: str


async def add_request(
    conn: Conn, *, request_id: str, org_id: str, model_id: str | None, kind: str, payload: object
) -> None:
    if isinstance(payload, JsonText):
        await conn.execute(INSERT_ENCODED_REQUEST, request_id, org_id, model_id, kind, payload.text)
    else:
        await conn.execute(INSERT_REQUEST, request_id, org_id, model_id, kind, payload)
    if model_id is not None:
        await conn.execute(TOUCH_MODEL, model_id)


async def holder(conn: Conn, *, model_id: str, stale_s: float) -> HolderRow | None:
    """`worker_id`, `alive` (its beat is fresh) and `lost` of a model (its organisation checked already)."""
    return maybe_row_to(HolderRow, await conn.fetchrow(HOLDER, model_id, stale_s))


async def get_request(conn: Conn, *, request_id: str, org_id: str) -> FutureRow | None:
    return maybe_row_to(FutureRow, await conn.fetchrow(GET_REQUEST, request_id, org_id))


async def finish(
    conn: Conn,
    *,
    request_id: str,
    result: bytes | None = None,
    result_type: str = "json",
    error: str | None = None,
    category: str | None = None,
) -> None:
    status = "failed" if error is not None else "done"
    await conn.execute(FINISH, request_id, status, result, result_type, error, category)


# ---------------------------------------------------------------------------------------------- holder side
CLAIM = """
UPDATE tinker_models SET worker_id = $2, heartbeat_at = now(), held_at = now()
WHERE id = $1 AND lost IS NULL AND worker_id IS NULL
RETURNING *"""
BEAT = "UPDATE tinker_models SET heartbeat_at = now() WHERE id = $1 AND worker_id = $2 RETURNING id"
NEXT = """
UPDATE tinker_requests SET status = 'running'
WHERE id = (SELECT id FROM tinker_requests WHERE model_id = $1 AND status IN ('pending', 'running')
            ORDER BY seq LIMIT 1)
RETURNING *"""
RELEASE = """
UPDATE tinker_models SET worker_id = NULL, heartbeat_at = NULL, resume_path = coalesce($3, resume_path)
WHERE id = $1 AND worker_id = $2
  AND NOT EXISTS (SELECT 1 FROM tinker_requests WHERE model_id = $1 AND status IN ('pending', 'running'))
RETURNING id"""
SESSION_FINISHED = """
SELECT s.finished_at IS NOT NULL FROM tinker_models m JOIN tinker_sessions s ON s.id = m.session_id
WHERE m.id = $1"""
LOSE = "UPDATE tinker_models SET lost = $2, worker_id = NULL WHERE id = $1 AND lost IS NULL RETURNING id"
FAIL_OPEN = """
UPDATE tinker_requests SET status = 'failed', error = $2, category = 'server', finished_at = now()
WHERE model_id = $1 AND status IN ('pending', 'running')"""
# A held Tinker model lets its slot go for waiting work (`gateway.tinker.holder`), open requests or not. Its
# `held_at` becomes now, so that the claims that follow rank it as `gateway.work.store.FAIREST` did with the
# model as $3: after the work it let go for.
HAND_BACK_MODEL = """
UPDATE tinker_models SET worker_id = NULL, heartbeat_at = NULL, resume_path = $3, held_at = now()
WHERE id = $1 AND worker_id = $2 RETURNING id"""
MODEL_ASKED = """
SELECT EXISTS (SELECT 1 FROM tinker_requests WHERE model_id = $1 AND status IN ('pending', 'running'))"""
# The lease (`MODEL_LEASE`): a model is queued while requests of it are open and no worker holds it, and a
# holder that stopped beating took the weights with it (the model is lost, never re-queued).
QUEUED_MODELS = """
SELECT m.id, min(r.seq) AS queue_generation
FROM tinker_models m JOIN tinker_requests r ON r.model_id = m.id AND r.status IN ('pending', 'running')
WHERE m.worker_id IS NULL AND m.lost IS NULL
GROUP BY m.id ORDER BY min(r.seq) LIMIT 1000"""
LET_GO = """
UPDATE tinker_models SET worker_id = NULL, heartbeat_at = NULL WHERE id = $1 AND worker_id = $2
RETURNING id"""
STALE_MODELS = """
SELECT id, organization_id, worker_id FROM tinker_models
WHERE worker_id IS NOT NULL AND lost IS NULL AND heartbeat_at < now() - make_interval(secs => $1)"""
LOSE_STALE = """
UPDATE tinker_models SET lost = $3, worker_id = NULL WHERE id = $1 AND worker_id = $2 AND lost IS NULL
RETURNING id"""


async def claim(conn: Conn, *, model_id: str, worker_id: str) -> TrainingModelRow | None:
    """Hold `model_id` unless a worker does: a holder that died took the weights with it (the model is lost,
    see `lose`), so a model is claimed only when free (new, or let go with its state saved)."""
    return maybe_row_to(TrainingModelRow, await conn.fetchrow(CLAIM, model_id, worker_id))


async def beat(conn: Conn, *, model_id: str, worker_id: str) -> bool:
    return await conn.fetchval(BEAT, model_id, worker_id) is not None


async def next_request(conn: Conn, *, model_id: str) -> RequestRow | None:
    """The model's oldest open request (a running one first: a holder that took over answers it again)."""
    return maybe_row_to(RequestRow, await conn.fetchrow(NEXT, model_id))


async def session_finished(conn: Conn, *, model_id: str) -> bool:
    """Whether the client of the model's session reported that it finished (`finish_session`)."""
    return bool(await conn.fetchval(SESSION_FINISHED, model_id))


async def release(conn: Conn, *, model_id: str, worker_id: str, resume_path: str | None) -> bool:
    """Let the model go, unless a request came in meanwhile (then the caller keeps serving it)."""
    return await conn.fetchval(RELEASE, model_id, worker_id, resume_path) is not None


async def hand_back_model(conn: Conn, *, model_id: str, worker_id: str, resume_path: str) -> bool:
    """Let a held Tinker model go for work that waits, with its state saved at `resume_path`, whether or not
    requests of it are open (they wait for its next holder, which loads that state first). False when this
    worker no longer holds it."""
    return await conn.fetchval(HAND_BACK_MODEL, model_id, worker_id, resume_path) is not None


async def model_asked(conn: Conn, *, model_id: str) -> bool:
    """Whether requests of a Tinker model are open (so, once let go, it needs a wake-up of its own)."""
    return bool(await conn.fetchval(MODEL_ASKED, model_id))


async def lose(pool: asyncpg.Pool, *, model_id: str, reason: str) -> None:
    """The model's weights are gone: mark it, and fail its open requests with `reason`."""
    async with pool.acquire() as c, c.transaction():
        await c.execute(LOSE, model_id, reason)
        await c.execute(FAIL_OPEN, model_id, reason)


# ---------------------------------------------------------------------------------------------- the lease
def lost_reason(model_id: str) -> str:
    """Why the open requests of a model whose holder stopped beating failed."""
    return (
        f"The worker holding model {model_id} stopped responding; its unsaved weights are lost. "
        "Load your last saved state into a new training client."
    )


def _give_up(row: StaleWork, settings: Settings) -> str:
    return lost_reason(row.id)


async def _fail_open(conn: Conn, row: StaleWork, reason: str) -> None:
    await conn.execute(FAIL_OPEN, row.id, reason)


MODEL_LEASE = Lease(
    kind="tinker_model",
    function=RUN_TINKER_MODEL,
    claim=CLAIM,
    heartbeat=BEAT,
    release=LET_GO,
    queued_unclaimed=QUEUED_MODELS,
    stale=STALE_MODELS,
    fail_stale=LOSE_STALE,
    give_up=_give_up,
    on_failed=_fail_open,
)
"""A training model held by a worker (`gateway.tinker.holder`). Its holder lets it go itself, with its state
saved (`release`, `hand_back_model`), so it has no `requeue_own`; a lost holder loses the model at once."""


# ---------------------------------------------------------------------------------------------- checkpoints
INSERT_CHECKPOINT = """
INSERT INTO tinker_checkpoints (organization_id, model_id, kind, name, path, served_model, with_optimizer,
                                size_bytes, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, now() + make_interval(secs => $9))
ON CONFLICT (model_id, kind, name) DO UPDATE
SET path = EXCLUDED.path, served_model = EXCLUDED.served_model, with_optimizer = EXCLUDED.with_optimizer,
    size_bytes = EXCLUDED.size_bytes, created_at = now(), expires_at = EXCLUDED.expires_at
WHERE tinker_checkpoints.organization_id = EXCLUDED.organization_id
RETURNING *"""
GET_CHECKPOINT = """
SELECT c.*, m.base_model, m.lora_rank, m.lora_config FROM tinker_checkpoints c
JOIN tinker_models m ON m.id = c.model_id
WHERE c.model_id = $1 AND c.kind = $2 AND c.name = $3 AND c.organization_id = $4
  AND (c.expires_at IS NULL OR c.expires_at > now())"""
LIST_CHECKPOINTS = """
SELECT * FROM tinker_checkpoints WHERE organization_id = $1 AND ($2::text IS NULL OR model_id = $2)
  AND (expires_at IS NULL OR expires_at > now())
ORDER BY created_at DESC"""
EXPIRED = """
SELECT * FROM tinker_checkpoints WHERE expires_at <= now() ORDER BY expires_at LIMIT $1"""
DELETE_CHECKPOINT = """
DELETE FROM tinker_checkpoints WHERE model_id = $1 AND kind = $2 AND name = $3 AND expires_at <= now()
RETURNING served_model"""
DELETE_SERVED = "DELETE FROM models WHERE id = $1 AND organization_id = $2 RETURNING version"
REGISTER_SERVED = """
INSERT INTO models (id, organization_id, base_model, adapter_path, version) VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (id) DO UPDATE SET adapter_path = EXCLUDED.adapter_path, version = EXCLUDED.version
WHERE models.organization_id = EXCLUDED.organization_id"""


async def add_checkpoint(
    pool: asyncpg.Pool,
    *,
    org_id: str,
    model_id: str,
    kind: str,
    name: str,
    path: str,
    served_model: str | None,
    with_optimizer: bool,
    size_bytes: int | None,
    base_model: str,
    ttl_s: float | None = None,
    version: str | None = None,
) -> CheckpointRow:
    """Record a checkpoint, expiring `ttl_s` from now (never: None); a sampler checkpoint also becomes the
    OpenAI model `served_model`, of adapter version `version`. Saving again under a checkpoint's name
    replaces it, but only within its organisation: one of another organisation's is never replaced
    (ValueError, nothing recorded)."""
    async with pool.acquire() as c, c.transaction():
        if served_model is not None:
            await c.execute(REGISTER_SERVED, served_model, org_id, base_model, path, version)
        record = await c.fetchrow(
            INSERT_CHECKPOINT, org_id, model_id, kind, name, path, served_model, with_optimizer, size_bytes,
            ttl_s,
        )  # fmt: skip
        if record is None:
            raise ValueError(f"checkpoint {model_id}/{kind}/{name} belongs to another organisation")
    return row_to(CheckpointRow, record)


async def get_checkpoint(
    conn: Conn, *, org_id: str, model_id: str, kind: str, name: str
) -> ModelCheckpointRow | None:
    """A checkpoint of the organisation, with its model's base model and LoRA settings."""
    return maybe_row_to(ModelCheckpointRow, await conn.fetchrow(GET_CHECKPOINT, model_id, kind, name, org_id))


async def list_checkpoints(conn: Conn, *, org_id: str, model_id: str | None) -> list[CheckpointRow]:
    return rows_to(CheckpointRow, await conn.fetch(LIST_CHECKPOINTS, org_id, model_id))


# ---------------------------------------------------------------------------------------------- samplers
INSERT_SAMPLER = """
INSERT INTO tinker_samplers (id, organization_id, session_id, base_model, model_path, served_model)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (id) DO NOTHING
RETURNING id"""
GET_SAMPLER = "SELECT * FROM tinker_samplers WHERE id = $1 AND organization_id = $2"


async def create_sampler(
    conn: Conn,
    *,
    sampler_id: str,
    org_id: str,
    session_id: str,
    base_model: str,
    model_path: str | None,
    served_model: str,
) -> bool:
    """Record a sampling session; False when `sampler_id` is taken (as `create_model`)."""
    inserted = await conn.fetchval(
        INSERT_SAMPLER, sampler_id, org_id, session_id, base_model, model_path, served_model
    )
    return inserted is not None


async def get_sampler(conn: Conn, *, sampler_id: str, org_id: str) -> SamplerRow | None:
    return maybe_row_to(SamplerRow, await conn.fetchrow(GET_SAMPLER, sampler_id, org_id))


# ---------------------------------------------------------------------------------------------- metering
INSERT_USAGE = """
INSERT INTO completion_usage (organization_id, api_key_id, model, base_model, prompt_tokens,
                              completion_tokens, latency_ms, status, created_at)
VALUES ($1, $2, $3, $4, $5, 0, 0, 200, now())"""


async def meter(conn: Conn, *, org_id: str, key_id: str, model: str, base_model: str, tokens: int) -> None:
    """Tokens a forward or forward_backward pass processed, as prompt tokens of `model`
    (`tinker-forward_backward:<model id>`) in the usage table, priced and billed as completions are."""
    await conn.execute(INSERT_USAGE, org_id, key_id, model, base_model, tokens)


async def expired_checkpoints(conn: Conn, *, most: int = 100) -> list[CheckpointRow]:
    """Up to `most` checkpoints past their expiry, oldest first (of every organisation: the worker's cron)."""
    return rows_to(CheckpointRow, await conn.fetch(EXPIRED, most))


async def delete_expired(pool: asyncpg.Pool, row: CheckpointRow) -> list[str] | None:
    """Delete an expired checkpoint's row and the OpenAI model it was served as, in one transaction: the
    adapter versions to take off the engines (none for a training checkpoint); None when another worker
    deleted it first."""
    async with pool.acquire() as c, c.transaction():
        deleted = await c.fetchrow(DELETE_CHECKPOINT, row.model_id, row.kind, row.name)
        if deleted is None:
            return None
        if deleted["served_model"] is None:
            return []
        version = await c.fetchval(DELETE_SERVED, deleted["served_model"], row.organization_id)
    return [version] if version is not None else []

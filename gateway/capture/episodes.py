"""Episodes and rewards: what the routes of `gateway.capture.episodes_router` do.

An episode is the calls of one agent run. `create` mints it an episode key (`gateway.tenancy.scoped`,
kind `episode`, named `EPISODE_KEY_NAME` + its id): every call made with that key is captured into it
(`gateway.capture.recorder`). Capture is opt-in, so only a key with capture on may make one. An episode is
closed explicitly (`close`: this gateway refuses calls into it at once, `Capturer.mark_closed`) or goes idle
(its state is read in SQL: `gateway.capture.episodes_store`). Rewards are append-only: a repeated
idempotency key answers the first reward; they are taken as long as the episode is kept (its retention),
closed or not. Another organisation's episodes, completions and rewards are 404, as unknown ones are.
"""

from __future__ import annotations

from typing import Literal

from gateway.capture import episodes_store as store
from gateway.capture.episodes_protocol import (
    Episode,
    EpisodeCall,
    EpisodeCreate,
    EpisodeCreated,
    EpisodeDeleted,
    EpisodeDetail,
    Feedback,
    Reward,
    RewardCreate,
    RewardTarget,
)
from gateway.capture.episodes_store import EpisodeRow
from gateway.capture.protocol import check_metadata
from gateway.deps import Resources
from gateway.errors import Conflict, InvalidRequest, PermissionDenied, not_found
from gateway.ids import new_id
from gateway.protocol import CursorPage
from gateway.tenancy import scoped
from gateway.tenancy.keys import EPISODE_KEY_NAME, Principal
from gateway.timeutil import ts

THUMBS = "thumbs"
"""The name of the reward thumbs feedback makes (1 up, -1 down)."""


async def _episode(res: Resources, who: Principal, episode_id: str) -> EpisodeRow:
    row = await store.get(res.pool, org_id=who.organization_id, episode_id=episode_id)
    if row is None:
        raise not_found("episode", episode_id, param="episode_id")
    return row


# ---- episodes ---------------------------------------------------------------------------------------------
async def create(res: Resources, who: Principal, body: EpisodeCreate) -> EpisodeCreated:
    """A new episode and its key; 403 `capture_off` where capture is off for the calling key, 409
    `episode_exists` for an id the organisation has."""
    setting = res.capture.policies.of(who.organization_id, who.api_key_id)
    if setting is None:
        raise PermissionDenied(
            "Capture is off for this key: an admin turns it on for the organisation or the key "
            "(POST /v1/admin/organizations/{org_id}/capture) before it can make episodes.",
            code="capture_off",
        )
    metadata = check_metadata(body.metadata)
    episode_id = body.id if body.id is not None else new_id("ep_")
    async with res.pool.acquire() as conn, conn.transaction():
        key = await scoped.mint(
            conn,
            org_id=who.organization_id,
            kind="episode",
            name=EPISODE_KEY_NAME + episode_id,
            ttl_s=body.key_ttl_s,
        )
        made = await store.insert(
            conn,
            org_id=who.organization_id,
            episode_id=episode_id,
            api_key_id=key.id,
            parent_episode_id=body.parent_episode_id,
            metadata=metadata,
            idle_timeout_s=body.idle_timeout_s,
            on_idle=body.on_idle,
            retention_days=setting.retention_days,
        )
        if not made:  # the minted key goes with the transaction
            raise Conflict(
                f"An episode with id '{episode_id}' already exists.", param="id", code="episode_exists"
            )
        row = await store.get(conn, org_id=who.organization_id, episode_id=episode_id)
        key_expires_at = await store.key_expires_at(conn, key_id=key.id)
    assert row is not None and key_expires_at is not None
    # An id made again after its episode was deleted takes calls again through this gateway.
    res.capture.closed.discard((who.organization_id, episode_id))
    return EpisodeCreated(
        **Episode.fields_of(row), calls=row.calls, key=key.secret, key_expires_at=ts(key_expires_at) or 0
    )


async def list_episodes(
    res: Resources,
    who: Principal,
    *,
    metadata: dict[str, str],
    state: str | None,
    model: str | None,
    created_after: int | None,
    created_before: int | None,
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> CursorPage[Episode]:
    rows = await store.list_page(
        res.pool,
        org_id=who.organization_id,
        state=state,
        metadata=check_metadata(metadata) or None,
        model=model,
        created_after=created_after,
        created_before=created_before,
        after=after,
        limit=limit + 1,
        descending=order == "desc",
    )
    return CursorPage[Episode].of([Episode.from_row(r) for r in rows], limit)


async def retrieve(res: Resources, who: Principal, episode_id: str) -> EpisodeDetail:
    """The episode with its calls and rewards, read in one snapshot: a batch of calls written meanwhile is
    in all three (its `last_call_at`, its calls) or in none."""
    org_id = who.organization_id
    async with res.pool.acquire() as conn, conn.transaction(isolation="repeatable_read", readonly=True):
        row = await store.get(conn, org_id=org_id, episode_id=episode_id)
        if row is None:
            raise not_found("episode", episode_id, param="episode_id")
        calls = await store.calls(conn, org_id=org_id, episode_id=episode_id)
        rewards = await store.rewards(
            conn, org_id=org_id, episode_id=episode_id, after=None, limit=None, descending=False
        )
    return EpisodeDetail(
        **EpisodeDetail.fields_of(row),
        calls=[EpisodeCall.from_row(c) for c in calls],
        rewards=[Reward.from_row(r) for r in rewards],
    )


async def close(res: Resources, who: Principal, episode_id: str) -> Episode:
    """Close it (again: it stays as it was closed); this gateway refuses calls into it from now on."""
    if not await store.close(res.pool, org_id=who.organization_id, episode_id=episode_id):
        raise not_found("episode", episode_id, param="episode_id")
    res.capture.mark_closed(who.organization_id, episode_id)
    return Episode.from_row(await _episode(res, who, episode_id))


async def delete(res: Resources, who: Principal, episode_id: str) -> EpisodeDeleted:
    """Delete it with its calls and rewards, and end its key."""
    async with res.pool.acquire() as conn, conn.transaction():
        live, key_id = await store.delete(conn, org_id=who.organization_id, episode_id=episode_id)
        if not live:  # rolls the transaction back: an episode past its retention is the purge's
            raise not_found("episode", episode_id, param="episode_id")
        if key_id is not None:
            await scoped.revoke(conn, key_id)
    if key_id is not None:
        res.auth.forget_key(key_id)
    res.capture.mark_closed(who.organization_id, episode_id)
    return EpisodeDeleted(id=episode_id)


# ---- rewards ----------------------------------------------------------------------------------------------
def _idempotency_key(body_key: str | None, header_key: str | None) -> str | None:
    if body_key is not None and header_key is not None and body_key != header_key:
        raise InvalidRequest(
            "The Idempotency-Key header and 'idempotency_key' differ: give one of them.",
            param="idempotency_key",
            code="invalid_value",
        )
    key = body_key if body_key is not None else header_key
    if key is not None and not 0 < len(key) <= 256:
        raise InvalidRequest(
            "The Idempotency-Key header must have 1 to 256 characters.", param="Idempotency-Key"
        )
    return key


def _invalid_target(message: str, field: str) -> InvalidRequest:
    return InvalidRequest(message, param=f"target.{field}", code="invalid_value")


async def _target(
    res: Resources, who: Principal, episode_id: str, target: RewardTarget | None
) -> tuple[str | None, tuple[int, int] | None]:
    """The completion and span a reward's target names, checked against the episode's calls."""
    if target is None or target.type == "episode":
        for field in ("completion_id", "start", "end"):
            if target is not None and getattr(target, field) is not None:
                raise _invalid_target(f"A target of type 'episode' takes no '{field}'.", field)
        return None, None
    if target.completion_id is None:
        raise _invalid_target(f"A target of type '{target.type}' needs a 'completion_id'.", "completion_id")
    ref = await store.completion(res.pool, org_id=who.organization_id, completion_id=target.completion_id)
    if ref is None or ref.episode_id != episode_id:
        raise _invalid_target(
            f"No completion with id '{target.completion_id}' in episode '{episode_id}'.", "completion_id"
        )
    if target.type == "completion":
        for field in ("start", "end"):
            if getattr(target, field) is not None:
                raise _invalid_target(f"A target of type 'completion' takes no '{field}'.", field)
        return target.completion_id, None
    if target.start is None:
        raise _invalid_target("A target of type 'span' needs 'start'.", "start")
    if target.end is None:
        raise _invalid_target("A target of type 'span' needs 'end'.", "end")
    if not target.start < target.end <= ref.completion_tokens:
        raise _invalid_target(
            f"A span needs 0 <= start < end <= {ref.completion_tokens} (the completion's sampled tokens); "
            f"got start {target.start}, end {target.end}.",
            "end",
        )
    return target.completion_id, (target.start, target.end)


async def post_reward(
    res: Resources, who: Principal, episode_id: str, body: RewardCreate, header_key: str | None
) -> Reward:
    """A new reward, or the first one posted with its idempotency key in the episode."""
    await _episode(res, who, episode_id)
    key = _idempotency_key(body.idempotency_key, header_key)
    completion_id, span = await _target(res, who, episode_id, body.target)
    row = await store.insert_reward(
        res.pool,
        org_id=who.organization_id,
        reward_id=new_id("rwd_"),
        episode_id=episode_id,
        completion_id=completion_id,
        span=span,
        name=body.name,
        value=body.value,
        source=body.source,
        idempotency_key=key,
        api_key_id=who.api_key_id,
    )
    return Reward.from_row(row)


async def list_rewards(
    res: Resources,
    who: Principal,
    episode_id: str,
    *,
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> CursorPage[Reward]:
    await _episode(res, who, episode_id)
    rows = await store.rewards(
        res.pool,
        org_id=who.organization_id,
        episode_id=episode_id,
        after=after,
        limit=limit + 1,
        descending=order == "desc",
    )
    return CursorPage[Reward].of([Reward.from_row(r) for r in rows], limit)


async def feedback(
    res: Resources, who: Principal, completion_id: str, body: Feedback, header_key: str | None
) -> Reward:
    """Thumbs on a captured completion: a reward named `thumbs`, 1 or -1, on the completion, in its
    episode (none for a completion outside any)."""
    ref = await store.completion(res.pool, org_id=who.organization_id, completion_id=completion_id)
    if ref is None:
        raise not_found("chat completion", completion_id, param="completion_id")
    row = await store.insert_reward(
        res.pool,
        org_id=who.organization_id,
        reward_id=new_id("rwd_"),
        episode_id=ref.episode_id,
        completion_id=completion_id,
        span=None,
        name=THUMBS,
        value=1.0 if body.thumbs == "up" else -1.0,
        source=None,
        idempotency_key=_idempotency_key(None, header_key),
        api_key_id=who.api_key_id,
        comment=body.comment,
    )
    return Reward.from_row(row)

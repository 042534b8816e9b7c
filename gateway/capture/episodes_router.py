"""Routes of episodes (`/v1/episodes`): mint an episode key, list, read, close, delete, and post rewards; and
thumbs feedback on a captured completion (`POST /v1/chat/completions/{id}/feedback`). A person's key only:
an episode key may call the inference routes alone (`deps.authenticate_person`)."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Header, Query, Request

from gateway.capture import episodes as service
from gateway.capture.episodes_protocol import (
    MAX_UNIX_S,
    Episode,
    EpisodeCreate,
    EpisodeCreated,
    EpisodeDeleted,
    EpisodeDetail,
    Feedback,
    Reward,
    RewardCreate,
)
from gateway.deps import PrincipalDep, RequestLimitDep, ResourcesDep
from gateway.protocol import CursorPage

router = APIRouter(prefix="/v1", tags=["episodes"], dependencies=[RequestLimitDep])

IdempotencyKey = Annotated[str | None, Header(alias="Idempotency-Key")]


@router.post("/episodes")
async def create_episode(body: EpisodeCreate, res: ResourcesDep, who: PrincipalDep) -> EpisodeCreated:
    return await service.create(res, who, body)


@router.get("/episodes")
async def list_episodes(
    request: Request,
    res: ResourcesDep,
    who: PrincipalDep,
    state: Literal["open", "closed", "abandoned"] | None = None,
    model: str | None = None,
    created_after: Annotated[int | None, Query(ge=0, le=MAX_UNIX_S)] = None,
    created_before: Annotated[int | None, Query(ge=0, le=MAX_UNIX_S)] = None,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
) -> CursorPage[Episode]:
    metadata = {
        k[len("metadata[") : -1]: v
        for k, v in request.query_params.items()
        if k.startswith("metadata[") and k.endswith("]")
    }
    return await service.list_episodes(
        res,
        who,
        metadata=metadata,
        state=state,
        model=model,
        created_after=created_after,
        created_before=created_before,
        after=after,
        limit=limit,
        order=order,
    )


@router.get("/episodes/{episode_id}")
async def retrieve_episode(episode_id: str, res: ResourcesDep, who: PrincipalDep) -> EpisodeDetail:
    return await service.retrieve(res, who, episode_id)


@router.post("/episodes/{episode_id}/close")
async def close_episode(episode_id: str, res: ResourcesDep, who: PrincipalDep) -> Episode:
    return await service.close(res, who, episode_id)


@router.delete("/episodes/{episode_id}")
async def delete_episode(episode_id: str, res: ResourcesDep, who: PrincipalDep) -> EpisodeDeleted:
    return await service.delete(res, who, episode_id)


@router.post("/episodes/{episode_id}/rewards")
async def post_reward(
    episode_id: str,
    body: RewardCreate,
    res: ResourcesDep,
    who: PrincipalDep,
    idempotency_key: IdempotencyKey = None,
) -> Reward:
    return await service.post_reward(res, who, episode_id, body, idempotency_key)


@router.get("/episodes/{episode_id}/rewards")
async def list_rewards(
    episode_id: str,
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    order: Literal["asc", "desc"] = "asc",
) -> CursorPage[Reward]:
    return await service.list_rewards(res, who, episode_id, after=after, limit=limit, order=order)


@router.post("/chat/completions/{completion_id}/feedback")
async def post_feedback(
    completion_id: str,
    body: Feedback,
    res: ResourcesDep,
    who: PrincipalDep,
    idempotency_key: IdempotencyKey = None,
) -> Reward:
    return await service.feedback(res, who, completion_id, body, idempotency_key)

"""Routes that score captured episodes on the server (`gateway.capture.scoring`). A person's key only (an
episode key may call the inference routes alone: `deps.authenticate_person`); the key's model calls (model
graders, a group judge) are its own chats."""

from __future__ import annotations

from fastapi import APIRouter

from gateway.capture import scoring
from gateway.capture.scoring_protocol import ScoreRequest, ScoreResponse
from gateway.deps import CallerDep, RequestLimitDep, ResourcesDep

router = APIRouter(prefix="/v1", tags=["episodes"], dependencies=[RequestLimitDep])


@router.post("/episodes/score")
async def score_episodes(body: ScoreRequest, res: ResourcesDep, who: CallerDep) -> ScoreResponse:
    return await scoring.score(res, who, body)

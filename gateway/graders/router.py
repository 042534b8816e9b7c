"""Scoring routes: thin wrappers over `gateway.graders.service`."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from gateway.deps import CallerDep, PrincipalDep, RequestLimitDep, ResourcesDep
from gateway.graders import service
from gateway.graders.protocol import (
    EnvironmentRunRequest,
    EnvironmentRunResponse,
    GraderRunRequest,
    GraderValidateRequest,
    GraderValidateResponse,
)

router = APIRouter(prefix="/v1/fine_tuning/alpha", tags=["graders"], dependencies=[RequestLimitDep])


@router.post("/graders/run")
async def run_grader(body: GraderRunRequest, res: ResourcesDep, who: CallerDep) -> dict[str, Any]:
    return await service.run_grader(res, who, body)


@router.post("/graders/validate")
async def validate_grader(
    body: GraderValidateRequest, res: ResourcesDep, who: PrincipalDep
) -> GraderValidateResponse:
    return await service.validate(res, who.organization_id, body.grader)


@router.post("/environments/run")
async def run_environment(
    body: EnvironmentRunRequest, res: ResourcesDep, who: CallerDep
) -> EnvironmentRunResponse:
    return await service.run_environment(res, who, body)

"""Fine-tuning jobs API: `/v1/fine_tuning/jobs`."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Header, Query, Request

from gateway.deps import CallerDep, PrincipalDep, RequestLimitDep, ResourcesDep
from gateway.jobs import estimate, service
from gateway.jobs.protocol import FineTuningJob, JobCheckpoint, JobCreate, JobEstimate, JobEvent
from gateway.protocol import CursorPage

router = APIRouter(prefix="/v1/fine_tuning/jobs", tags=["fine-tuning"], dependencies=[RequestLimitDep])


@router.post("")
async def create_job(
    body: JobCreate,
    res: ResourcesDep,
    who: PrincipalDep,
    idempotency_key: Annotated[str | None, Header(max_length=255)] = None,
) -> FineTuningJob:
    return await service.create(res, who, body, idempotency_key)


@router.post("/estimate")
async def estimate_job(body: JobCreate, res: ResourcesDep, caller: CallerDep) -> JobEstimate:
    return await estimate.estimate(res, caller, body)


@router.get("")
async def list_jobs(
    request: Request,
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
) -> CursorPage[FineTuningJob]:
    metadata = {
        k[len("metadata[") : -1]: v
        for k, v in request.query_params.items()
        if k.startswith("metadata[") and k.endswith("]")
    }
    return await service.list_jobs(res, who, after=after, limit=limit, metadata=metadata or None)


@router.get("/{job_id}")
async def retrieve_job(job_id: str, res: ResourcesDep, who: PrincipalDep) -> FineTuningJob:
    return await service.get(res, who, job_id)


@router.post("/{job_id}/cancel")
async def cancel_job(job_id: str, res: ResourcesDep, who: PrincipalDep) -> FineTuningJob:
    return await service.cancel(res, who, job_id)


@router.post("/{job_id}/pause")
async def pause_job(job_id: str, res: ResourcesDep, who: PrincipalDep) -> FineTuningJob:
    return await service.pause(res, who, job_id)


@router.post("/{job_id}/resume")
async def resume_job(job_id: str, res: ResourcesDep, who: PrincipalDep) -> FineTuningJob:
    return await service.resume(res, who, job_id)


@router.get("/{job_id}/events")
async def list_events(
    job_id: str,
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 20,
) -> CursorPage[JobEvent]:
    return await service.events(res, who, job_id, after=after, limit=limit)


@router.get("/{job_id}/checkpoints")
async def list_checkpoints(
    job_id: str,
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Annotated[int, Query(ge=1, le=100)] = 10,
) -> CursorPage[JobCheckpoint]:
    return await service.checkpoints(res, who, job_id, after=after, limit=limit)

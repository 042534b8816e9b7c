"""Routes of the Tinker API under `/api/v1`, the prefix the official `tinker` SDK calls.

The SDK sends its key in `X-API-Key` and accepts only keys starting `tml-`: a tunegate key behind that
prefix (`tml-sk-tg-...`) is authenticated as any other key of a person (same scoping and revocation).
Errors keep OpenAI's envelope; the SDK maps them by status (400 `BadRequestError`, 401, 404 `NotFoundError`).

`estimate_router` is tunegate's own `POST /v1/tinker/estimate` (OpenAI-style, a Bearer key), beside the
fine-tuning jobs' estimate.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Header, Query, Request, Response

from gateway.deps import PrincipalDep, RequestLimitDep, ResourcesDep, authenticate_person, limit_requests
from gateway.errors import AuthenticationFailed
from gateway.tenancy.keys import Principal
from gateway.tinker import billing, estimate, futures, rest, sampling, service, training
from gateway.tinker import protocol as p
from gateway.tinker.billing_protocol import (
    BillingUsageResponse,
    CurrentCheckpointStorageUsageResponse,
    TinkerEstimate,
    TinkerEstimateRequest,
)

router = APIRouter(prefix="/api/v1", tags=["tinker"])

SDK_KEY_PREFIX = "tml-"
MAX_OFFSET = 2**31 - 1
"""Largest `training_runs` offset: more runs than any organisation has, and within what the database's
`OFFSET` takes, so a larger one is refused as the field it is (400 naming `offset`)."""


@dataclass(frozen=True, slots=True)
class TinkerCaller:
    principal: Principal
    key: str = field(repr=False)
    """The tunegate key itself (without `tml-`): sampling calls the chat engines with it."""


async def get_caller(
    res: ResourcesDep,
    x_api_key: Annotated[str | None, Header()] = None,
    authorization: Annotated[str | None, Header()] = None,
) -> TinkerCaller:
    token = x_api_key or (authorization or "").removeprefix("Bearer ").strip()
    if not token:
        raise AuthenticationFailed("You didn't provide an API key (X-API-Key: tml-<your tunegate key>).")
    key = token.removeprefix(SDK_KEY_PREFIX)
    return TinkerCaller(await authenticate_person(res, key), key)


CallerDep = Annotated[TinkerCaller, Depends(get_caller)]


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config")
async def client_config(
    res: ResourcesDep, _: CallerDep, body: p.ClientConfigRequest | None = None
) -> dict[str, Any]:
    return service.client_config(res)


@router.post("/client/dynamic_config")
async def client_dynamic_config(_: CallerDep) -> dict[str, Any]:
    return {}


@router.post("/telemetry")
async def telemetry(_: CallerDep) -> dict[str, str]:
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
async def capabilities(res: ResourcesDep, _: CallerDep) -> dict[str, Any]:
    return service.capabilities(res)


@router.post("/create_session")
async def create_session(res: ResourcesDep, who: CallerDep, body: p.CreateSessionRequest) -> dict[str, Any]:
    return await service.create_session(res, who.principal, body)


@router.post("/session_heartbeat")
async def session_heartbeat(
    res: ResourcesDep, who: CallerDep, body: p.SessionHeartbeatRequest
) -> dict[str, Any]:
    return await service.heartbeat(res, who.principal, body.session_id)


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    res: ResourcesDep, who: CallerDep, session_id: str, body: p.FinishSessionRequest
) -> dict[str, Any]:
    return await service.finish_session(res, who.principal, session_id, body)


@router.post("/create_model")
async def create_model(res: ResourcesDep, who: CallerDep, body: p.CreateModelRequest) -> dict[str, Any]:
    return await training.create_model(res, who.principal, body)


@router.post("/get_info")
async def get_info(res: ResourcesDep, who: CallerDep, body: p.ModelRef) -> dict[str, Any]:
    return await training.get_info(res, who.principal, body.model_id)


@router.post("/forward_backward")
async def forward_backward(res: ResourcesDep, who: CallerDep, request: Request) -> dict[str, Any]:
    return await training.forward_backward(res, who.principal, await request.body())


@router.post("/optim_step")
async def optim_step(res: ResourcesDep, who: CallerDep, body: p.OptimStepRequest) -> dict[str, Any]:
    return await training.optim_step(res, who.principal, body)


@router.post("/save_weights")
async def save_weights(res: ResourcesDep, who: CallerDep, body: p.SaveWeightsRequest) -> dict[str, Any]:
    return await training.save_weights(res, who.principal, body)


@router.post("/save_weights_for_sampler")
async def save_for_sampler(res: ResourcesDep, who: CallerDep, body: p.SaveWeightsRequest) -> dict[str, Any]:
    return await training.save_for_sampler(res, who.principal, body)


@router.post("/load_weights")
async def load_weights(res: ResourcesDep, who: CallerDep, body: p.LoadWeightsRequest) -> dict[str, Any]:
    return await training.load_weights(res, who.principal, body)


@router.post("/create_sampling_session")
async def create_sampler(
    res: ResourcesDep, who: CallerDep, body: p.CreateSamplingSessionRequest
) -> dict[str, Any]:
    return await sampling.create_sampler(res, who.principal, body)


@router.get("/samplers/{sampler_id}")
async def get_sampler(res: ResourcesDep, who: CallerDep, sampler_id: str) -> dict[str, Any]:
    return await sampling.get_sampler(res, who.principal, sampler_id)


@router.post("/asample")
async def asample(res: ResourcesDep, who: CallerDep, body: p.SampleRequest) -> dict[str, Any]:
    return await sampling.sample(res, who.principal, who.key, body)


@router.post("/retrieve_future")
async def retrieve_future(res: ResourcesDep, who: CallerDep, body: p.FutureRetrieveRequest) -> Response:
    content, media_type = await futures.retrieve(res, who.principal, body.request_id)
    return Response(content, media_type=media_type)


@router.post("/cancel_future")
async def cancel_future(res: ResourcesDep, who: CallerDep, body: p.FutureRetrieveRequest) -> dict[str, Any]:
    return await futures.cancel(res, who.principal, body.request_id)


@router.get("/training_runs")
async def training_runs(
    res: ResourcesDep,
    who: CallerDep,
    limit: int = Query(20, ge=1, le=1000),
    offset: int = Query(0, ge=0, le=MAX_OFFSET),
) -> dict[str, Any]:
    return await rest.training_runs(res, who.principal, limit, offset)


@router.get("/training_runs/{model_id}")
async def training_run(res: ResourcesDep, who: CallerDep, model_id: str) -> dict[str, Any]:
    return await rest.training_run(res, who.principal, model_id)


@router.get("/training_runs/{model_id}/checkpoints")
async def run_checkpoints(res: ResourcesDep, who: CallerDep, model_id: str) -> dict[str, Any]:
    return await rest.list_checkpoints(res, who.principal, model_id)


@router.get("/checkpoints")
async def checkpoints(res: ResourcesDep, who: CallerDep) -> dict[str, Any]:
    return await rest.list_checkpoints(res, who.principal, None)


@router.post("/weights_info")
async def weights_info(res: ResourcesDep, who: CallerDep, body: p.WeightsInfoRequest) -> dict[str, Any]:
    return await rest.weights_info(res, who.principal, body.tinker_path)


@router.get("/billing/usage/events")
async def billing_usage(
    res: ResourcesDep, who: CallerDep, starting_on: str, ending_before: str
) -> BillingUsageResponse:
    await limit_requests(res, who.principal)
    return await billing.usage_events(res, who.principal, starting_on, ending_before)


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage(
    res: ResourcesDep, who: CallerDep, project_id: str | None = None
) -> CurrentCheckpointStorageUsageResponse:
    await limit_requests(res, who.principal)
    return await billing.checkpoint_storage(res, who.principal, project_id)


estimate_router = APIRouter(prefix="/v1/tinker", tags=["tinker"], dependencies=[RequestLimitDep])


@estimate_router.post("/estimate")
async def estimate_loop(res: ResourcesDep, who: PrincipalDep, body: TinkerEstimateRequest) -> TinkerEstimate:
    return await estimate.estimate(res, who, body)

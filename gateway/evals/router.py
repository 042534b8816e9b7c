"""Evals API: `/v1/evals`, its runs and their output items."""

from __future__ import annotations

from typing import Annotated, Literal

from fastapi import APIRouter, Query

from gateway.deps import PrincipalDep, RequestLimitDep, ResourcesDep
from gateway.evals import service
from gateway.evals.protocol import (
    Eval,
    EvalCreate,
    EvalDeleted,
    EvalRun,
    EvalRunDeleted,
    EvalUpdate,
    OutputItem,
    RunCreate,
)
from gateway.protocol import CursorPage

router = APIRouter(prefix="/v1/evals", tags=["evals"], dependencies=[RequestLimitDep])

Limit = Annotated[int, Query(ge=1, le=100)]
Order = Literal["asc", "desc"]
RunStatus = Literal["queued", "in_progress", "completed", "canceled", "failed"]
ItemStatus = Literal["pass", "fail", "error"]


@router.post("")
async def create_eval(body: EvalCreate, res: ResourcesDep, who: PrincipalDep) -> Eval:
    return await service.create_eval(res, who, body)


@router.get("")
async def list_evals(
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Limit = 20,
    order: Order = "asc",
    order_by: Literal["created_at", "updated_at"] = "created_at",
) -> CursorPage[Eval]:
    return await service.list_evals(res, who, after=after, limit=limit, order=order, order_by=order_by)


@router.get("/{eval_id}")
async def retrieve_eval(eval_id: str, res: ResourcesDep, who: PrincipalDep) -> Eval:
    return await service.get_eval(res, who, eval_id)


@router.post("/{eval_id}")
async def update_eval(eval_id: str, body: EvalUpdate, res: ResourcesDep, who: PrincipalDep) -> Eval:
    return await service.update_eval(res, who, eval_id, body)


@router.delete("/{eval_id}")
async def delete_eval(eval_id: str, res: ResourcesDep, who: PrincipalDep) -> EvalDeleted:
    return await service.delete_eval(res, who, eval_id)


@router.post("/{eval_id}/runs")
async def create_run(eval_id: str, body: RunCreate, res: ResourcesDep, who: PrincipalDep) -> EvalRun:
    return await service.create_run(res, who, eval_id, body)


@router.get("/{eval_id}/runs")
async def list_runs(
    eval_id: str,
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Limit = 20,
    order: Order = "asc",
    status: RunStatus | None = None,
) -> CursorPage[EvalRun]:
    return await service.list_runs(res, who, eval_id, status=status, after=after, limit=limit, order=order)


@router.get("/{eval_id}/runs/{run_id}")
async def retrieve_run(eval_id: str, run_id: str, res: ResourcesDep, who: PrincipalDep) -> EvalRun:
    return await service.get_run(res, who, eval_id, run_id)


@router.post("/{eval_id}/runs/{run_id}/cancel")
async def cancel_run(eval_id: str, run_id: str, res: ResourcesDep, who: PrincipalDep) -> EvalRun:
    return await service.cancel_run(res, who, eval_id, run_id)


@router.post("/{eval_id}/runs/{run_id}")
async def cancel_run_by_post(eval_id: str, run_id: str, res: ResourcesDep, who: PrincipalDep) -> EvalRun:
    """Cancel, at the REST path OpenAI documents for it (older SDKs post here)."""
    return await service.cancel_run(res, who, eval_id, run_id)


@router.delete("/{eval_id}/runs/{run_id}")
async def delete_run(eval_id: str, run_id: str, res: ResourcesDep, who: PrincipalDep) -> EvalRunDeleted:
    return await service.delete_run(res, who, eval_id, run_id)


@router.get("/{eval_id}/runs/{run_id}/output_items")
async def list_output_items(
    eval_id: str,
    run_id: str,
    res: ResourcesDep,
    who: PrincipalDep,
    after: str | None = None,
    limit: Limit = 20,
    order: Order = "asc",
    status: ItemStatus | None = None,
) -> CursorPage[OutputItem]:
    return await service.list_output_items(
        res, who, eval_id, run_id, status=status, after=after, limit=limit, order=order
    )


@router.get("/{eval_id}/runs/{run_id}/output_items/{output_item_id}")
async def retrieve_output_item(
    eval_id: str, run_id: str, output_item_id: str, res: ResourcesDep, who: PrincipalDep
) -> OutputItem:
    return await service.get_output_item(res, who, eval_id, run_id, output_item_id)

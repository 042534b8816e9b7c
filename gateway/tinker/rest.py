"""Listings (the SDK's `RestClient`): training runs, their checkpoints, and what a checkpoint holds
(`weights_info`); only the caller's organisation's."""

from __future__ import annotations

from typing import Any

from gateway.deps import Resources
from gateway.tenancy.keys import Principal
from gateway.tinker import owned, store
from gateway.tinker.paths import SEGMENT, tinker_path
from gateway.tinker.rows import CheckpointRow, TrainingModelRow


def _checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{SEGMENT[row.kind]}/{row.name}",
        "checkpoint_type": row.kind,
        "time": row.created_at.isoformat(),
        "tinker_path": tinker_path(row.model_id, row.kind, row.name),
        "size_bytes": row.size_bytes,
        "public": False,
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
    }


async def list_checkpoints(res: Resources, who: Principal, model_id: str | None) -> dict[str, Any]:
    if model_id is not None:
        await owned.model(res, who, model_id)
    rows = await store.list_checkpoints(res.pool, org_id=who.organization_id, model_id=model_id)
    return {"checkpoints": [_checkpoint_json(r) for r in rows], "cursor": None}


async def _run_json(res: Resources, who: Principal, row: TrainingModelRow) -> dict[str, Any]:
    ckpts = await store.list_checkpoints(res.pool, org_id=who.organization_id, model_id=row.id)
    last = {kind: next((c for c in ckpts if c.kind == kind), None) for kind in ("training", "sampler")}
    return {
        "training_run_id": row.id,
        "base_model": row.base_model,
        "model_owner": row.organization_id,
        "is_lora": True,
        "corrupted": row.lost is not None,
        "lora_rank": row.lora_rank,
        "last_request_time": row.last_request_at.isoformat(),
        "last_checkpoint": _checkpoint_json(last["training"]) if last["training"] else None,
        "last_sampler_checkpoint": _checkpoint_json(last["sampler"]) if last["sampler"] else None,
        "user_metadata": row.user_metadata,
    }


async def training_run(res: Resources, who: Principal, model_id: str) -> dict[str, Any]:
    return await _run_json(res, who, await owned.model(res, who, model_id))


async def training_runs(res: Resources, who: Principal, limit: int, offset: int) -> dict[str, Any]:
    rows, total = await store.list_models(res.pool, org_id=who.organization_id, limit=limit, offset=offset)
    runs = [await _run_json(res, who, r) for r in rows]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


async def weights_info(res: Resources, who: Principal, path: str) -> dict[str, Any]:
    row = await owned.checkpoint(res, who, path, param="tinker_path")
    config = row.lora_config
    return {
        "base_model": row.base_model,
        "is_lora": True,
        "lora_rank": row.lora_rank,
        "train_mlp": config.get("train_mlp"),
        "train_attn": config.get("train_attn"),
        "train_unembed": False,
    }

"""``GET /v1/models``: the base models and the adapters loaded onto them."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from inference.api.deps import ModelsDep

router = APIRouter()


@router.get("/v1/models")
async def list_models(models: ModelsDep) -> dict[str, Any]:
    return {"object": "list", "data": models.models()}

"""Models API: base models from the registry, and the caller's fine-tuned models.

A fine-tuned model carries, next to OpenAI's fields, `tunegate`: its adapter version and, on each engine of
its base model, whether the engine holds it (asked once a listing: `Engines.held`) and when this gateway last
used it and loaded it (`Engines.residency`; engines by index, never by URL).
"""

from __future__ import annotations

import asyncio
from typing import Literal

from fastapi import APIRouter
from pydantic import Field

from gateway.deps import PrincipalDep, RequestLimitDep, ResourcesDep
from gateway.errors import PermissionDenied, not_found
from gateway.models import store
from gateway.models.store import ModelRow
from gateway.protocol import OpenAIBaseModel
from gateway.serving.engines import Engines
from gateway.serving.service import forget_model
from gateway.timeutil import ts

router = APIRouter(prefix="/v1/models", tags=["models"], dependencies=[RequestLimitDep])


class EngineResidency(OpenAIBaseModel):
    engine: int
    """The engine's index among its base model's engines."""
    loaded: bool
    """Whether the engine holds the version (as it says; as this gateway knows where it does not answer)."""
    last_used: int | None
    """Unix time a request last started on it there (on this gateway)."""
    load_s: float | None
    """Seconds its latest load there took."""


class Serving(OpenAIBaseModel):
    version: str | None
    """The adapter's version id; null until a request first resolves a model written before versions."""
    engines: list[EngineResidency]


class Model(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str
    tunegate: Serving | None = Field(default=None, exclude_if=lambda v: v is None)
    """Only for fine-tuned models."""

    @classmethod
    def from_row(cls, row: ModelRow, engines: Engines, held: dict[str, list[set[str] | None]]) -> Model:
        """The model of `row`; `held`: what each engine of each base model holds (`Engines.held`)."""
        places = (
            engines.residency(row.version, row.base_model, held.get(row.base_model))
            if row.version is not None
            else []
        )
        serving = Serving(
            version=row.version,
            engines=[
                EngineResidency(engine=p.engine, loaded=p.loaded, last_used=p.last_used, load_s=p.load_s)
                for p in places
            ],
        )
        return cls(id=row.id, created=ts(row.created_at) or 0, owned_by=row.organization_id, tunegate=serving)


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[Model]


class ModelDeleted(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    deleted: bool = True


def _base_models(res: ResourcesDep) -> list[Model]:
    started = res.started_at
    return [
        Model(id=name, created=started, owned_by=cfg.owned_by)
        for name, cfg in res.settings.base_models.items()
    ]


@router.get("")
async def list_models(res: ResourcesDep, who: PrincipalDep) -> ModelList:
    own = await store.list_for_org(res.pool, org_id=who.organization_id)
    held = await _held(res.engines, {r.base_model for r in own})
    return ModelList(data=_base_models(res) + [Model.from_row(r, res.engines, held) for r in own])


async def _held(engines: Engines, base_models: set[str]) -> dict[str, list[set[str] | None]]:
    """What the engines of each of `base_models` hold, asked once for all of them."""
    names = sorted(base_models)
    return dict(zip(names, await asyncio.gather(*(engines.held(n) for n in names)), strict=True))


@router.get("/{model_id:path}")
async def retrieve_model(model_id: str, res: ResourcesDep, who: PrincipalDep) -> Model:
    for m in _base_models(res):
        if m.id == model_id:
            return m
    row = await store.get(res.pool, org_id=who.organization_id, model_id=model_id)
    if row is None:
        raise not_found("model", model_id, param="model", code="model_not_found")
    return Model.from_row(row, res.engines, await _held(res.engines, {row.base_model}))


@router.delete("/{model_id:path}")
async def delete_model(model_id: str, res: ResourcesDep, who: PrincipalDep) -> ModelDeleted:
    if model_id in res.settings.base_models:
        raise PermissionDenied(f"Base model '{model_id}' cannot be deleted.", param="model")
    row = await store.delete(res.pool, org_id=who.organization_id, model_id=model_id)
    if row is None:
        raise not_found("model", model_id, param="model", code="model_not_found")
    await forget_model(res, model_id, row.base_model, row.version)  # stops answering, leaves the engines
    return ModelDeleted(id=model_id)

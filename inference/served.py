"""The base models of one engine server and the adapters loaded onto them.

``ServedModels`` holds one ``ModelEngine`` a base model and answers, for a request's ``model`` field, which
engine serves it: a base model by its name, an adapter by the engine it was loaded onto. It lists them all
for ``/v1/models`` and loads and unloads adapters for vLLM's runtime LoRA endpoints, as vLLM's
``OpenAIServingModels`` does. ``inference.server.create_app`` makes it once and puts it on ``app.state``;
the routes of ``inference.api`` take it as a dependency.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from typing import Any

from inference.adapters import read_adapter_config
from inference.engine import ModelEngine
from inference.errors import BadRequestError, ModelNotFoundError, NotFoundError
from inference.options import EngineOptions
from inference.protocol import LoadLoraAdapterRequest, UnloadLoraAdapterRequest

logger = logging.getLogger(__name__)


class ServedModels:
    """The engines of one server, and which of them serves a model or adapter name."""

    def __init__(self, engines: dict[str, ModelEngine]) -> None:
        self.engines = engines
        self.created = int(time.time())

    @classmethod
    def load(cls, models: dict[str, str], options: EngineOptions) -> ServedModels:
        """One engine for each of ``models`` (name -> local Hugging Face directory), each loaded now."""
        if not models:
            raise ValueError("at least one base model is required")
        return cls({name: ModelEngine(name, path, options) for name, path in models.items()})

    def start(self) -> None:
        for engine in self.engines.values():
            engine.start()

    async def stop(self) -> None:
        for engine in self.engines.values():
            await engine.stop()

    def engine_for(self, model: str) -> ModelEngine:
        if model in self.engines:
            return self.engines[model]
        for engine in self.engines.values():
            if engine.registry.get(model) is not None:
                return engine
        raise ModelNotFoundError(model)

    def base_for_adapter(self, req: LoadLoraAdapterRequest) -> ModelEngine:
        if req.base_model_name is not None:
            if req.base_model_name not in self.engines:
                raise NotFoundError(
                    f"The base model `{req.base_model_name}` does not exist.",
                    param="base_model_name",
                    code="model_not_found",
                )
            return self.engines[req.base_model_name]
        config = read_adapter_config(req.lora_path)
        wanted = config.get("base_model_name_or_path")
        if isinstance(wanted, str) and wanted:
            for engine in self.engines.values():
                if wanted in (engine.name, engine.path) or _same_path(wanted, engine.path):
                    return engine
        if len(self.engines) == 1:
            return next(iter(self.engines.values()))
        raise BadRequestError(
            "Cannot tell which base model the adapter belongs to; pass base_model_name.",
            param="base_model_name",
        )

    async def load_adapter(self, req: LoadLoraAdapterRequest) -> None:
        """Load ``req``'s adapter onto its base model's engine (with ``load_inplace``, moved there from
        another engine or replaced in place)."""
        if req.lora_name in self.engines:
            raise BadRequestError(f"'{req.lora_name}' is a base model name.", param="lora_name")
        engine = self.base_for_adapter(req)
        for other in self.engines.values():
            if other is not engine and other.registry.get(req.lora_name) is not None:
                if not req.load_inplace:
                    msg = f"The lora adapter '{req.lora_name}' has already been loaded."
                    raise BadRequestError(msg, param="lora_name")
                await asyncio.to_thread(other.unload_adapter, req.lora_name)
        await asyncio.to_thread(
            engine.load_adapter, req.lora_name, req.lora_path, load_inplace=req.load_inplace
        )

    async def unload_adapter(self, req: UnloadLoraAdapterRequest) -> None:
        """Forget ``req``'s adapter on whichever engine holds it; 404 if none does."""
        for engine in self.engines.values():
            if engine.registry.get(req.lora_name) is not None:
                await asyncio.to_thread(engine.unload_adapter, req.lora_name)
                return
        raise NotFoundError(f"The lora adapter '{req.lora_name}' cannot be found.", param="lora_name")

    def models(self) -> list[dict[str, Any]]:
        """``/v1/models``' entries: each base model, then the adapters known on it."""
        data: list[dict[str, Any]] = []
        for name, engine in self.engines.items():
            data.append(
                {
                    "id": name,
                    "object": "model",
                    "created": self.created,
                    "owned_by": "tunegate",
                    "root": engine.path,
                    "parent": None,
                    "max_model_len": engine.max_context,
                }
            )
            for adapter in engine.registry.known.values():
                data.append(
                    {
                        "id": adapter.name,
                        "object": "model",
                        "created": self.created,
                        "owned_by": "tunegate",
                        "root": adapter.path,
                        "parent": name,
                        "loaded_at": adapter.registered_at,
                    }
                )
        return data

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each base model's ``ModelEngine.stats()``, by name."""
        return {name: engine.stats() for name, engine in self.engines.items()}


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.exists(a) and os.path.samefile(a, b)
    except OSError:
        return False

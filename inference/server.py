"""The engine's HTTP server: OpenAI's chat and completions API plus vLLM's runtime LoRA endpoints.

``create_app({"tiny-chat": "/models/tiny"}, EngineOptions(...))`` loads every base model once
(``inference.served.ServedModels``, put on ``app.state.models``), starts one scheduler per model in the
app's lifespan, and includes the module-level routers of ``inference.api``, which route each request by its
``model`` field to a base model or to one of the LoRA adapters loaded onto it. The contract is vLLM's, so
the gateway drives this engine and ``vllm serve`` alike.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI

from inference.api import generate, health, lora, tokenize
from inference.api import models as model_list
from inference.api.errors import add_error_handlers
from inference.options import EngineOptions
from inference.served import ServedModels

logger = logging.getLogger(__name__)


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Start every engine's scheduler; stop them (and their batches) at shutdown."""
    served: ServedModels = app.state.models
    served.start()
    yield
    await served.stop()


def create_app(models: dict[str, str], options: EngineOptions | None = None) -> FastAPI:
    """The engine app serving ``models`` (name -> local Hugging Face directory) as ``options`` say (the
    defaults of ``EngineOptions`` when not given); each model is loaded here, once."""
    served = ServedModels.load(models, options if options is not None else EngineOptions())
    app = FastAPI(title="tunegate engine", lifespan=lifespan)
    app.state.models = served
    add_error_handlers(app)
    for api in (health, model_list, generate, lora, tokenize):
        app.include_router(api.router)
    return app

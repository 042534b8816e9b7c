"""The engine's HTTP server: OpenAI's chat and completions API plus vLLM's runtime LoRA endpoints.

``create_app({"tiny-chat": "/models/tiny"})`` loads every base model once, starts one scheduler per model in
the app's lifespan, and routes each request by its ``model`` field to a base model or to one of the LoRA
adapters loaded onto it. The contract is vLLM's, so the gateway drives this engine and ``vllm serve`` alike.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.adapters import read_adapter_config
from inference.chat import chat_completion, chat_stream
from inference.completions import completion, completion_stream
from inference.engine import ModelEngine
from inference.errors import BadRequestError, EngineError, ModelNotFoundError, NotFoundError, error_body
from inference.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    LoadLoraAdapterRequest,
    UnloadLoraAdapterRequest,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")


class EngineRouter:
    """The engines of one server, and which of them serves a model or adapter name."""

    def __init__(self, engines: dict[str, ModelEngine]) -> None:
        self.engines = engines
        self.created = int(time.time())

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

    def models(self) -> list[dict[str, Any]]:
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


def _same_path(a: str, b: str) -> bool:
    try:
        return os.path.exists(a) and os.path.samefile(a, b)
    except OSError:
        return False


def _error(exc: EngineError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status_code)


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``, cancelling it if the client goes away first (so the engine stops generating)."""
    task = asyncio.ensure_future(work)
    while True:
        done, _ = await asyncio.wait({task}, timeout=0.25)
        if done:
            return task.result()
        if await request.is_disconnected():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
            raise asyncio.CancelledError("client disconnected")


async def _sse(stream: AsyncGenerator[str, None]) -> Response:
    """Commit to a 200 event stream only once the first chunk exists; later errors become a data event."""
    try:
        first = await anext(stream)
    except EngineError:
        await stream.aclose()
        raise

    async def body() -> AsyncIterator[str]:
        try:
            yield first
            async for line in stream:
                yield line
        except EngineError as exc:
            yield "data: " + json.dumps(error_body(exc)) + "\n\n"
            yield "data: [DONE]\n\n"
        finally:
            await stream.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


def create_app(
    models: dict[str, str],
    *,
    max_loras: int = 8,
    max_batch_size: int = 16,
    device: str = "auto",
    batch_window_s: float = 0.005,
    max_concurrent_batches: int = 4,
    default_max_tokens: int = 1024,
    max_model_len: int | None = None,
) -> FastAPI:
    """The engine app serving ``models`` (name -> local Hugging Face directory), each held to
    ``max_model_len`` tokens of prompt and completion when that is less than its own context."""
    if not models:
        raise ValueError("at least one base model is required")
    engines = {
        name: ModelEngine(
            name,
            path,
            max_loras=max_loras,
            max_batch_size=max_batch_size,
            device=device,
            batch_window_s=batch_window_s,
            max_concurrent_batches=max_concurrent_batches,
            default_max_tokens=default_max_tokens,
            max_model_len=max_model_len,
        )
        for name, path in models.items()
    }
    router = EngineRouter(engines)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        for engine in engines.values():
            engine.start()
        yield
        for engine in engines.values():
            await engine.stop()

    app = FastAPI(title="tunegate engine", lifespan=lifespan)
    app.state.router = router

    @app.exception_handler(EngineError)
    async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
        return _error(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or None
        message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg", exc))
        return _error(BadRequestError(message, param=param))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        err = EngineError(str(exc.detail))
        err.status_code = exc.status_code
        err.error_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
        return _error(err)

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled engine error")
        return _error(EngineError(f"Internal error: {exc}"))

    @app.get("/health")
    async def health() -> Response:
        return Response(status_code=200)

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        return {"object": "list", "data": router.models()}

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatCompletionRequest, request: Request) -> Response | dict[str, Any]:
        engine = router.engine_for(body.model)
        if body.stream:
            return await _sse(chat_stream(engine, body))
        return await _until_disconnect(request, chat_completion(engine, body))

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Response | dict[str, Any]:
        engine = router.engine_for(body.model)
        if body.stream:
            return await _sse(completion_stream(engine, body))
        return await _until_disconnect(request, completion(engine, body))

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest) -> PlainTextResponse:
        if body.lora_name in engines:
            raise BadRequestError(f"'{body.lora_name}' is a base model name.", param="lora_name")
        engine = router.base_for_adapter(body)
        for other in engines.values():
            if other is not engine and other.registry.get(body.lora_name) is not None:
                if not body.load_inplace:
                    msg = f"The lora adapter '{body.lora_name}' has already been loaded."
                    raise BadRequestError(msg, param="lora_name")
                await asyncio.to_thread(other.unload_adapter, body.lora_name)
        await asyncio.to_thread(
            engine.load_adapter, body.lora_name, body.lora_path, load_inplace=body.load_inplace
        )
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest) -> PlainTextResponse:
        for engine in engines.values():
            if engine.registry.get(body.lora_name) is not None:
                await asyncio.to_thread(engine.unload_adapter, body.lora_name)
                return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
        raise NotFoundError(f"The lora adapter '{body.lora_name}' cannot be found.", param="lora_name")

    @app.get("/v1/engine/stats")
    async def stats() -> dict[str, Any]:
        per_model = {name: engine.stats() for name, engine in engines.items()}
        return {
            "running": sum(s["running"] for s in per_model.values()),
            "waiting": sum(s["waiting"] for s in per_model.values()),
            "models": per_model,
        }

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        lines = []
        for name, engine in engines.items():
            s = engine.stats()
            lines.append(f'tunegate_engine_requests_running{{model_name="{name}"}} {s["running"]}')
            lines.append(f'tunegate_engine_requests_waiting{{model_name="{name}"}} {s["waiting"]}')
            lines.append(
                f'tunegate_engine_generation_tokens_total{{model_name="{name}"}} {s["tokens_generated"]}'
            )
            lines.append(
                f'tunegate_engine_loaded_adapters{{model_name="{name}"}} {len(s["loaded_adapters"])}'
            )
            running = ",".join(s["loaded_adapters"])
            lines.append(
                f'vllm:lora_requests_info{{model_name="{name}",running_lora_adapters="{running}",'
                f'waiting_lora_adapters="",max_lora="{s["max_loras"]}"}} 1'
            )
        return PlainTextResponse("\n".join(lines) + "\n")

    return app

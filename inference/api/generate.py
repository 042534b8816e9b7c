"""``POST /v1/chat/completions`` and ``POST /v1/completions``: a whole answer as JSON, or server-sent events.

A stream commits to a 200 only once its first chunk exists, so a request the engine refuses (an unknown
adapter, a prompt over the context) is still an error status; an error after that is a last data event.
A whole answer is cancelled when the client goes away before it, so the engine stops generating it.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import Response, StreamingResponse

from inference.api.deps import ModelsDep
from inference.chat import chat_completion, chat_stream
from inference.chunks import DONE, event
from inference.completions import completion, completion_stream
from inference.errors import EngineError, error_body
from inference.protocol import ChatCompletionRequest, CompletionRequest

router = APIRouter()

T = TypeVar("T")


@router.post("/v1/chat/completions", response_model=None)
async def chat(body: ChatCompletionRequest, request: Request, models: ModelsDep) -> Response | dict[str, Any]:
    engine = models.engine_for(body.model)
    if body.stream:
        return await _sse(chat_stream(engine, body))
    return await _until_disconnect(request, chat_completion(engine, body))


@router.post("/v1/completions", response_model=None)
async def completions(
    body: CompletionRequest, request: Request, models: ModelsDep
) -> Response | dict[str, Any]:
    engine = models.engine_for(body.model)
    if body.stream:
        return await _sse(completion_stream(engine, body))
    return await _until_disconnect(request, completion(engine, body))


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
            yield event(error_body(exc))
            yield DONE
        finally:
            await stream.aclose()

    return StreamingResponse(body(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

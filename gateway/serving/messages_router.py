"""Anthropic's Messages API (`POST /v1/messages`) on base and fine-tuned models.

A request is translated into a chat completion (`gateway.serving.anthropic`) and served by the chat path
itself (`gateway.serving.bridge`): model resolution, limits, budgets, metering and capture are chat's. The
key comes as Anthropic's SDK sends it (`x-api-key`) or as a bearer token; errors on this route are
Anthropic's shape (`{"type": "error", "error": {...}}`, OpenAI's fields inside).

`POST /v1/messages/count_tokens` answers `{"input_tokens": N}`: the request rendered as its chat completion
would be, counted by an engine of the model's base (its `/tokenize`), neither metered nor billed.
"""

from __future__ import annotations

from typing import Any

import orjson
from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Message, Receive, Scope, Send

from gateway.deps import Resources
from gateway.errors import AuthenticationFailed, as_api_error
from gateway.serving import anthropic, bridge, service
from gateway.serving.engines import Target
from gateway.serving.protocol import json_object
from gateway.tenancy.keys import Principal, bearer_token

router = APIRouter(prefix="/v1", tags=["messages"])


def _headers(scope: Scope) -> list[tuple[bytes, bytes]]:
    """The request's headers with the key as a bearer token (Anthropic's SDK sends it as `x-api-key`)."""
    headers: list[tuple[bytes, bytes]] = scope["headers"]
    if bridge.header(scope, b"authorization") is not None:
        return headers
    key = bridge.header(scope, b"x-api-key")
    if key is None:
        raise AuthenticationFailed(
            "You didn't provide an API key. Provide it in the x-api-key header or as a Bearer token."
        )
    return [*headers, (b"authorization", b"Bearer " + key.strip().encode("latin-1"))]


class _Messages(Response):
    """The answer of `POST /v1/messages`, served as ASGI (the body is read here, not by FastAPI)."""

    def __init__(self, count: bool = False) -> None:
        super().__init__()
        self.count = count
        """`POST /v1/messages/count_tokens`: the request's input tokens, not its answer."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = True
            await send(message)

        try:
            res: Resources = scope["app"].state.resources
            body = await bridge.read_body(receive)
            headers = _headers(scope)
            who = await res.auth.authenticate(
                bearer_token(bridge.header({"headers": headers}, b"authorization"))
            )
            request = json_object(body)
            if self.count:
                out = orjson.dumps({"input_tokens": await _count(res, who, request)})
                await send(bridge.json_start(200, [], len(out)))
                await send({"type": "http.response.body", "body": out})
                return
            chat = anthropic.to_chat(request)
            translator = anthropic.MessagesTranslator(request)
            await bridge.serve_as_chat(scope, receive, tracked, chat, translator, headers=headers)
        except Exception as exc:
            if started:
                raise
            error = as_api_error(exc, "POST", scope["path"])
            out = orjson.dumps(anthropic.api_error_body(error))
            head = [(k.encode(), v.encode()) for k, v in error.headers.items()]
            await send(bridge.json_start(error.status, head, len(out)))
            await send({"type": "http.response.body", "body": out})


@router.post("/messages", response_model=None)
async def create_message(request: Request) -> Response:
    return _Messages()


@router.post("/messages/count_tokens", response_model=None)
async def count_tokens(request: Request) -> Response:
    return _Messages(count=True)


async def _count(res: Resources, who: Principal, request: dict[str, Any]) -> int:
    """The input tokens of a Messages request on its model, counted by an engine of its base model."""
    chat = anthropic.to_chat({**request, "max_tokens": 1})
    target = await service.resolve(res, who, str(chat.get("model") or ""))
    body = {"model": target.base_model, "messages": chat["messages"]}
    if chat.get("tools"):
        body["tools"] = chat["tools"]
    return await service.count_tokens(res, Target(target.model_id, target.base_model), orjson.dumps(body))

"""OpenAI's Responses API (`POST /v1/responses`) on base and fine-tuned models.

A request is translated into a chat completion (`gateway.serving.responses`; its answer back by
`gateway.serving.responses_answer`) and served by the chat path itself (`gateway.serving.bridge`):
authentication, model resolution, limits, budgets, metering and capture are chat's. Errors are OpenAI's
envelope, as on every route.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from gateway.deps import Resources
from gateway.serving import bridge, responses
from gateway.serving.protocol import json_object
from gateway.serving.responses_answer import ResponsesTranslator
from gateway.tenancy.keys import bearer_token

router = APIRouter(prefix="/v1", tags=["responses"])


class _Responses(Response):
    """The answer of `POST /v1/responses`, served as ASGI (the body is read here, not by FastAPI)."""

    def __init__(self) -> None:
        super().__init__()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        res: Resources = scope["app"].state.resources
        body = await bridge.read_body(receive)
        await res.auth.authenticate(bearer_token(bridge.header(scope, b"authorization")))  # 401 before 400
        request = json_object(body)
        chat = responses.to_chat(request)
        await bridge.serve_as_chat(scope, receive, send, chat, ResponsesTranslator(request))


@router.post("/responses", response_model=None)
async def create_response(request: Request) -> Response:
    return _Responses()

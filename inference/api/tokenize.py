"""``POST /tokenize``, as vLLM's: the token ids a prompt comes to, for a chat (``messages``, with ``tools``,
``chat_template`` and ``chat_template_kwargs``, rendered exactly as a chat completion renders them) or a
text (``prompt``). The answer is ``{count, max_model_len, tokens}``."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter

from inference.api.deps import ModelsDep
from inference.chat import prepare_chat
from inference.errors import BadRequestError
from inference.protocol import ChatCompletionRequest, OpenAIBaseModel

router = APIRouter()


class TokenizeRequest(OpenAIBaseModel):
    """vLLM's two tokenize requests in one: ``messages`` (a chat) or ``prompt`` (a text)."""

    model: str
    messages: list[dict[str, Any]] | None = None
    prompt: str | None = None
    tools: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, models: ModelsDep) -> dict[str, Any]:
    engine = models.engine_for(body.model)
    if body.messages is not None:
        if not body.add_generation_prompt:
            raise BadRequestError(
                "This engine renders a chat with its generation prompt only.", param="add_generation_prompt"
            )
        chat = ChatCompletionRequest.model_validate(
            body.model_dump(
                include={"model", "messages", "tools", "chat_template", "chat_template_kwargs"},
                exclude_none=True,
            )
        )
        _, ids = await prepare_chat(engine, chat)
    elif body.prompt is not None:
        engine.check_prompt_chars(len(body.prompt), "prompt")
        ids = await engine.encode_async(body.prompt, add_special_tokens=body.add_special_tokens)
    else:
        raise BadRequestError("Give the messages or the prompt to tokenize.", param="messages")
    return {"count": len(ids), "max_model_len": engine.max_context, "tokens": ids}

"""``/v1/chat/completions``: prompt rendering, tool calls, and OpenAI's response and chunk shapes.

Messages and tools go through the model's own chat template (``apply_chat_template(tools=...)``). Tool
calls follow the Qwen/Hermes convention the templates use:
``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` in the output becomes ``tool_calls``. When
``tool_choice`` forces a call (``"required"`` or a named function) the generation is prefixed with
``<tool_call>\\n{"name": "<fn>", "arguments": `` so that even a weak model produces a well-formed call:
only the arguments are generated, and they become ``{}`` if they do not parse as a JSON object. A call
forced by a named function ends with ``finish_reason: "stop"``, as OpenAI's API and vLLM answer (the client
named the function, so the call is the answer it asked for); ``"required"`` and calls the model chose end
with ``"tool_calls"``. ``response_format`` ``json_object`` is served the same way, best effort: the output
is started with ``{`` and ends as soon as the object is complete.

``return_token_ids`` (vLLM's extra parameter, which the gateway's capture asks for) adds the prompt's token
ids (``prompt_token_ids``: everything the model was conditioned on, a forced prefix included) and each
choice's sampled ids (``token_ids``) to the answer; in a stream the first chunk carries ``prompt_token_ids``
and each chunk the ids it adds, so a stream's ids are the whole answer's.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
from collections.abc import AsyncGenerator
from dataclasses import dataclass, field
from typing import Any

from inference.chunks import DONE, ChunkStream, answer, answer_id
from inference.engine import INLINE_TOKENIZE_CHARS, ChoiceEvent, GenerationRequest, ModelEngine
from inference.errors import BadRequestError
from inference.protocol import ChatCompletionRequest
from inference.sampling import TokenLogprob

logger = logging.getLogger(__name__)

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def split_tool_calls(text: str) -> tuple[list[str], str]:
    """The bodies of the ``<tool_call>...</tool_call>`` blocks in ``text`` (stripped; an unclosed last
    block runs to the end), and the text outside them. One pass: the equivalent lazy regex tries the rest
    of the text from every opening that is never closed, which is quadratic in the output's length."""
    bodies: list[str] = []
    outside: list[str] = []
    pos = 0
    while (start := text.find(TOOL_CALL_OPEN, pos)) >= 0:
        outside.append(text[pos:start])
        end = text.find(TOOL_CALL_CLOSE, start + len(TOOL_CALL_OPEN))
        if end < 0:
            bodies.append(text[start + len(TOOL_CALL_OPEN) :].strip())
            pos = len(text)
            break
        bodies.append(text[start + len(TOOL_CALL_OPEN) : end].strip())
        pos = end + len(TOOL_CALL_CLOSE)
    outside.append(text[pos:])
    return bodies, "".join(outside)


def _json_complete(text: str) -> bool:
    """True once ``text`` holds a complete JSON value, or cannot start a JSON object any more."""
    stripped = text.lstrip()
    if not stripped:
        return False
    if stripped[0] != "{":
        return True
    try:
        json.JSONDecoder().raw_decode(stripped)
    except ValueError:
        return False
    return True


def _parse_object(text: str) -> dict[str, Any] | None:
    stripped = text.lstrip()
    try:
        value, _ = json.JSONDecoder().raw_decode(stripped)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


def _normalise_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages the chat template can render: text content, ``developer`` as ``system``, dict arguments."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        role = message.get("role")
        if role not in ("system", "developer", "user", "assistant", "tool", "function"):
            raise BadRequestError(f"Invalid role {role!r}.", param=f"messages[{i}].role")
        msg = dict(message)
        msg["role"] = {"developer": "system", "function": "tool"}.get(role, role)
        content = msg.get("content")
        if isinstance(content, list):
            msg["content"] = "".join(
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and part.get("type") == "text"
            )
        elif content is None:
            msg["content"] = ""
        calls = msg.get("tool_calls")
        if calls:
            fixed = []
            for call in calls:
                call = dict(call)
                fn = dict(call.get("function") or {})
                if isinstance(fn.get("arguments"), str):
                    fn["arguments"] = _parse_object(fn["arguments"]) or {}
                call["function"] = fn
                fixed.append(call)
            msg["tool_calls"] = fixed
        out.append(msg)
    return out


@dataclass
class ChatPlan:
    """How a chat request is generated and how its output is read back."""

    prompt: str
    prefix: str = ""
    """Text the generation was forced to start with (part of the prompt)."""
    forced_tool: str | None = None
    named_tool: bool = False
    """``forced_tool`` was named by ``tool_choice`` (not chosen by ``"required"``): the call ends with
    ``stop``."""
    parse_tools: bool = False
    json_mode: bool = False


@dataclass
class _Choice:
    text: str = ""
    tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None


_RESERVED_TEMPLATE_VARIABLES = frozenset(
    {"messages", "tools", "add_generation_prompt", "tokenize", "chat_template", "conversation", "documents"}
)


def _template_variables(given: dict[str, Any] | None) -> dict[str, Any]:
    """``chat_template_kwargs`` for the template; a 400 for one that would replace an argument of its own."""
    for name in given or {}:
        if name in _RESERVED_TEMPLATE_VARIABLES or not name.isidentifier():
            raise BadRequestError(
                f"chat_template_kwargs may not set '{name}'.", param=f"chat_template_kwargs.{name}"
            )
    return dict(given or {})


def plan_chat(engine: ModelEngine, req: ChatCompletionRequest) -> ChatPlan:
    """Render the prompt and decide on forced prefixes."""
    messages = _normalise_messages(req.messages)
    tools: list[Any] | None = list(req.tools or []) if req.tools_enabled() else None
    try:
        prompt = engine.tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=False,
            chat_template=req.chat_template,
            **_template_variables(req.chat_template_kwargs),
        )
    except Exception as exc:
        raise BadRequestError(f"Cannot render the chat template: {exc}", param="messages") from exc
    forced = req.forced_tool()
    plan = ChatPlan(prompt=str(prompt), parse_tools=tools is not None)
    if forced is not None:
        plan.forced_tool = forced
        plan.named_tool = isinstance(req.tool_choice, dict)
        plan.prefix = '<tool_call>\n{"name": "' + forced + '", "arguments": '
    elif req.wants_json() and tools is None:
        plan.json_mode = True
        plan.prefix = "{"
    return plan


def content_chars(messages: list[dict[str, Any]]) -> int:
    """Characters of the messages' text contents, which the chat template writes into the prompt: the
    least the prompt holds, counted without rendering anything."""
    chars = 0
    for message in messages:
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            chars += len(content)
        elif isinstance(content, list):
            for part in content:
                text = part.get("text") if isinstance(part, dict) else None
                chars += len(text) if isinstance(text, str) else 0
    return chars


def _render(engine: ModelEngine, req: ChatCompletionRequest) -> tuple[ChatPlan, list[int]]:
    plan = plan_chat(engine, req)
    text = plan.prompt + plan.prefix
    engine.check_prompt_chars(len(text), "messages")  # tools are written into the prompt too
    return plan, engine.encode(text, add_special_tokens=False)


async def prepare_chat(engine: ModelEngine, req: ChatCompletionRequest) -> tuple[ChatPlan, list[int]]:
    """The plan and the prompt's token ids: refused by length alone when the messages cannot fit the
    context, rendered and tokenized on a thread when they are long."""
    chars = content_chars(req.messages)
    engine.check_prompt_chars(chars, "messages")
    if chars <= INLINE_TOKENIZE_CHARS and not req.tools:
        return _render(engine, req)
    return await asyncio.to_thread(_render, engine, req)


def submit_chat(
    engine: ModelEngine, req: ChatCompletionRequest, plan: ChatPlan, ids: list[int]
) -> GenerationRequest:
    gen = GenerationRequest(
        prompt_ids=list(ids), params=req.to_sampling_params(engine.default_max_tokens), n=req.n
    )
    gen.adapter = engine.resolve(req.model)
    if plan.forced_tool is not None:
        gen.stop_check = _json_complete
    elif plan.json_mode:
        gen.stop_check = lambda text: _json_complete("{" + text)
    return engine.submit(gen)


def _call_id() -> str:
    return "call_" + secrets.token_hex(12)


def finish_choice(plan: ChatPlan, choice: _Choice) -> tuple[dict[str, Any], str]:
    """The assistant message of a finished choice, and its finish reason."""
    reason = choice.finish_reason or "stop"
    if plan.forced_tool is not None:
        forced_args = _parse_object(choice.text) or {}
        call = {
            "id": _call_id(),
            "type": "function",
            "function": {"name": plan.forced_tool, "arguments": json.dumps(forced_args)},
        }
        reason = "stop" if plan.named_tool else "tool_calls"
        return {"role": "assistant", "content": None, "refusal": None, "tool_calls": [call]}, reason
    if plan.parse_tools and "<tool_call>" in choice.text:
        calls = []
        bodies, outside = split_tool_calls(choice.text)
        for body in bodies:
            obj = _parse_object(body)
            if obj is None or not isinstance(obj.get("name"), str):
                continue
            args: Any = obj.get("arguments")
            if isinstance(args, str):
                args = _parse_object(args)
            calls.append(
                {
                    "id": _call_id(),
                    "type": "function",
                    "function": {
                        "name": obj["name"],
                        "arguments": json.dumps(args if isinstance(args, dict) else {}),
                    },
                }
            )
        if calls:
            content = outside.strip() or None
            return {
                "role": "assistant",
                "content": content,
                "refusal": None,
                "tool_calls": calls,
            }, "tool_calls"
    text = plan.prefix + choice.text if plan.json_mode else choice.text
    return {"role": "assistant", "content": text, "refusal": None}, reason


def logprobs_content(engine: ModelEngine, entries: list[TokenLogprob]) -> list[dict[str, Any]]:
    """OpenAI's chat ``logprobs.content`` items."""

    def one(token_id: int, logprob: float) -> dict[str, Any]:
        token = engine.decode([token_id], skip_special_tokens=False)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    out = []
    for entry in entries:
        item = one(entry.token_id, entry.logprob)
        item["top_logprobs"] = [one(t, lp) for t, lp in entry.top]
        out.append(item)
    return out


async def chat_completion(engine: ModelEngine, req: ChatCompletionRequest) -> dict[str, Any]:
    """A whole ``chat.completion`` object."""
    plan, ids = await prepare_chat(engine, req)
    gen = submit_chat(engine, req, plan, ids)
    choices = [_Choice() for _ in range(req.n)]
    try:
        async for event in gen.events():
            _accumulate(choices[event.index], event)
    finally:
        engine.cancel(gen)
    out_choices = []
    for i, choice in enumerate(choices):
        message, reason = finish_choice(plan, choice)
        lp = {"content": logprobs_content(engine, choice.logprobs), "refusal": None} if req.logprobs else None
        out_choice = {"index": i, "message": message, "finish_reason": reason, "logprobs": lp}
        if req.return_token_ids:
            out_choice["token_ids"] = choice.token_ids
        out_choices.append(out_choice)
    completion = sum(c.tokens for c in choices)
    out = answer("chat.completion", "chatcmpl-", req.model, out_choices, len(gen.prompt_ids), completion)
    if req.return_token_ids:
        out["prompt_token_ids"] = list(gen.prompt_ids)
    return out


def _accumulate(choice: _Choice, event: ChoiceEvent) -> None:
    choice.text += event.text
    choice.tokens += len(event.token_ids)
    choice.token_ids.extend(event.token_ids)
    choice.logprobs.extend(event.logprobs)
    if event.finish_reason is not None:
        choice.finish_reason = event.finish_reason


async def chat_stream(engine: ModelEngine, req: ChatCompletionRequest) -> AsyncGenerator[str, None]:
    """``chat.completion.chunk`` SSE lines; the first is yielded only once the engine produced output."""
    plan, ids = await prepare_chat(engine, req)
    gen = submit_chat(engine, req, plan, ids)
    chunks = ChunkStream("chat.completion.chunk", req.model, req.include_usage(), answer_id("chatcmpl-"))
    buffered = plan.parse_tools
    choices = [_Choice() for _ in range(req.n)]

    ids_asked = req.return_token_ids
    prompt_ids = {"prompt_token_ids": list(gen.prompt_ids)} if ids_asked else None

    def chunk(
        index: int,
        delta: dict[str, Any],
        finish: str | None = None,
        lp: Any = None,
        token_ids: list[int] | None = None,
    ) -> str:
        piece = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        if ids_asked:
            piece["token_ids"] = token_ids or []
        return chunks.choice(piece)

    try:
        started = [False] * req.n
        async for event in gen.events():
            choice = choices[event.index]
            _accumulate(choice, event)
            out = []
            if not started[event.index]:
                started[event.index] = True
                if prompt_ids is not None:  # the first chunk of the stream carries the prompt's ids
                    role = {"index": event.index, "delta": {"role": "assistant", "content": ""}}
                    piece = {**role, "logprobs": None, "finish_reason": None, "token_ids": []}
                    out.append(chunks.choice(piece, prompt_ids))
                    prompt_ids = None
                else:
                    out.append(chunk(event.index, {"role": "assistant", "content": ""}))
                if plan.json_mode:
                    out.append(chunk(event.index, {"content": plan.prefix}))
            if buffered:
                if event.finish_reason is not None:
                    message, reason = finish_choice(plan, choice)
                    lp = None
                    if req.logprobs:
                        lp = {"content": logprobs_content(engine, choice.logprobs), "refusal": None}
                    delta: dict[str, Any] = {}
                    if message.get("content"):
                        delta["content"] = message["content"]
                    if message.get("tool_calls"):
                        delta["tool_calls"] = [
                            {"index": k, **call} for k, call in enumerate(message["tool_calls"])
                        ]
                    out.append(chunk(event.index, delta, lp=lp, token_ids=choice.token_ids))
                    out.append(chunk(event.index, {}, reason))
            else:
                ids = event.token_ids
                if event.text or event.logprobs:
                    lp = None
                    if req.logprobs:
                        lp = {"content": logprobs_content(engine, event.logprobs), "refusal": None}
                    out.append(chunk(event.index, {"content": event.text}, lp=lp, token_ids=ids))
                    ids = []
                if event.finish_reason is not None:
                    out.append(chunk(event.index, {}, event.finish_reason, token_ids=ids))
                elif ids_asked and ids:  # tokens whose text is held back: their ids go out now
                    out.append(chunk(event.index, {"content": ""}, token_ids=ids))
            for line in out:
                yield line
        if chunks.include_usage:
            yield chunks.usage(len(gen.prompt_ids), sum(c.tokens for c in choices))
        yield DONE
    finally:
        engine.cancel(gen)

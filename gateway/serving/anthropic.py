"""Anthropic's Messages API as a chat completion: the request translated into one (`to_chat`), the answer,
its stream and its errors translated back (`MessagesTranslator`, for `gateway.serving.bridge`).

Supported: `model`, `max_tokens` (required), `system` (a string or text blocks), `messages` (string content,
or blocks: `text`, `tool_use` in assistant turns, `tool_result` in user turns; `thinking` blocks handed
back are dropped), `stop_sequences`, `temperature`, `top_p`, `top_k`, `tools` (client tools, as chat
functions), `tool_choice` (auto, any, tool, none), `metadata.user_id` (as chat's `user`) and `stream`. Images,
documents and Anthropic's server tools are a 400 naming the field. `thinking` is accepted and ignored (the
models served here do not think in blocks).

Errors are Anthropic's shape with OpenAI's fields inside: `{"type": "error", "error": {"type":
"invalid_request_error" | "authentication_error" | ..., "message", "param", "code"}}`. A tool call's id is the
engine's, kept as the `tool_use` block's id, so a `tool_result` names it back. `stop_sequence` is told where
the engine reports which stop string ended the answer (vLLM's `stop_reason`); else a stop is `end_turn`.
"""

from __future__ import annotations

import json
import time
from typing import Any

import orjson

from gateway.errors import APIError, InvalidRequest
from gateway.serving.bridge import sse

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    402: "billing_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}
"""Anthropic's error type of each status (any other: `invalid_request_error` below 500, else `api_error`)."""
PARAMS = {"max_tokens": "max_tokens", "messages": "messages", "stop": "stop_sequences"}
STOP_REASONS = {
    "stop": "end_turn",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def error_type(status: int) -> str:
    return ERROR_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")


def error_body(status: int, body: Any) -> dict[str, Any]:
    """An error answer (OpenAI's envelope) in Anthropic's shape."""
    err = body.get("error") if isinstance(body, dict) else None
    err = err if isinstance(err, dict) else {"message": str(body)}
    return {
        "type": "error",
        "error": {
            "type": error_type(status),
            "message": err.get("message", ""),
            "param": err.get("param"),
            "code": err.get("code"),
        },
    }


def api_error_body(exc: APIError) -> dict[str, Any]:
    return error_body(exc.status, exc.body())


def _invalid(param: str, message: str, code: str = "invalid_value") -> InvalidRequest:
    return InvalidRequest(message, param=param, code=code)


def _blocks(content: Any, param: str) -> list[dict[str, Any]]:
    """A message's content as blocks (a string is one text block)."""
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list):
        raise _invalid(param, f"{param}: expected a string or a list of content blocks.")
    for j, block in enumerate(content):
        if not isinstance(block, dict) or not isinstance(block.get("type"), str):
            raise _invalid(f"{param}[{j}]", f"{param}[{j}]: expected a content block with a type.")
    return content


def _block_text(block: dict[str, Any], param: str) -> str:
    text = block.get("text")
    if not isinstance(text, str):
        raise _invalid(f"{param}.text", f"{param}.text: expected a string.")
    return text


def _result_text(content: Any, param: str) -> str:
    if content is None:
        return ""
    texts = []
    for j, block in enumerate(_blocks(content, param)):
        if block["type"] != "text":
            raise _invalid(
                f"{param}[{j}].type",
                f"{param}[{j}]: tool results of type '{block['type']}' are not supported; text is.",
                "unsupported_value",
            )
        texts.append(_block_text(block, f"{param}[{j}]"))
    return "".join(texts)


def _message(message: Any, i: int) -> list[dict[str, Any]]:
    """One Anthropic message as chat messages (a user turn's tool results become tool messages, first)."""
    param = f"messages[{i}]"
    if not isinstance(message, dict):
        raise _invalid(param, f"{param}: expected an object.")
    role = message.get("role")
    if role not in ("user", "assistant"):
        raise _invalid(f"{param}.role", f"{param}.role: expected 'user' or 'assistant'.")
    texts: list[str] = []
    calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for j, block in enumerate(_blocks(message.get("content"), f"{param}.content")):
        where, kind = f"{param}.content[{j}]", block["type"]
        if kind == "text":
            texts.append(_block_text(block, where))
        elif kind in ("thinking", "redacted_thinking"):
            continue
        elif kind == "tool_use" and role == "assistant":
            if not isinstance(block.get("id"), str) or not isinstance(block.get("name"), str):
                raise _invalid(where, f"{where}: a tool_use block needs an id and a name.")
            arguments = json.dumps(block.get("input") or {}, ensure_ascii=False)  # as models write JSON
            calls.append(
                {
                    "id": block["id"],
                    "type": "function",
                    "function": {"name": block["name"], "arguments": arguments},
                }
            )
        elif kind == "tool_result" and role == "user":
            if not isinstance(block.get("tool_use_id"), str):
                raise _invalid(f"{where}.tool_use_id", f"{where}.tool_use_id: expected a string.")
            text = _result_text(block.get("content"), f"{where}.content")
            results.append({"role": "tool", "tool_call_id": block["tool_use_id"], "content": text})
        else:
            raise _invalid(
                f"{where}.type",
                f"{where}: content blocks of type '{kind}' are not supported in {role} messages here.",
                "unsupported_value",
            )
    out = results
    if role == "assistant":
        body: dict[str, Any] = {
            "role": "assistant",
            "content": "".join(texts) if texts or not calls else None,
        }
        if calls:
            body["tool_calls"] = calls
        out.append(body)
    elif texts or not results:
        out.append({"role": "user", "content": "".join(texts)})
    return out


def _system(system: Any) -> str:
    if isinstance(system, str):
        return system
    if isinstance(system, list):
        texts = []
        for j, block in enumerate(system):
            if not isinstance(block, dict) or block.get("type") != "text":
                raise _invalid(f"system[{j}]", f"system[{j}]: expected a text block.")
            texts.append(_block_text(block, f"system[{j}]"))
        return "\n".join(texts)
    raise _invalid("system", "system: expected a string or a list of text blocks.")


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise _invalid("tools", "tools: expected a list.")
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") not in (None, "custom"):
            kind = tool.get("type") if isinstance(tool, dict) else None
            raise _invalid(
                f"tools[{i}].type",
                f"tools[{i}]: tools of type '{kind}' are not supported; client tools are.",
                "unsupported_value",
            )
        if not isinstance(tool.get("name"), str):
            raise _invalid(
                f"tools[{i}].name", f"tools[{i}].name: Field required.", "missing_required_parameter"
            )
        fn: dict[str, Any] = {"name": tool["name"]}  # in chat's order: templates render tools as given
        if isinstance(tool.get("description"), str):
            fn["description"] = tool["description"]
        fn["parameters"] = tool.get("input_schema") or {"type": "object"}
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind in ("auto", "none"):
        return kind
    if kind == "any":
        return "required"
    if kind == "tool" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _invalid("tool_choice", "tool_choice: expected a type of auto, any, tool (with a name) or none.")


def to_chat(body: dict[str, Any]) -> dict[str, Any]:
    """The chat completion request of a Messages request body, or a 400 naming the field at fault."""
    most = body.get("max_tokens")
    if most is None:
        raise _invalid("max_tokens", "max_tokens: Field required", "missing_required_parameter")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        code = "invalid_value" if "messages" in body else "missing_required_parameter"
        raise _invalid("messages", "messages: expected a non-empty list of messages.", code)
    chat_messages: list[dict[str, Any]] = []
    if body.get("system") is not None:
        chat_messages.append({"role": "system", "content": _system(body["system"])})
    for i, message in enumerate(messages):
        chat_messages.extend(_message(message, i))
    chat: dict[str, Any] = {"model": body.get("model"), "messages": chat_messages, "max_tokens": most}
    for ours, theirs in (("temperature", "temperature"), ("top_p", "top_p"), ("top_k", "top_k")):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    stops = body.get("stop_sequences")
    if stops:
        if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
            raise _invalid("stop_sequences", "stop_sequences: expected a list of strings.")
        chat["stop"] = stops
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        choice = _tool_choice(body["tool_choice"])
        if body.get("tools") or choice == "none":
            chat["tool_choice"] = choice
    metadata = body.get("metadata")
    if isinstance(metadata, dict) and isinstance(metadata.get("user_id"), str):
        chat["user"] = metadata["user_id"]
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _suffix(chat_id: Any) -> str:
    return str(chat_id or "").removeprefix("chatcmpl-") or str(int(time.time() * 1000))


def _input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as the `input` object (arguments that are not a JSON object: `{}`)."""
    try:
        value = orjson.loads(arguments or "{}")
    except orjson.JSONDecodeError:
        return {}
    return value if isinstance(value, dict) else {}


class MessagesTranslator:
    """The chat path's answers as the Messages API's (`gateway.serving.bridge.Translator`)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        stops = body.get("stop_sequences")
        self.stops: list[str] = stops if isinstance(stops, list) else []
        # the stream's state
        self.started = False
        self.suffix = ""
        self.blocks = 0
        self.open: str | None = None
        """The type of the content block being streamed ("text", "tool_use"), or None."""
        self.calls: dict[int, int] = {}
        """Tool calls of the chat stream (by index) and their block's index."""
        self.finish_reason: Any = None
        self.stop_string: Any = None
        self.saw_calls = False
        self.usage: dict[str, Any] = {}

    def _stop(self, finish_reason: Any, stop_string: Any, has_calls: bool) -> tuple[str, str | None]:
        if has_calls and finish_reason in ("stop", "tool_calls"):
            return "tool_use", None
        if finish_reason == "stop" and isinstance(stop_string, str) and stop_string in self.stops:
            return "stop_sequence", stop_string
        return STOP_REASONS.get(finish_reason, "end_turn"), None

    def _message(self, suffix: str, content: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "id": f"msg_{suffix}",
            "type": "message",
            "role": "assistant",
            "model": self.body.get("model"),
            "content": content,
            "stop_reason": None,
            "stop_sequence": None,
            "usage": {"input_tokens": 0, "output_tokens": 0},
        }

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        choices = chat.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        content: list[dict[str, Any]] = []
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            content.append({"type": "text", "text": message.get("content") or ""})
        for call in calls:
            fn = call.get("function") or {}
            content.append(
                {
                    "type": "tool_use",
                    "id": call.get("id"),
                    "name": fn.get("name"),
                    "input": _input(str(fn.get("arguments") or "")),
                }
            )
        out = self._message(_suffix(chat.get("id")), content)
        out["stop_reason"], out["stop_sequence"] = self._stop(
            choice.get("finish_reason"), choice.get("stop_reason"), bool(calls)
        )
        usage = chat.get("usage") or {}
        out["usage"] = {
            "input_tokens": int(usage.get("prompt_tokens") or 0),
            "output_tokens": int(usage.get("completion_tokens") or 0),
        }
        return out

    def error(self, status: int, body: Any) -> Any:
        out = error_body(status, body)
        if out["error"]["param"] == "stop":
            out["error"]["param"] = "stop_sequences"
        return out

    # ---- a stream ---------------------------------------------------------------------------------------
    def _close(self) -> list[bytes]:
        if self.open is None:
            return []
        self.open = None
        return [sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def _start_block(self, block: dict[str, Any]) -> list[bytes]:
        out = self._close()
        self.open = block["type"]
        self.blocks += 1
        out.append(
            sse(
                "content_block_start",
                {"type": "content_block_start", "index": self.blocks - 1, "content_block": block},
            )
        )
        return out

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return sse("content_block_delta", {"type": "content_block_delta", "index": index, "delta": delta})

    def event(self, chunk: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        if not self.started:
            self.started = True
            self.suffix = _suffix(chunk.get("id"))
            out.append(
                sse("message_start", {"type": "message_start", "message": self._message(self.suffix, [])})
            )
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            piece = delta.get("content")
            if isinstance(piece, str) and piece:
                if self.open != "text":
                    out += self._start_block({"type": "text", "text": ""})
                out.append(self._delta(self.blocks - 1, {"type": "text_delta", "text": piece}))
            for call in delta.get("tool_calls") or []:
                if not isinstance(call, dict):
                    continue
                key = call.get("index", 0)
                fn = call.get("function") or {}
                if key not in self.calls:
                    self.saw_calls = True
                    block: dict[str, Any] = {
                        "type": "tool_use",
                        "id": call.get("id"),
                        "name": fn.get("name"),
                        "input": {},
                    }
                    out += self._start_block(block)
                    self.calls[key] = self.blocks - 1
                arguments = fn.get("arguments")
                if isinstance(arguments, str) and arguments:
                    out.append(
                        self._delta(self.calls[key], {"type": "input_json_delta", "partial_json": arguments})
                    )
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
                self.stop_string = choice.get("stop_reason")
        return out

    def finish(self) -> list[bytes]:
        out: list[bytes] = []
        if not self.started:
            out += self.event({})
        if self.blocks == 0:
            out += self._start_block({"type": "text", "text": ""})
        out += self._close()
        reason, sequence = self._stop(self.finish_reason, self.stop_string, self.saw_calls)
        usage = {
            "input_tokens": int(self.usage.get("prompt_tokens") or 0),
            "output_tokens": int(self.usage.get("completion_tokens") or 0),
        }
        delta = {
            "type": "message_delta",
            "delta": {"stop_reason": reason, "stop_sequence": sequence},
            "usage": usage,
        }
        out.append(sse("message_delta", delta))
        out.append(sse("message_stop", {"type": "message_stop"}))
        return out

    def stream_error(self, body: dict[str, Any]) -> list[bytes]:
        err = body["error"] if isinstance(body.get("error"), dict) else {}
        status = 500 if err.get("type") == "server_error" else 400
        return [sse("error", error_body(status, body))]

"""OpenAI's Responses API as a chat completion: the request translated into one (`to_chat`), the answer
and its stream translated back (`ResponsesTranslator`, for `gateway.serving.bridge`).

Supported: `input` as a string or a list of items (messages of the roles user, assistant, system and
developer, with string content or `input_text` / `output_text` parts; `function_call` and
`function_call_output` items), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `tools` of type
`function`, `tool_choice`, `parallel_tool_calls`, `text.format` (as chat's `response_format`), `user`,
`stream`, and `store` / `metadata`, forwarded only when given, so capture decides as for chat: `store`
defaults to false here (OpenAI's defaults to true, for `previous_response_id`, which is not served). What
needs server-side state or built-in tools (`previous_response_id`, `conversation`, `prompt`, `background`,
tools other than functions, inputs other than text) is a 400 naming the parameter.

Ids follow the chat completion's: `chatcmpl-X` answers as `resp_X` with the message `msg_X`, so a captured
Responses call is the stored chat completion `chatcmpl-X`.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.errors import InvalidRequest
from gateway.serving.bridge import sse

PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
"""Chat parameters the chat path may name in an error, as this API calls them."""
UNSUPPORTED = ("previous_response_id", "conversation", "prompt", "background")
"""Parameters that need state on the server (or running after the request): refused when set."""
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
TEXT_PARTS = ("input_text", "output_text", "text")


def _unsupported(param: str, message: str) -> InvalidRequest:
    """A 400 for something this server does not serve, its message naming `param` first."""
    return InvalidRequest(
        f"Unsupported value for '{param}': {message}", param=param, code="unsupported_parameter"
    )


def _text(content: Any, param: str) -> str:
    """The text of a message's content: a string, or text parts (anything else is refused)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise InvalidRequest(
            f"Invalid value for '{param}': expected a string or a list of content parts.",
            param=param,
            code="invalid_value",
        )
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
            raise _unsupported(
                f"{param}[{j}]",
                f"content parts of type '{kind}' are not supported; only text ('input_text') is.",
            )
        texts.append(part["text"])
    return "".join(texts)


def _messages(body: dict[str, Any]) -> list[dict[str, Any]]:
    """`instructions` and `input` as chat messages."""
    out: list[dict[str, Any]] = []
    instructions = body.get("instructions")
    if instructions is not None:
        if not isinstance(instructions, str):
            raise InvalidRequest(
                "Invalid value for 'instructions': expected a string.",
                param="instructions",
                code="invalid_value",
            )
        out.append({"role": "system", "content": instructions})
    given = body.get("input")
    if isinstance(given, str):
        out.append({"role": "user", "content": given})
        return out
    if not isinstance(given, list) or not given:
        raise InvalidRequest(
            "Invalid value for 'input': expected a string or a non-empty list of input items.",
            param="input",
            code="invalid_value" if "input" in body else "missing_required_parameter",
        )
    for i, item in enumerate(given):
        param = f"input[{i}]"
        if not isinstance(item, dict):
            raise InvalidRequest(f"Invalid value for '{param}': expected an object.", param=param)
        kind = item.get("type", "message")
        if kind == "message":
            role = ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise InvalidRequest(
                    f"Invalid value for '{param}.role': expected one of user, assistant, system, developer.",
                    param=f"{param}.role",
                    code="invalid_value",
                )
            out.append({"role": role, "content": _text(item.get("content"), f"{param}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", param),
                "type": "function",
                "function": {
                    "name": _string(item, "name", param),
                    "arguments": _string(item, "arguments", param),
                },
            }
            last = out[-1] if out else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
                if not last.get("content"):
                    last["content"] = None
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            text = output if isinstance(output, str) else _text(output, f"{param}.output")
            out.append({"role": "tool", "tool_call_id": _string(item, "call_id", param), "content": text})
        else:
            raise _unsupported(
                f"{param}.type",
                f"input items of type '{kind}' are not supported; messages, 'function_call' and "
                "'function_call_output' are.",
            )
    return out


def _string(item: dict[str, Any], key: str, param: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise InvalidRequest(
            f"Invalid value for '{param}.{key}': expected a string.",
            param=f"{param}.{key}",
            code="invalid_value",
        )
    return value


def _tools(tools: Any) -> list[dict[str, Any]]:
    if not isinstance(tools, list):
        raise InvalidRequest(
            "Invalid value for 'tools': expected a list.", param="tools", code="invalid_value"
        )
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise _unsupported(
                f"tools[{i}].type", f"tools of type '{kind}' are not supported; only 'function' tools are."
            )
        fn: dict[str, Any] = {"name": _string(tool, "name", f"tools[{i}]")}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, str):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        return {"type": "function", "function": {"name": choice["name"]}}
    raise _unsupported("tool_choice", "expected auto, none, required or a function by name.")


def _response_format(text: Any) -> dict[str, Any] | None:
    fmt = text.get("format") if isinstance(text, dict) else None
    if not isinstance(fmt, dict) or fmt.get("type") in (None, "text"):
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise _unsupported("text.format.type", f"text format '{fmt.get('type')}' is not supported.")


def to_chat(body: Any) -> dict[str, Any]:
    """The chat completion request of a Responses request body, or a 400 naming the parameter at fault."""
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    for name in UNSUPPORTED:
        if body.get(name) not in (None, False):
            raise _unsupported(
                name, "this server keeps no responses or conversations; send the whole input instead."
            )
    chat: dict[str, Any] = {"model": body.get("model"), "messages": _messages(body)}
    for ours, theirs in (
        ("max_output_tokens", "max_tokens"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("user", "user"),
        ("store", "store"),
        ("metadata", "metadata"),
        ("parallel_tool_calls", "parallel_tool_calls"),
    ):
        if body.get(ours) is not None:
            chat[theirs] = body[ours]
    if body.get("tools"):
        chat["tools"] = _tools(body["tools"])
    if body.get("tool_choice") is not None:
        chat["tool_choice"] = _tool_choice(body["tool_choice"])
    fmt = _response_format(body.get("text"))
    if fmt is not None:
        chat["response_format"] = fmt
    if body.get("stream"):
        chat["stream"] = True
        chat["stream_options"] = {"include_usage": True}
    return chat


def _suffix(chat_id: Any) -> str:
    text = str(chat_id or "")
    return text.removeprefix("chatcmpl-") or str(int(time.time() * 1000))


def _usage(usage: Any) -> dict[str, Any] | None:
    if not isinstance(usage, dict):
        return None
    prompt, completion = int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0)
    details = usage.get("prompt_tokens_details")
    cached = int(details.get("cached_tokens") or 0) if isinstance(details, dict) else 0
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": cached},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def _incomplete(finish_reason: Any) -> dict[str, str] | None:
    if finish_reason == "length":
        return {"reason": "max_output_tokens"}
    if finish_reason == "content_filter":
        return {"reason": "content_filter"}
    return None


def _message_item(item_id: str, text: str, status: str = "completed") -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _call_item(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": item_id,
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class ResponsesTranslator:
    """The chat path's answers as the Responses API's (`gateway.serving.bridge.Translator`)."""

    def __init__(self, body: dict[str, Any]) -> None:
        self.body = body
        self.created_at = int(time.time())
        # the stream's state
        self.seq = 0
        self.suffix: str | None = None
        self.output: list[dict[str, Any]] = []
        self.text: str | None = None
        """The text of the message item being streamed (None: none open)."""
        self.text_id = ""
        """That message item's id (`msg_X`; a later one after a tool call `msg_X_<output index>`)."""
        self.calls: dict[int, dict[str, Any]] = {}
        """Function-call items being streamed, by the chat stream's tool-call index."""
        self.open_call: int | None = None
        self.finish_reason: Any = None
        self.usage: Any = None

    # ---- the response object ----------------------------------------------------------------------------
    def response(
        self, suffix: str, status: str, output: list[dict[str, Any]], usage: Any, finish_reason: Any = None
    ) -> dict[str, Any]:
        b = self.body
        incomplete = _incomplete(finish_reason) if status != "in_progress" else None
        if incomplete is not None:
            status = "incomplete"
        text = b.get("text") if isinstance(b.get("text"), dict) else {"format": {"type": "text"}}
        return {
            "id": f"resp_{suffix}",
            "object": "response",
            "created_at": self.created_at,
            "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": None,
            "incomplete_details": incomplete,
            "instructions": b.get("instructions"),
            "max_output_tokens": b.get("max_output_tokens"),
            "model": b.get("model"),
            "output": output,
            "parallel_tool_calls": b.get("parallel_tool_calls", True) is not False,
            "previous_response_id": None,
            "reasoning": None,
            "store": bool(b.get("store")),
            "temperature": b.get("temperature", 1.0),
            "text": text,
            "tool_choice": b.get("tool_choice") if b.get("tool_choice") is not None else "auto",
            "tools": b.get("tools") or [],
            "top_p": b.get("top_p", 1.0),
            "truncation": "disabled",
            "usage": _usage(usage) if status != "in_progress" else None,
            "user": b.get("user"),
            "metadata": b.get("metadata") or {},
        }

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        suffix = _suffix(chat.get("id"))
        choices = chat.get("choices") or [{}]
        choice = choices[0] if isinstance(choices[0], dict) else {}
        message = choice.get("message") or {}
        output: list[dict[str, Any]] = []
        text = message.get("content")
        calls = message.get("tool_calls") or []
        if text or not calls:
            output.append(_message_item(f"msg_{suffix}", text or ""))
        for i, call in enumerate(calls):
            fn = call.get("function") or {}
            item = _call_item(
                f"fc_{suffix}_{i}", str(call.get("id")), fn.get("name", ""), fn.get("arguments", "")
            )
            output.append(item)
        return self.response(suffix, "completed", output, chat.get("usage"), choice.get("finish_reason"))

    def error(self, status: int, body: Any) -> Any:
        err = body.get("error") if isinstance(body, dict) else None
        if isinstance(err, dict) and err.get("param") in PARAMS:
            chat_name, ours = err["param"], PARAMS[err["param"]]
            err["param"] = ours
            if isinstance(err.get("message"), str):
                err["message"] = err["message"].replace(f"'{chat_name}'", f"'{ours}'")
        return body

    # ---- a stream ---------------------------------------------------------------------------------------
    def _emit(self, kind: str, **fields: Any) -> bytes:
        data = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return sse(kind, data)

    def _begin(self, chunk: dict[str, Any]) -> list[bytes]:
        self.suffix = _suffix(chunk.get("id"))
        start = self.response(self.suffix, "in_progress", [], None)
        return [
            self._emit("response.created", response=start),
            self._emit("response.in_progress", response=start),
        ]

    def _open_text(self) -> list[bytes]:
        index = len(self.output)
        item_id = self.text_id = f"msg_{self.suffix}" + (f"_{index}" if index else "")
        self.output.append(_message_item(item_id, "", "in_progress"))
        self.text = ""
        return [
            self._emit("response.output_item.added", output_index=index, item=self.output[index]),
            self._emit(
                "response.content_part.added",
                item_id=item_id,
                output_index=index,
                content_index=0,
                part=_text_part(""),
            ),
        ]

    def _close_text(self) -> list[bytes]:
        if self.text is None:
            return []
        index = len(self.output) - 1
        item_id = self.text_id
        text, self.text = self.text, None
        part = _text_part(text)
        self.output[index] = item = _message_item(item_id, text)
        common = {"item_id": item_id, "output_index": index, "content_index": 0}
        return [
            self._emit("response.output_text.done", **common, text=text, logprobs=[]),
            self._emit("response.content_part.done", **common, part=part),
            self._emit("response.output_item.done", output_index=index, item=item),
        ]

    def _close_call(self) -> list[bytes]:
        if self.open_call is None:
            return []
        held = self.calls[self.open_call]
        self.open_call = None
        index = held["output_index"]
        item = _call_item(held["id"], held["call_id"], held["name"], held["arguments"])
        self.output[index] = item
        return [
            self._emit(
                "response.function_call_arguments.done",
                item_id=held["id"],
                output_index=index,
                name=held["name"],
                arguments=held["arguments"],
            ),
            self._emit("response.output_item.done", output_index=index, item=item),
        ]

    def _tool_delta(self, call: dict[str, Any]) -> list[bytes]:
        out: list[bytes] = []
        key = call.get("index", 0)
        fn = call.get("function") or {}
        held = self.calls.get(key)
        if held is None:
            out += self._close_text() + self._close_call()
            index = len(self.output)
            held = self.calls[key] = {
                "id": f"fc_{self.suffix}_{len(self.calls)}",
                "call_id": str(call.get("id") or f"call_{self.suffix}_{len(self.calls)}"),
                "name": fn.get("name") or "",
                "arguments": "",
                "output_index": index,
            }
            self.open_call = key
            item = _call_item(held["id"], held["call_id"], held["name"], "", "in_progress")
            self.output.append(item)
            out.append(self._emit("response.output_item.added", output_index=index, item=item))
        piece = fn.get("arguments")
        if isinstance(piece, str) and piece:
            held["arguments"] += piece
            out.append(
                self._emit(
                    "response.function_call_arguments.delta",
                    item_id=held["id"],
                    output_index=held["output_index"],
                    delta=piece,
                )
            )
        return out

    def event(self, chunk: dict[str, Any]) -> list[bytes]:
        out = self._begin(chunk) if self.suffix is None else []
        if isinstance(chunk.get("usage"), dict):
            self.usage = chunk["usage"]
        for choice in chunk.get("choices") or []:
            if not isinstance(choice, dict) or choice.get("index", 0) != 0:
                continue
            delta = choice.get("delta") or {}
            piece = delta.get("content")
            if isinstance(piece, str) and piece:
                if self.text is None:
                    out += self._close_call() + self._open_text()
                assert self.text is not None
                self.text += piece
                out.append(
                    self._emit(
                        "response.output_text.delta",
                        item_id=self.text_id,
                        output_index=len(self.output) - 1,
                        content_index=0,
                        delta=piece,
                        logprobs=[],
                    )
                )
            for call in delta.get("tool_calls") or []:
                if isinstance(call, dict):
                    out += self._tool_delta(call)
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]
        return out

    def finish(self) -> list[bytes]:
        if self.suffix is None:
            self.suffix = _suffix(None)
            out = self._begin({})
        else:
            out = []
        if not self.output:
            out += self._open_text()
        out += self._close_text() + self._close_call()
        final = self.response(self.suffix, "completed", self.output, self.usage, self.finish_reason)
        kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
        out.append(self._emit(kind, response=final))
        return out

    def stream_error(self, body: dict[str, Any]) -> list[bytes]:
        err = body["error"] if isinstance(body.get("error"), dict) else {}
        return [
            self._emit("error", code=err.get("code"), message=err.get("message", ""), param=err.get("param"))
        ]

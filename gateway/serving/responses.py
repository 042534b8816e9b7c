"""OpenAI's Responses API as a chat completion: the request translated into one (`to_chat`); the answer
and its stream are translated back by `gateway.serving.responses_answer`.

Supported: `input` as a string or a list of items (messages of the roles user, assistant, system and
developer, with string content or `input_text` / `output_text` parts; `function_call` and
`function_call_output` items), `instructions`, `max_output_tokens`, `temperature`, `top_p`, `tools` of type
`function`, `tool_choice`, `parallel_tool_calls`, `text.format` (as chat's `response_format`), `user`,
`stream`, and `store` / `metadata`, forwarded only when given, so capture decides as for chat: `store`
defaults to false here (OpenAI's defaults to true, for `previous_response_id`, which is not served). What
needs server-side state or built-in tools (`previous_response_id`, `conversation`, `prompt`, `background`,
tools other than functions, inputs other than text) is a 400 naming the parameter.
"""

from __future__ import annotations

from typing import Any

from gateway.errors import InvalidRequest

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

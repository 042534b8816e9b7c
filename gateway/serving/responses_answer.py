"""OpenAI's Responses API answers from the chat path's: a whole chat completion as a `response` object, a
chat stream as the Responses events (`ResponsesTranslator`, a `gateway.serving.bridge.Translator`); the
request side is `gateway.serving.responses`.

Ids follow the chat completion's: `chatcmpl-X` answers as `resp_X` with the message `msg_X` and the function
calls `fc_X_0`, ..., so a captured Responses call is the stored chat completion `chatcmpl-X`. A stream's
events carry their `sequence_number`; an answer cut by the token limit is `incomplete`.
"""

from __future__ import annotations

import time
from typing import Any

from gateway.serving.bridge import sse

PARAMS = {"max_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format"}
"""Chat parameters the chat path may name in an error, as this API calls them."""


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

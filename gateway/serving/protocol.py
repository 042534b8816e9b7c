"""Wire handling of proxied requests: read `model`/`stream` once, rewrite `model` (engines' error answers are
mapped in `gateway.serving.engine_errors`).

Bodies are forwarded as received: the gateway parses them once with orjson to learn the model and whether
to stream, rewrites `model` to the engine's name and passes everything else through untouched, so every
OpenAI parameter the engine supports (tools, logprobs, n, stop, seed, ...) works without a schema here.

A few top-level fields the gateway itself relies on are checked on the way (a handful of dictionary lookups):
`model` (a string without NUL), and the integers `max_tokens` / `max_completion_tokens` (also against the
model's context, once the model is known: `check_max_tokens`), `n` and `seed`; and, once the model is known,
a prompt that cannot fit its context by its length alone (`check_prompt`). A body orjson refuses is
handed to `gateway.wire.diagnose`, which names the field at fault (NaN, Infinity, huge numbers, unpaired
surrogates, deep nesting), so that costs nothing while bodies are well formed.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import orjson

from gateway.errors import APIError, InvalidRequest
from gateway.wire import INT64_MAX, INT64_MIN, diagnose

logger = logging.getLogger(__name__)

DONE_LINE = b"data: [DONE]"
MAX_N = 128
"""Most choices one request may ask for (OpenAI's limit)."""


def _integer(body: dict[str, Any], name: str, low: int, high: int) -> int | None:
    """`body[name]` when absent or null (None) or an integer in `[low, high]`; else a 400 naming it."""
    value = body.get(name)
    if value is None:
        return None
    if type(value) is not int or not low <= value <= high:
        raise InvalidRequest(
            f"Invalid value for '{name}': expected an integer from {low} to {high}.",
            param=name,
            code="invalid_value",
        )
    return value


def json_object(raw: bytes) -> dict[str, Any]:
    """A request body as a JSON object, or a 400 in OpenAI's shape naming what is wrong."""
    try:
        body = orjson.loads(raw)
    except orjson.JSONDecodeError as exc:
        named = diagnose(raw)
        if named is not None:
            raise named from None
        raise InvalidRequest(f"The request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise InvalidRequest("The request body must be a JSON object.", code="invalid_json")
    return body


@dataclass(slots=True)
class ProxyRequest:
    """A client's request body, parsed once."""

    body: dict[str, Any]
    """The JSON object as received (mutated only to rewrite `model` and `stream_options`)."""
    model: str
    """The `model` the client asked for (a base model, an `ft:` model or a checkpoint id)."""
    stream: bool
    """Whether the client asked for server-sent events."""
    client_wants_usage: bool
    """Whether the client asked for the usage chunk (`stream_options.include_usage`)."""
    max_tokens: int | None = None
    """`max_completion_tokens`, else `max_tokens`, when the client named one."""

    @classmethod
    def parse(cls, raw: bytes) -> ProxyRequest:
        """The request of `raw`, or a 400 in OpenAI's shape."""
        body = json_object(raw)
        model = body.get("model")
        if not isinstance(model, str) or not model:
            raise InvalidRequest("You must provide a model parameter.", param="model", code="missing_model")
        if "\x00" in model:
            raise InvalidRequest(
                "Invalid value for 'model': must not contain NUL characters.",
                param="model",
                code="invalid_value",
            )
        most = _integer(body, "max_completion_tokens", 1, INT64_MAX)
        fallback = _integer(body, "max_tokens", 1, INT64_MAX)
        _integer(body, "n", 1, MAX_N)
        _integer(body, "seed", INT64_MIN, INT64_MAX)
        stream = bool(body.get("stream") or False)
        options = body.get("stream_options")
        wants_usage = bool(isinstance(options, dict) and options.get("include_usage"))
        return cls(
            body=body,
            model=model,
            stream=stream,
            client_wants_usage=wants_usage,
            max_tokens=most if most is not None else fallback,
        )

    def check_max_tokens(self, context_length: int) -> None:
        """A 400 when the request asks for more tokens than the model's context holds (`max_tokens` of 1e9
        is refused here, not clamped: the client learns the limit instead of a silently shorter answer)."""
        if self.max_tokens is not None and self.max_tokens > context_length:
            named = self.body.get("max_completion_tokens") is not None
            param = "max_completion_tokens" if named else "max_tokens"
            raise InvalidRequest(
                f"Invalid value for '{param}': {self.max_tokens} is more than the {context_length} tokens "
                f"of model '{self.model}'.",
                param=param,
                code="invalid_value",
            )

    def check_prompt(self, context_length: int, max_prompt_chars: int | None, param: str) -> None:
        """A 400 `context_length_exceeded` naming `param` (`messages` or `prompt`) for a prompt that cannot
        fit the model's context, told without a tokenizer: text of more than `max_prompt_chars` characters
        (None: unknown, not checked), or token ids that leave no room for one more. The text counted is the
        messages' own, which the chat template only adds to; each prompt of a batch is one request. The
        engines refuse the rest, as `engine_errors` maps it."""
        if param == "messages":
            messages = self.body.get("messages")
            texts = [_content_chars(m) for m in messages] if isinstance(messages, list) else []
            self._check_chars(sum(texts), context_length, max_prompt_chars, param)
            return
        prompt = self.body.get("prompt")
        items = prompt if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else [prompt]
        for item in items:
            if isinstance(item, str):
                self._check_chars(len(item), context_length, max_prompt_chars, param)
            elif isinstance(item, list) and len(item) >= context_length:
                raise InvalidRequest(
                    f"The prompt has {len(item)} tokens; this model's context is {context_length}.",
                    param=param,
                    code="context_length_exceeded",
                )

    @staticmethod
    def _check_chars(chars: int, context_length: int, most: int | None, param: str) -> None:
        if most is not None and chars > most:
            raise InvalidRequest(
                f"The prompt is {chars} characters; this model's context of {context_length} tokens holds at "
                f"most {most} characters.",
                param=param,
                code="context_length_exceeded",
            )

    def upstream_body(self, engine_model: str, extra: dict[str, Any] | None = None) -> bytes:
        """The body for the engine: `model` rewritten; streams always ask for usage (for metering); `extra`
        fields set over the client's (what capture asks the engine for)."""
        body = dict(self.body)
        body["model"] = engine_model
        if extra:
            body.update(extra)
        if self.stream:
            options = body.get("stream_options")
            options = dict(options) if isinstance(options, dict) else {}
            options["include_usage"] = True
            body["stream_options"] = options
        return orjson.dumps(body)


def _content_chars(message: Any) -> int:
    """Characters of a chat message's text (a string, or the `text` of its parts)."""
    content = message.get("content") if isinstance(message, dict) else None
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p["text"]) for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def rewrite_response(
    raw: bytes, model: str, fingerprint: str | None = None
) -> tuple[bytes, dict[str, Any] | None]:
    """A non-streamed engine answer with `model` rewritten (and `system_fingerprint` set to `fingerprint`,
    the version that served it, when given), and its `usage` (if any)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return raw, None
    if not isinstance(data, dict):
        return raw, None
    if "model" in data:
        data["model"] = model
        if fingerprint is not None:
            data["system_fingerprint"] = fingerprint
    usage = data.get("usage")
    return orjson.dumps(data), usage if isinstance(usage, dict) else None


@dataclass(slots=True)
class StreamRewriter:
    """Rewrites the `data:` lines of an engine's event stream, one line at a time.

    `model` is replaced in every JSON event and `system_fingerprint` set to `fingerprint` (the version that
    serves the stream) when given; the usage chunk is remembered (and dropped, as is each chunk's
    `usage: null`, when the client did not ask for it, since the gateway always asks the engine). `tap`, when
    given (a captured request: `gateway.capture.recorder.Capture.event`), sees each event first and may take
    fields out of it.
    """

    model: str
    keep_usage: bool
    fingerprint: str | None = None
    usage: dict[str, Any] | None = None
    saw_done: bool = False
    tap: Callable[[dict[str, Any]], None] | None = None

    def line(self, line: bytes) -> bytes | None:
        """The line to send for one upstream line (without its newline), or None to drop it."""
        if not line.startswith(b"data:"):
            return line
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self.saw_done = True
            return DONE_LINE
        try:
            event = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return line
        if not isinstance(event, dict):
            return line
        if self.tap is not None:
            self.tap(event)
        if "model" in event:
            event["model"] = self.model
            if self.fingerprint is not None:
                event["system_fingerprint"] = self.fingerprint
        usage = event.get("usage")
        if isinstance(usage, dict):
            self.usage = usage
        if not self.keep_usage and "usage" in event:
            if isinstance(usage, dict) and not event.get("choices"):
                return None
            del event["usage"]
        return b"data: " + orjson.dumps(event)


def error_event(exc: APIError) -> bytes:
    """The final SSE event of a stream that failed after it started."""
    return b"data: " + orjson.dumps(exc.body()) + b"\n\n" + DONE_LINE + b"\n\n"

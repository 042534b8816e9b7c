"""Other APIs served through the chat path: a request translated into a chat completion runs through
`gateway.serving.router.proxy_asgi` itself, and its answer is translated back on the way out.

`serve_as_chat` gives `proxy_asgi` a scope whose path is `/v1/chat/completions`, a `receive` that yields the
translated body (then the client's own `receive`, so a client that goes away still cancels the call), and a
`send` that hands what the chat path answers to a `Translator`: a whole JSON answer (or error) at once, a
stream line by line. Model resolution, rate limits, budgets, usage metering and capture apply exactly as for
chat, because it is the chat path that runs; the chat hot path itself does no work for any of this.
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol

import orjson
from starlette.types import Message, Receive, Scope, Send

from gateway.serving.router import proxy_asgi

CHAT_PATH = "/v1/chat/completions"


class Translator(Protocol):
    """Turns the chat path's answers into another API's."""

    def answer(self, chat: dict[str, Any]) -> dict[str, Any]:
        """A whole chat completion as the other API's answer."""

    def error(self, status: int, body: Any) -> Any:
        """A JSON error answer of the chat path (OpenAI's envelope) as the other API's."""

    def event(self, chunk: dict[str, Any]) -> list[bytes]:
        """One chunk of a chat stream as the SSE events to send (complete, with their blank lines)."""

    def stream_error(self, body: dict[str, Any]) -> list[bytes]:
        """A chat stream's final error event (OpenAI's envelope) as the events to send."""

    def finish(self) -> list[bytes]:
        """The stream ended (`[DONE]`, or the chat path's last bytes): the closing events."""


async def read_body(receive: Receive) -> bytes:
    """The whole request body (a client that leaves while sending it cancels the request)."""
    body = b""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise asyncio.CancelledError("client disconnected")
        body += message.get("body", b"")
        if not message.get("more_body", False):
            return body


def header(scope: Scope, name: bytes) -> str | None:
    """The value of request header `name` (lower case), or None."""
    for key, value in scope["headers"]:
        if key == name:
            return str(value.decode("latin-1"))
    return None


def sse(event: str, data: dict[str, Any]) -> bytes:
    """One server-sent event with its name (as the Responses and Messages APIs send them)."""
    return b"event: " + event.encode() + b"\ndata: " + orjson.dumps(data) + b"\n\n"


def json_start(status: int, headers: list[tuple[bytes, bytes]], length: int) -> Message:
    """A response start for a JSON body of `length` bytes, keeping `headers` other than the body's own."""
    kept = [(k, v) for k, v in headers if k not in (b"content-length", b"content-type")]
    head = [(b"content-type", b"application/json"), (b"content-length", b"%d" % length), *kept]
    return {"type": "http.response.start", "status": status, "headers": head}


class _TranslatingSend:
    """The `send` given to the chat path: whole answers buffered and translated, streams line by line."""

    def __init__(self, send: Send, translator: Translator) -> None:
        self._send = send
        self._t = translator
        self._start: Message | None = None
        self._streaming = False
        self._body = b""
        self._pending = b""
        self._finished = False

    async def __call__(self, message: Message) -> None:
        if message["type"] == "http.response.start":
            headers = message.get("headers", [])
            self._streaming = message["status"] == 200 and any(
                k == b"content-type" and v.startswith(b"text/event-stream") for k, v in headers
            )
            if self._streaming:
                await self._send(message)
            else:
                self._start = message
            return
        if message["type"] != "http.response.body":
            await self._send(message)
            return
        more = bool(message.get("more_body", False))
        if self._streaming:
            out = self._lines(message.get("body", b""), last=not more)
            await self._send({"type": "http.response.body", "body": b"".join(out), "more_body": more})
            return
        self._body += message.get("body", b"")
        if more:
            return
        assert self._start is not None
        status = self._start["status"]
        try:
            data = orjson.loads(self._body)
        except orjson.JSONDecodeError:
            data = None
        if isinstance(data, dict):
            answer = self._t.answer(data) if status < 400 else self._t.error(status, data)
            body = orjson.dumps(answer)
        else:
            body = self._body
        await self._send(json_start(status, self._start.get("headers", []), len(body)))
        await self._send({"type": "http.response.body", "body": body})

    def _lines(self, piece: bytes, *, last: bool) -> list[bytes]:
        lines = (self._pending + piece).split(b"\n")
        self._pending = b"" if last else lines.pop()
        out: list[bytes] = []
        for line in lines:
            out.extend(self._line(line.strip()))
        if last and not self._finished:
            self._finished = True
            out.extend(self._t.finish())
        return out

    def _line(self, line: bytes) -> list[bytes]:
        if self._finished or not line.startswith(b"data:"):
            return []
        payload = line[5:].strip()
        if payload == b"[DONE]":
            self._finished = True
            return self._t.finish()
        try:
            chunk = orjson.loads(payload)
        except orjson.JSONDecodeError:
            return []
        if not isinstance(chunk, dict):
            return []
        if "error" in chunk and not chunk.get("choices"):
            self._finished = True
            return self._t.stream_error(chunk)
        return self._t.event(chunk)


async def serve_as_chat(
    scope: Scope,
    receive: Receive,
    send: Send,
    chat: dict[str, Any],
    translator: Translator,
    *,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """Run the chat completion `chat` through the chat path, its answer translated by `translator`.

    `headers` replace the request's (the caller's translation of its auth header, say); the client's body
    must have been read already (`read_body`)."""
    chat_scope = {
        **scope,
        "path": CHAT_PATH,
        "raw_path": CHAT_PATH.encode(),
        "headers": headers if headers is not None else scope["headers"],
    }
    body = orjson.dumps(chat)
    given = False

    async def chat_receive() -> Message:
        nonlocal given
        if not given:
            given = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    await proxy_asgi(chat_scope, chat_receive, _TranslatingSend(send, translator))

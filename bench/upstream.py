"""A minimal fake OpenAI upstream: pre-rendered chat answers over raw asyncio HTTP/1.1 with keep-alive.

As cheap as a Python server gets (no framework, no JSON work per request), so that what a bench measures
is the proxy in front of it. A body containing `"stream": true` gets a server-sent event stream
(chunked), anything else one `chat.completion`. `python -m bench.upstream PORT` serves until killed.
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
from typing import cast

logger = logging.getLogger(__name__)

MODEL = "tiny-chat"
CONTENT_PIECES = ["Hello", " from", " the", " fake", " upstream", "."]


def _completion() -> bytes:
    text = "".join(CONTENT_PIECES)
    return json.dumps(
        {
            "id": "chatcmpl-bench",
            "object": "chat.completion",
            "created": 1700000000,
            "model": MODEL,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop",
                    "logprobs": None,
                }
            ],
            "usage": {"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18},
        },
        separators=(",", ":"),
    ).encode()


def _chunk(delta: dict[str, object], finish: str | None = None, usage: dict[str, int] | None = None) -> bytes:
    event: dict[str, object] = {
        "id": "chatcmpl-bench",
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": MODEL,
        "choices": [] if usage else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}],
    }
    if usage:
        event["usage"] = usage
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _stream_events() -> list[bytes]:
    events = [_chunk({"role": "assistant", "content": ""})]
    events += [_chunk({"content": piece}) for piece in CONTENT_PIECES]
    events.append(_chunk({}, finish="stop"))
    events.append(_chunk({}, usage={"prompt_tokens": 12, "completion_tokens": 6, "total_tokens": 18}))
    events.append(b"data: [DONE]\n\n")
    return events


def _chunked(payload: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(payload), payload)


BODY = _completion()
JSON_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n"
    b"connection: keep-alive\r\n\r\n%s" % (len(BODY), BODY)
)
STREAM_RESPONSE = (
    b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
    b"cache-control: no-cache\r\nconnection: keep-alive\r\n\r\n"
    + b"".join(_chunked(e) for e in _stream_events())
    + b"0\r\n\r\n"
)


class FakeUpstream(asyncio.Protocol):
    """One connection: parses request heads and bodies just enough to answer each in turn."""

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's transports are not subclasses

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            end = self.buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = self.buf[:end].lower()
            length = 0
            pos = head.find(b"content-length:")
            if pos >= 0:
                line_end = head.find(b"\r\n", pos)
                length = int(head[pos + 15 : line_end if line_end >= 0 else len(head)])
            total = end + 4 + length
            if len(self.buf) < total:
                return
            body = self.buf[end + 4 : total]
            self.buf = self.buf[total:]
            assert self.transport is not None
            streaming = b'"stream":true' in body or b'"stream": true' in body
            self.transport.write(STREAM_RESPONSE if streaming else JSON_RESPONSE)


async def serve(port: int, host: str = "127.0.0.1") -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(FakeUpstream, host, port, backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    port = int(argv[0]) if argv else 9100
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # the plain asyncio loop is fine, only slower
        pass
    asyncio.run(serve(port))


if __name__ == "__main__":
    main(sys.argv[1:])

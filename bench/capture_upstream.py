"""The capture bench's stand-in engine: pre-rendered chat answers over raw asyncio HTTP/1.1 with keep-alive,
as cheap as `bench.upstream`'s, with a fresh id each (capture keys its records by the answer's id), that
carry `prompt_token_ids`, each choice's `token_ids` and `logprobs` when the request asks for
`return_token_ids`, as vLLM and tunegate's own engine answer them: whole or, for `"stream": true`, as a
server-sent event stream (the prompt's ids on the first event, each event's own token ids and logprobs).
`python -m bench.capture_upstream PORT` serves until killed.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import sys
from pathlib import Path
from typing import Any, cast

from bench.common import free_port, pin
from bench.stack import Process

ID_WIDTH = 24

PIECES = ["Hello", " from", " the", " fake", " upstream", "."]
TOKEN_IDS = [9906, 505, 279, 12700, 42419, 13]
PROMPT_IDS = [151644, 872, 198, 45764, 23811, 13, 151645, 198, 151644, 77091, 198, 0]
USAGE = {"prompt_tokens": len(PROMPT_IDS), "completion_tokens": len(PIECES), "total_tokens": 18}
PLACEHOLDER = b"chatcmpl-" + b"X" * ID_WIDTH


def _logprobs(pieces: list[str]) -> dict[str, Any]:
    return {
        "content": [
            {"token": p, "logprob": -0.25, "bytes": list(p.encode()), "top_logprobs": []} for p in pieces
        ]
    }


def _whole(with_ids: bool) -> bytes:
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": "".join(PIECES)},
        "finish_reason": "stop",
        "logprobs": _logprobs(PIECES) if with_ids else None,
    }
    answer: dict[str, Any] = {
        "id": PLACEHOLDER.decode(),
        "object": "chat.completion",
        "created": 1700000000,
        "model": "tiny-chat",
        "choices": [choice],
        "usage": USAGE,
    }
    if with_ids:
        answer["prompt_token_ids"] = PROMPT_IDS
        choice["token_ids"] = TOKEN_IDS
    return json.dumps(answer, separators=(",", ":")).encode()


def _event(choices: list[dict[str, Any]], **extra: Any) -> bytes:
    event = {
        "id": PLACEHOLDER.decode(),
        "object": "chat.completion.chunk",
        "created": 1700000000,
        "model": "tiny-chat",
        "choices": choices,
        **extra,
    }
    return b"data: " + json.dumps(event, separators=(",", ":")).encode() + b"\n\n"


def _stream(with_ids: bool) -> list[bytes]:
    def choice(delta: dict[str, Any], finish: str | None = None, i: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}
        if with_ids and i is not None:
            out["logprobs"] = _logprobs([PIECES[i]])
            out["token_ids"] = [TOKEN_IDS[i]]
        return out

    first = {"prompt_token_ids": PROMPT_IDS} if with_ids else {}
    events = [_event([choice({"role": "assistant", "content": ""})], **first)]
    events += [_event([choice({"content": p}, i=i)]) for i, p in enumerate(PIECES)]
    events.append(_event([choice({}, "stop")]))
    events.append(_event([], usage=USAGE))
    events.append(b"data: [DONE]\n\n")
    return events


def _http(body: bytes) -> bytes:
    head = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: %d\r\n" % len(body)
    return head + b"connection: keep-alive\r\n\r\n" + body


def _sse(events: list[bytes]) -> bytes:
    head = (
        b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n"
        b"cache-control: no-cache\r\nconnection: keep-alive\r\n\r\n"
    )
    return head + b"".join(b"%x\r\n%s\r\n" % (len(e), e) for e in events) + b"0\r\n\r\n"


ANSWERS = {
    (False, False): _http(_whole(False)),
    (False, True): _http(_whole(True)),
    (True, False): _sse(_stream(False)),
    (True, True): _sse(_stream(True)),
}
"""(streamed, with token ids) -> the whole HTTP answer, its id a placeholder of fixed width."""


class CaptureUpstream(asyncio.Protocol):
    """One connection of the stand-in engine: each request answered in turn, with a fresh id."""

    counter = itertools.count(1)

    def __init__(self) -> None:
        self.buf = b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while (end := self.buf.find(b"\r\n\r\n")) >= 0:
            head = self.buf[:end].lower()
            pos = head.find(b"content-length:")
            length = int(head[pos + 15 :].split(b"\r\n", 1)[0]) if pos >= 0 else 0
            total = end + 4 + length
            if len(self.buf) < total:
                return
            body = self.buf[end + 4 : total]
            self.buf = self.buf[total:]
            streamed = b'"stream":true' in body or b'"stream": true' in body
            with_ids = b'"return_token_ids":true' in body or b'"return_token_ids": true' in body
            fresh = b"chatcmpl-%0*x" % (ID_WIDTH, next(self.counter))
            assert self.transport is not None
            self.transport.write(ANSWERS[(streamed, with_ids)].replace(PLACEHOLDER, fresh))


async def serve(port: int) -> None:
    loop = asyncio.get_running_loop()
    server = await loop.create_server(CaptureUpstream, "127.0.0.1", port, backlog=4096, reuse_address=True)
    async with server:
        await server.serve_forever()


def start_upstream(log_path: Path, core: int | None) -> tuple[Process, str]:
    """The stand-in engine on a free port, pinned to `core`; returns it and its base URL."""
    port = free_port()
    proc = Process([*pin(core), sys.executable, "-m", "bench.capture_upstream", str(port)], log_path)
    proc.wait_port(port, 30)
    return proc, f"http://127.0.0.1:{port}"


def main(argv: list[str]) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # the plain asyncio loop is fine, only slower
        pass
    asyncio.run(serve(int(argv[0])))


if __name__ == "__main__":
    main(sys.argv[1:])

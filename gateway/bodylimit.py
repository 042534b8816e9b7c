"""The request body cap: no request but a file upload carries more than `max_request_body_bytes`.

The gateway reads a JSON body whole before it can look at it (FastAPI parses it, the completions fast path
parses it with orjson), so the cap is applied first, in the request middleware: a declared `Content-Length`
over it is refused with 413 before a byte of the body is read, and a body sent without one (chunked) is
read only until it passes the cap. The body read is then handed to the app as one message. File uploads
(`POST /v1/files`) stream to disk under their own cap (`max_upload_bytes`) and are left alone.
"""

from __future__ import annotations

from starlette.types import Message, Receive, Scope

from gateway.errors import PayloadTooLarge

STREAMED = frozenset({("POST", "/v1/files")})
"""(method, path) of the requests whose bodies are streamed, with caps of their own."""


def applies(scope: Scope) -> bool:
    """Whether the cap holds for this request (every HTTP request but the streamed uploads)."""
    return (scope["method"], scope["path"]) not in STREAMED


def declared_length(scope: Scope) -> int | None:
    """The request's `Content-Length`, when it declares a well-formed one."""
    for name, value in scope["headers"]:
        if name == b"content-length":
            return int(value) if value.isdigit() else None
    return None


def too_large(limit: int, size: int | None = None) -> PayloadTooLarge:
    """The 413 for a body over `limit` bytes (`size` when it is known)."""
    what = f"{size} bytes" if size is not None else f"more than {limit} bytes"
    return PayloadTooLarge(
        f"The request body is {what}; request bodies are limited to {limit} bytes "
        "(files go through POST /v1/files).",
        code="request_too_large",
    )


async def read_capped(scope: Scope, receive: Receive, limit: int) -> Receive | None:
    """A `receive` that hands the app the whole body, read here up to `limit` bytes; `PayloadTooLarge`
    when the body is (or declares to be) longer; None when the client left before the body was complete."""
    declared = declared_length(scope)
    if declared is not None and declared > limit:
        raise too_large(limit, declared)
    chunks: list[bytes] = []
    size = 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return None
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    body: Message | None = {"type": "http.request", "body": b"".join(chunks), "more_body": False}

    async def replay() -> Message:
        nonlocal body
        if body is not None:
            message, body = body, None
            return message
        return await receive()

    return replay

"""`/dashboard/api/v1/...`: the browser's way into the public API.

A plain ASGI app: it finds the cookie's session, asks for the CSRF header on anything but GET and HEAD, and
hands the request to the gateway itself as `/v1/...` with the session's key as its bearer token and without
the cookie. The request then runs every check, limit and meter of the API route it names, streams as that
route streams, and sees only what the key's organisation may see.
"""

from __future__ import annotations

from http.cookies import SimpleCookie

from starlette.types import Receive, Scope, Send

from gateway.dashboard import sessions
from gateway.errors import APIError, NotFound, error_response

PREFIX = "/dashboard/api"
SAFE_METHODS = frozenset({"GET", "HEAD"})


def cookie_of(scope: Scope) -> str | None:
    """The session cookie of a request's `Cookie` header(s)."""
    for name, value in scope["headers"]:
        if name == b"cookie":
            jar: SimpleCookie = SimpleCookie()
            jar.load(value.decode("latin-1"))
            if sessions.COOKIE in jar:
                return jar[sessions.COOKIE].value
    return None


def _header(scope: Scope, wanted: bytes) -> str | None:
    for name, value in scope["headers"]:
        if name == wanted:
            return str(value.decode("latin-1"))
    return None


async def api_proxy(scope: Scope, receive: Receive, send: Send) -> None:
    """Mounted at `PREFIX`: forwards `PREFIX/v1/...` to `/v1/...` as the signed-in key."""
    if scope["type"] != "http":
        return
    path: str = scope["path"]
    inner = path[len(PREFIX) :] if path.startswith(PREFIX) else path
    app = scope["app"]
    try:
        if not inner.startswith("/v1/"):
            raise NotFound(f"No dashboard API route {path}.")
        session = await sessions.require(app.state.resources, cookie_of(scope))
        if scope["method"] not in SAFE_METHODS:
            sessions.check_csrf(session, _header(scope, sessions.CSRF_HEADER.encode()))
    except APIError as exc:
        await error_response(exc)(scope, receive, send)
        return
    headers = [
        (name, value)
        for name, value in scope["headers"]
        if name not in (b"cookie", b"authorization", sessions.CSRF_HEADER.encode())
    ]
    headers.append((b"authorization", b"Bearer " + session.key.encode()))
    forwarded = dict(scope)
    forwarded.update(
        path=inner,
        raw_path=inner.encode(),
        root_path="",
        headers=headers,
        state={},
    )
    forwarded.pop("route", None)
    forwarded.pop("router", None)
    forwarded.pop("endpoint", None)
    forwarded.pop("path_params", None)
    await app(forwarded, receive, send)

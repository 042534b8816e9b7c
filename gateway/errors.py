"""One error tree and one mapper: every failure leaves the gateway as OpenAI's error envelope.

`{"error": {"message": ..., "type": ..., "param": ..., "code": ...}}` with the status the SDK maps to its
exception classes (400 BadRequestError, 401 AuthenticationError, 404 NotFoundError, 409 ConflictError, ...).
"""

from __future__ import annotations

import errno
import logging
from collections.abc import Mapping, Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import JSONResponse, Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

logger = logging.getLogger(__name__)

MAX_MESSAGE_CHARS = 2000
"""Longest `message` an error envelope carries; longer ones (an engine's answer, a package's traceback, a
name an archive made up) are cut, so no input can make an error body large."""
MAX_PARAM_CHARS = 200
"""Longest `param` an error envelope carries (a field path built from client keys may be long)."""


def _cut(text: str, most: int) -> str:
    return text if len(text) <= most else text[: most - 1] + "\u2026"


class APIError(Exception):
    """Base of every error the API reports. Subclasses fix the status and OpenAI's error `type`."""

    status: int = 500
    type: str = "server_error"
    default_code: str | None = None

    def __init__(
        self,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code if code is not None else self.default_code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        """OpenAI's error envelope, its message and param cut to `MAX_MESSAGE_CHARS` and `MAX_PARAM_CHARS`."""
        param = _cut(self.param, MAX_PARAM_CHARS) if self.param is not None else None
        message = _cut(self.message, MAX_MESSAGE_CHARS)
        return {"error": {"message": message, "type": self.type, "param": param, "code": self.code}}


class InvalidRequest(APIError):
    status = 400
    type = "invalid_request_error"


class AuthenticationFailed(APIError):
    status = 401
    type = "invalid_request_error"
    default_code = "invalid_api_key"


class PermissionDenied(APIError):
    status = 403
    type = "invalid_request_error"
    default_code = "permission_denied"


class NotFound(APIError):
    status = 404
    type = "invalid_request_error"
    default_code = "not_found"


class Conflict(APIError):
    status = 409
    type = "invalid_request_error"
    default_code = "conflict"


class PayloadTooLarge(APIError):
    status = 413
    type = "invalid_request_error"
    default_code = "file_too_large"


class RateLimited(APIError):
    status = 429
    type = "requests"
    default_code = "rate_limit_exceeded"


class InsufficientQuota(APIError):
    """429 like a rate limit, but no retry will help before the budget is raised or the month turns: the
    `x-should-retry: false` header tells the `openai` and `tinker` SDKs (which retry other 429s) to raise."""

    status = 429
    type = "insufficient_quota"
    default_code = "insufficient_quota"

    def __init__(self, message: str, **kwargs: Any) -> None:
        super().__init__(message, **kwargs)
        self.headers = {"x-should-retry": "false", **self.headers}


class BudgetSpent(APIError):
    """402: the organisation's monthly budget is spent, for clients whose protocol says so with 402 (the
    Tinker SDK's billing status); OpenAI's own routes answer `InsufficientQuota`'s 429."""

    status = 402
    type = "insufficient_quota"
    default_code = "insufficient_quota"


class ServiceUnavailable(APIError):
    status = 503
    type = "server_error"
    default_code = "service_unavailable"


class UpstreamError(APIError):
    """An inference engine answered with an error, or the gateway's own chat route refused a model call made
    for a request (`gateway.serving.calls`); status and body are passed on in OpenAI's shape."""

    def __init__(self, status: int, message: str, *, type_: str, param: str | None, code: str | None) -> None:
        super().__init__(message, param=param, code=code)
        self.status = status
        self.type = type_


def not_found(kind: str, ident: str, *, param: str | None = None, code: str | None = None) -> NotFound:
    """The 404 for an unknown id — also the answer for another organisation's ids."""
    return NotFound(f"No {kind} found with id '{ident}'.", param=param, code=code)


def error_response(exc: APIError, request_id: str | None = None) -> JSONResponse:
    """The mapper: an `APIError` as an HTTP response."""
    headers = dict(exc.headers)
    if request_id:
        headers["x-request-id"] = request_id
    return JSONResponse(exc.body(), status_code=exc.status, headers=headers)


_REQUEST_PARTS = frozenset({"body", "query", "path", "header", "cookie"})
"""Where FastAPI found a parameter: the first item of its errors' locations, no part of the field's path."""


def _validation_param(loc: Sequence[Any], root: str = "") -> str | None:
    """A pydantic error's location as the field path OpenAI's `param` gives (`messages[2].content`), under
    `root` (the path of the object that was validated); where a request part (`body`, `query`, ...) leads
    the location, it is left out."""
    parts = [str(p) for p in loc]
    if parts and parts[0] in _REQUEST_PARTS:
        parts = parts[1:]
    out = root
    for p in parts:
        out += f"[{p}]" if p.isdigit() else (f".{p}" if out else p)
    return out or None


def validation_text(text: str) -> str:
    """A pydantic error's `msg` as the end of one sentence: on one line, its `Value error, ` prefix and
    closing period dropped, lower-cased where it starts with pydantic's `Input`/`Field`/`Value`."""
    text = " ".join(text.split()).removeprefix("Value error, ").removeprefix("Assertion failed, ").rstrip(".")
    if text.split(" ", 1)[0] in ("Input", "Field", "Value"):
        text = text[0].lower() + text[1:]
    return text


def validation_failure(errors: Sequence[Mapping[str, Any]], *, root: str = "") -> InvalidRequest:
    """The one mapping of pydantic's complaints (a `ValidationError`'s or FastAPI's `RequestValidationError`'s
    `errors()`) to a 400: the first problem, `param` the path of the field at fault under `root`, `message`
    one sentence that names it. Never pydantic's whole report (it lists every branch of a union, inputs and
    documentation links)."""
    first: Mapping[str, Any] = errors[0] if errors else {}
    kind = str(first.get("type", ""))
    loc = tuple(first.get("loc", ()))
    if kind == "json_invalid":  # FastAPI puts the character offset where the field would be
        ctx = first.get("ctx") or {}
        detail = f" ({validation_text(str(ctx['error']))})" if ctx.get("error") else ""
        return InvalidRequest(
            f"The request body is not valid JSON{detail}.", param=root or None, code="invalid_json"
        )
    param = _validation_param(loc, root)
    named = f"'{param}'" if param else "the request body"
    if kind == "missing":
        message = f"Missing required parameter: {named}."
    elif kind == "extra_forbidden":
        message = f"Unrecognized parameter: {named}."
    else:
        message = f"Invalid value for {named}: {validation_text(str(first.get('msg') or 'invalid'))}."
    return InvalidRequest(message, param=param, code="invalid_value")


_VALUE_ERRNOS = frozenset({errno.EOVERFLOW, errno.ERANGE, errno.EDOM})
"""`OSError`s that report a value out of range (a timestamp beyond the platform's, say), not a service."""


def _lost_connection(exc: OSError) -> bool:
    """Whether an `OSError` means a backing service could not be reached (asyncpg reports a refused
    reconnect as an `OSError`, a bare `OSError("Multiple exceptions: ...")`, or a missing Unix socket),
    rather than a value out of range, which is no reason to tell a client to retry."""
    return exc.errno not in _VALUE_ERRNOS


def map_infrastructure_error(exc: BaseException) -> APIError | None:
    """A lost database or queue connection as a 503 the client may retry; a value the database refused
    (a data exception: NUL in text, a number out of a column's range) as a 400; None for anything else.

    Requests are checked before they reach the database (`gateway.wire`, the protocol models), with the
    field named; the 400 here is the net under those checks.
    """
    import asyncpg
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    if isinstance(exc, asyncpg.DataError):
        return InvalidRequest(
            "A value in the request is out of range, or holds characters the database cannot store.",
            code="invalid_value",
        )
    # PostgreSQL refusing new connections is an outage too: too many clients, or a database closed to
    # connections (`ALLOW_CONNECTIONS false`, as for maintenance), which it reports as SQLSTATE 55000 itself
    # (its subclasses, a lock not available and the like, are not).
    refused = isinstance(exc, asyncpg.TooManyConnectionsError) or (
        type(exc) is asyncpg.ObjectNotInPrerequisiteStateError
    )
    # A connection the server ended under a query in flight can also surface as asyncpg's own state error
    # (`InternalClientError`: "cannot switch to state ..."): the pool drops it like any lost connection.
    lost = asyncpg.PostgresConnectionError | asyncpg.InterfaceError | asyncpg.CannotConnectNowError
    if refused or isinstance(exc, lost | asyncpg.InternalClientError):
        return ServiceUnavailable(
            "The database is unavailable; retry shortly.",
            code="database_unavailable",
            headers={"retry-after": "1"},
        )
    if isinstance(exc, OSError) and _lost_connection(exc):
        return ServiceUnavailable(
            "A backing service is unavailable; retry shortly.",
            code="service_unavailable",
            headers={"retry-after": "1"},
        )
    if isinstance(exc, RedisConnectionError | RedisTimeoutError):
        return ServiceUnavailable(
            "The queue is unavailable; retry shortly.", code="queue_unavailable", headers={"retry-after": "1"}
        )
    return None


def as_api_error(exc: Exception, method: str, path: str) -> APIError:
    """The one mapper from an exception to what the client sees, used by the app's handlers and by the raw
    proxy path alike: an `APIError` as it is; a request that failed validation as a 400 naming the field;
    Starlette's unknown URL and method as 404 and 405; a lost backing service or a value the database
    refused as `map_infrastructure_error` says; anything else as a 500 (logged with its traceback)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, RequestValidationError):
        return validation_failure(exc.errors())
    if isinstance(exc, StarletteHTTPException):
        mapped: APIError
        if exc.status_code == 404:
            return NotFound(f"Unknown request URL: {method} {path}.", code="unknown_url")
        if exc.status_code == 405:
            mapped = InvalidRequest(f"Method {method} not allowed for {path}.")
            mapped.status = 405
            return mapped
        mapped = APIError(str(exc.detail))
        mapped.status = exc.status_code
        mapped.type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return mapped
    infrastructure = map_infrastructure_error(exc)
    if infrastructure is not None:
        logger.warning("%s %s: %s", method, path, infrastructure.message)
        return infrastructure
    logger.error("unhandled error on %s %s", method, path, exc_info=exc)
    return APIError("The server had an error while processing your request.")


class AnswerErrors:
    """Middleware under Starlette's outermost layer: an exception no route handler took (anything but an
    `APIError`, a validation error or an HTTP exception: a lost database, a bug) is answered here, through
    the mapper, and goes no further.

    Starlette's outermost layer (`ServerErrorMiddleware`, where an `Exception` handler lands) answers it
    too, but then raises it again for the server to log, and uvicorn closes the connection of a request
    whose app raised: a kept-alive client lost its next request on that connection, to a reset when the
    request's body was still unread. An exception once the response has started still goes up: that
    response cannot be completed, and only closing the connection tells the client so."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracked(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracked)
        except Exception as exc:
            if started:
                raise
            await error_response(as_api_error(exc, scope["method"], scope["path"]))(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    """Route every exception through the one mapper: the handlers of the exceptions routes raise on
    purpose, `AnswerErrors` for the rest, and an `Exception` handler as the net under middleware that
    sits above it."""

    async def on_error(request: Request, exc: Exception) -> Response:
        return error_response(as_api_error(exc, request.method, request.url.path))

    for kind in (APIError, RequestValidationError, StarletteHTTPException, Exception):
        app.add_exception_handler(kind, on_error)
    app.add_middleware(AnswerErrors)

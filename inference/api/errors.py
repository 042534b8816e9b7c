"""Every failure of the engine's routes as OpenAI's error envelope (``inference.errors.error_body``): the
engine's own errors, FastAPI's validation errors (a 400 naming the first bad field), Starlette's HTTP
errors (an unknown path, a wrong method) and anything unexpected (a 500, logged)."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from inference.errors import BadRequestError, EngineError, error_body

logger = logging.getLogger("inference.server")  # the server's logger: these are its messages


def add_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in OpenAI's envelope."""
    app.exception_handler(EngineError)(_engine_error)
    app.exception_handler(RequestValidationError)(_validation_error)
    app.exception_handler(StarletteHTTPException)(_http_error)
    app.exception_handler(Exception)(_unexpected)


def _error(exc: EngineError) -> JSONResponse:
    return JSONResponse(error_body(exc), status_code=exc.status_code)


async def _engine_error(request: Request, exc: EngineError) -> JSONResponse:
    return _error(exc)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    message = f"{param}: {first.get('msg', 'invalid request')}" if param else str(first.get("msg", exc))
    return _error(BadRequestError(message, param=param))


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    err = EngineError(str(exc.detail))
    err.status_code = exc.status_code
    err.error_type = "NotFoundError" if exc.status_code == 404 else "BadRequestError"
    return _error(err)


async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unhandled engine error")
    return _error(EngineError(f"Internal error: {exc}"))

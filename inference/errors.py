"""The engine's error tree and the one mapper to OpenAI's error envelope.

Every failure the engine reports carries an HTTP status, an OpenAI error ``type``, and optionally the
offending ``param`` and a machine ``code``; :func:`error_body` turns any of them into
``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


class EngineError(Exception):
    """Base of the engine's errors; subclasses fix the status and the OpenAI error type."""

    status_code: int = 500
    error_type: str = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class BadRequestError(EngineError):
    """A request the engine cannot serve as written (missing or invalid field, duplicate adapter...)."""

    status_code = 400
    error_type = "BadRequestError"


class NotFoundError(EngineError):
    """An unknown model or adapter."""

    status_code = 404
    error_type = "NotFoundError"


class ModelNotFoundError(NotFoundError):
    """A request named a model the engine neither serves nor knows as an adapter."""

    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model", code="model_not_found")


def error_body(exc: EngineError) -> dict[str, Any]:
    """OpenAI's error envelope for ``exc``."""
    return {
        "error": {
            "message": exc.message,
            "type": exc.error_type,
            "param": exc.param,
            "code": exc.code if exc.code is not None else exc.status_code,
        }
    }

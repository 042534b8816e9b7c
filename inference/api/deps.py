"""The engine's dependencies: what ``inference.server.create_app`` made once, taken from ``app.state``."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request

from inference.served import ServedModels


def get_models(request: Request) -> ServedModels:
    """The server's base models and their engines."""
    models: ServedModels = request.app.state.models
    return models


ModelsDep = Annotated[ServedModels, Depends(get_models)]

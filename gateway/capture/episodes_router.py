"""Routes of episodes (`/v1/episodes`): mint an episode key, list, read, close, delete, and post rewards."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1", tags=["episodes"])

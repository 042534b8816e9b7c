"""Routes that export captured episodes: their exact token sequences, as JSONL or as Tinker `Datum`s."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1", tags=["episodes"])

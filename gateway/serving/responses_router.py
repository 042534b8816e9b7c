"""OpenAI's Responses API (`POST /v1/responses`) on base and fine-tuned models."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1", tags=["responses"])

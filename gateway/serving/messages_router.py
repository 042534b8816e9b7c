"""Anthropic's Messages API (`POST /v1/messages`) on base and fine-tuned models."""

from __future__ import annotations

from fastapi import APIRouter

router = APIRouter(prefix="/v1", tags=["messages"])

"""Timestamps as the API speaks them: whole unix seconds."""

from __future__ import annotations

from datetime import datetime


def ts(value: datetime | None) -> int | None:
    """Unix seconds of a database timestamp, or None."""
    return int(value.timestamp()) if value is not None else None

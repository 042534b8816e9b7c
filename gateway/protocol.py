"""Shared protocol pieces: the base model of every API shape, and cursor pages."""

from __future__ import annotations

from typing import Any, Generic, Literal, TypeVar

from pydantic import BaseModel, ConfigDict

T = TypeVar("T")


class OpenAIBaseModel(BaseModel):
    """Base of request and response shapes. Unknown request keys are kept (extensions travel that way)."""

    model_config = ConfigDict(extra="allow")


class CursorPage(OpenAIBaseModel, Generic[T]):
    """`{object: "list", data, has_more, first_id, last_id}` — the SDK pages with `after=<last_id>`."""

    object: Literal["list"] = "list"
    data: list[T]
    has_more: bool
    first_id: str | None = None
    last_id: str | None = None

    @classmethod
    def of(cls, items: list[Any], limit: int) -> CursorPage[Any]:
        """A page from up to `limit + 1` fetched items (the extra one only tells that more exist)."""
        has_more = len(items) > limit
        items = items[:limit]
        return cls(
            data=items,
            has_more=has_more,
            first_id=items[0].id if items else None,
            last_id=items[-1].id if items else None,
        )

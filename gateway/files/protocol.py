"""Files API shapes (OpenAI's FileObject)."""

from __future__ import annotations

from typing import Literal

from gateway.files.store import FileRow
from gateway.protocol import OpenAIBaseModel
from gateway.timeutil import ts

# OpenAI's upload purposes, plus `environment` (an environment package, a tunegate extension).
PURPOSES = ("assistants", "batch", "fine-tune", "vision", "user_data", "evals", "environment")


class FileObject(OpenAIBaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: str
    expires_at: int | None = None
    status_details: str | None = None

    @classmethod
    def from_row(cls, row: FileRow) -> FileObject:
        return cls(
            id=row.id,
            bytes=row.bytes,
            created_at=ts(row.created_at) or 0,
            filename=row.filename,
            purpose=row.purpose,
            status=row.status,
            expires_at=ts(row.expires_at),
            status_details=row.status_details,
        )


class FileDeleted(OpenAIBaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True

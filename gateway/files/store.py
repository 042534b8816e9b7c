"""Files: plain SQL, and the frozen rows it returns. Every query is scoped by organisation."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from gateway.db import Conn, maybe_row_to, row_to, rows_to


@dataclass(frozen=True, slots=True)
class FileRow:
    id: str
    organization_id: str
    filename: str
    purpose: str
    bytes: int
    sha256: str
    status: str
    status_details: str | None
    blob_key: str
    line_count: int | None
    created_at: datetime
    expires_at: datetime | None


INSERT = """
INSERT INTO files (id, organization_id, filename, purpose, bytes, sha256, status, blob_key, line_count,
                   expires_at)
VALUES ($1, $2, $3, $4, $5, $6, 'processed', $7, $8, $9) RETURNING *"""
GET = "SELECT * FROM files WHERE id = $1 AND organization_id = $2"
DELETE = "DELETE FROM files WHERE id = $1 AND organization_id = $2 RETURNING *"
# after: the cursor's seq (NULL = first page); purpose: NULL = any
LIST_DESC = """
SELECT * FROM files
WHERE organization_id = $1 AND ($2::text IS NULL OR purpose = $2)
  AND ($3::text IS NULL OR seq < (SELECT seq FROM files WHERE id = $3 AND organization_id = $1))
ORDER BY seq DESC LIMIT $4"""
LIST_ASC = """
SELECT * FROM files
WHERE organization_id = $1 AND ($2::text IS NULL OR purpose = $2)
  AND ($3::text IS NULL OR seq > (SELECT seq FROM files WHERE id = $3 AND organization_id = $1))
ORDER BY seq ASC LIMIT $4"""


async def insert(
    conn: Conn,
    *,
    file_id: str,
    org_id: str,
    filename: str,
    purpose: str,
    size: int,
    sha256: str,
    blob_key: str,
    line_count: int | None,
    expires_at: datetime | None,
) -> FileRow:
    record = await conn.fetchrow(
        INSERT, file_id, org_id, filename, purpose, size, sha256, blob_key, line_count, expires_at
    )
    return row_to(FileRow, record)


async def get(conn: Conn, *, org_id: str, file_id: str) -> FileRow | None:
    return maybe_row_to(FileRow, await conn.fetchrow(GET, file_id, org_id))


async def delete(conn: Conn, *, org_id: str, file_id: str) -> FileRow | None:
    return maybe_row_to(FileRow, await conn.fetchrow(DELETE, file_id, org_id))


async def list_page(
    conn: Conn,
    *,
    org_id: str,
    purpose: str | None,
    after: str | None,
    limit: int,
    order: str,
) -> list[FileRow]:
    sql = LIST_ASC if order == "asc" else LIST_DESC
    return rows_to(FileRow, await conn.fetch(sql, org_id, purpose, after, limit))

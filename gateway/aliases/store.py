"""Aliases: plain SQL, scoped by organisation, and the frozen rows it returns."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from gateway.db import Conn, maybe_row_to, row_to, rows_to


@dataclass(frozen=True, slots=True)
class AliasRow:
    organization_id: str
    name: str
    model: str
    created_at: datetime
    updated_at: datetime


UPSERT = """
INSERT INTO model_aliases (organization_id, name, model) VALUES ($1, $2, $3)
ON CONFLICT (organization_id, name) DO UPDATE SET model = excluded.model, updated_at = now()
RETURNING *"""
GET = "SELECT * FROM model_aliases WHERE organization_id = $1 AND name = $2"
LIST = "SELECT * FROM model_aliases WHERE organization_id = $1 ORDER BY name"
DELETE = "DELETE FROM model_aliases WHERE organization_id = $1 AND name = $2 RETURNING *"


async def upsert(conn: Conn, *, org_id: str, name: str, model: str) -> AliasRow:
    """Create alias `name`, or move it to `model` (committed when this returns: requests admitted from now on
    are served by `model`)."""
    return row_to(AliasRow, await conn.fetchrow(UPSERT, org_id, name, model))


async def get(conn: Conn, *, org_id: str, name: str) -> AliasRow | None:
    return maybe_row_to(AliasRow, await conn.fetchrow(GET, org_id, name))


async def list_for_org(conn: Conn, *, org_id: str) -> list[AliasRow]:
    return rows_to(AliasRow, await conn.fetch(LIST, org_id))


async def delete(conn: Conn, *, org_id: str, name: str) -> AliasRow | None:
    return maybe_row_to(AliasRow, await conn.fetchrow(DELETE, org_id, name))

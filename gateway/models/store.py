"""Fine-tuned models: plain SQL, scoped by organisation, and the frozen rows it returns."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from gateway.db import Conn, maybe_row_to, row_to, rows_to


@dataclass(frozen=True, slots=True)
class ModelRow:
    id: str
    organization_id: str
    base_model: str
    job_id: str | None
    adapter_path: str
    created_at: datetime
    version: str | None
    """The adapter's version id (`gateway.serving.versions`); None until first resolved for rows written
    before versions."""


INSERT = """
INSERT INTO models (id, organization_id, base_model, job_id, adapter_path, version)
VALUES ($1, $2, $3, $4, $5, $6)
ON CONFLICT (id) DO UPDATE SET adapter_path = excluded.adapter_path, version = excluded.version RETURNING *"""
GET = "SELECT * FROM models WHERE id = $1 AND organization_id = $2"
LIST = "SELECT * FROM models WHERE organization_id = $1 ORDER BY seq"
DELETE = "DELETE FROM models WHERE id = $1 AND organization_id = $2 RETURNING *"


async def insert(
    conn: Conn,
    *,
    model_id: str,
    org_id: str,
    base_model: str,
    job_id: str | None,
    adapter_path: str,
    version: str | None,
) -> ModelRow:
    return row_to(
        ModelRow, await conn.fetchrow(INSERT, model_id, org_id, base_model, job_id, adapter_path, version)
    )


async def get(conn: Conn, *, org_id: str, model_id: str) -> ModelRow | None:
    return maybe_row_to(ModelRow, await conn.fetchrow(GET, model_id, org_id))


async def list_for_org(conn: Conn, *, org_id: str) -> list[ModelRow]:
    return rows_to(ModelRow, await conn.fetch(LIST, org_id))


async def delete(conn: Conn, *, org_id: str, model_id: str) -> ModelRow | None:
    return maybe_row_to(ModelRow, await conn.fetchrow(DELETE, model_id, org_id))

"""Fine-tuned models: plain SQL, scoped by organisation."""

from __future__ import annotations

import asyncpg

from gateway.db import Conn

INSERT = """
INSERT INTO models (id, organization_id, base_model, job_id, adapter_path)
VALUES ($1, $2, $3, $4, $5)
ON CONFLICT (id) DO UPDATE SET adapter_path = excluded.adapter_path RETURNING *"""
GET = "SELECT * FROM models WHERE id = $1 AND organization_id = $2"
LIST = "SELECT * FROM models WHERE organization_id = $1 ORDER BY seq"
DELETE = "DELETE FROM models WHERE id = $1 AND organization_id = $2 RETURNING *"


async def insert(
    conn: Conn, *, model_id: str, org_id: str, base_model: str, job_id: str | None, adapter_path: str
) -> asyncpg.Record:
    return await conn.fetchrow(INSERT, model_id, org_id, base_model, job_id, adapter_path)


async def get(conn: Conn, *, org_id: str, model_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(GET, model_id, org_id)


async def list_for_org(conn: Conn, *, org_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(LIST, org_id)


async def delete(conn: Conn, *, org_id: str, model_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(DELETE, model_id, org_id)

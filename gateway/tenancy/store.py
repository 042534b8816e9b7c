"""Organisations and API keys: plain SQL."""

from __future__ import annotations

import asyncpg

from gateway.db import Conn
from gateway.ids import new_id

INSERT_ORG = "INSERT INTO organizations (id, name) VALUES ($1, $2) RETURNING *"
GET_ORG = "SELECT * FROM organizations WHERE id = $1"
LIST_ORGS = "SELECT * FROM organizations ORDER BY seq"
INSERT_KEY = """
INSERT INTO api_keys (id, organization_id, name, display_prefix, digest)
VALUES ($1, $2, $3, $4, $5) RETURNING *"""
LIST_KEYS = "SELECT * FROM api_keys WHERE organization_id = $1 ORDER BY seq"
REVOKE_KEY = """
UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1 RETURNING *"""
KEY_BY_DIGEST = """
SELECT k.id, k.organization_id FROM api_keys k WHERE k.digest = $1 AND k.revoked_at IS NULL"""
TOUCH_KEYS = "UPDATE api_keys SET last_used_at = now() WHERE id = ANY($1::text[])"


async def create_org(conn: Conn, *, name: str) -> asyncpg.Record:
    return await conn.fetchrow(INSERT_ORG, new_id("org-"), name)


async def get_org(conn: Conn, *, org_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(GET_ORG, org_id)


async def list_orgs(conn: Conn) -> list[asyncpg.Record]:
    return await conn.fetch(LIST_ORGS)


async def create_key(
    conn: Conn,
    *,
    org_id: str,
    name: str | None,
    display_prefix: str,
    digest: bytes,
) -> asyncpg.Record:
    return await conn.fetchrow(INSERT_KEY, new_id("key_"), org_id, name, display_prefix, digest)


async def list_keys(conn: Conn, *, org_id: str) -> list[asyncpg.Record]:
    return await conn.fetch(LIST_KEYS, org_id)


async def revoke_key(conn: Conn, *, key_id: str) -> asyncpg.Record | None:
    return await conn.fetchrow(REVOKE_KEY, key_id)


async def key_by_digest(conn: Conn, *, digest: bytes) -> asyncpg.Record | None:
    return await conn.fetchrow(KEY_BY_DIGEST, digest)


async def touch_keys(conn: Conn, *, key_ids: list[str]) -> None:
    await conn.execute(TOUCH_KEYS, key_ids)

"""Organisations and API keys: plain SQL, and the frozen rows it returns."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from gateway.db import Conn, maybe_row_to, row_to, rows_to
from gateway.ids import new_id


@dataclass(frozen=True, slots=True)
class OrgRow:
    id: str
    name: str
    created_at: datetime


@dataclass(frozen=True, slots=True)
class KeyRow:
    """An API key as the admin API shows it (never its digest)."""

    id: str
    organization_id: str
    name: str | None
    display_prefix: str
    kind: str
    created_at: datetime
    last_used_at: datetime | None
    revoked_at: datetime | None
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class LiveKey:
    """A key found by its digest: not revoked, not expired (the per-request lookup)."""

    id: str
    organization_id: str
    kind: str
    name: str | None
    expires_in_s: float | None
    """Seconds until it expires; None when it never does."""


INSERT_ORG = "INSERT INTO organizations (id, name) VALUES ($1, $2) RETURNING *"
GET_ORG = "SELECT * FROM organizations WHERE id = $1"
LIST_ORGS = "SELECT * FROM organizations ORDER BY seq"
INSERT_KEY = """
INSERT INTO api_keys (id, organization_id, name, display_prefix, digest, kind, expires_at)
VALUES ($1, $2, $3, $4, $5, $6, now() + make_interval(secs => $7)) RETURNING *"""
# kind: NULL = every kind
LIST_KEYS = """
SELECT * FROM api_keys WHERE organization_id = $1 AND ($2::text IS NULL OR kind = $2) ORDER BY seq"""
REVOKE_KEY = """
UPDATE api_keys SET revoked_at = coalesce(revoked_at, now()) WHERE id = $1 RETURNING *"""
# A live key: not revoked, not expired. `expires_in_s` lets the cache keep it no longer than it lives.
KEY_BY_DIGEST = """
SELECT k.id, k.organization_id, k.kind, k.name,
       extract(epoch FROM k.expires_at - now())::float8 AS expires_in_s
FROM api_keys k
WHERE k.digest = $1 AND k.revoked_at IS NULL AND (k.expires_at IS NULL OR k.expires_at > now())"""
# Every live key minted for one piece of work, found by what `scoped.mint` named it (people's keys are of
# kind `user`, so no name a person gives a key can match).
REVOKE_MINTED = """
UPDATE api_keys SET revoked_at = now()
WHERE organization_id = $1 AND kind = $2 AND name = $3 AND revoked_at IS NULL RETURNING id"""
# A minted key lives on while its holder renews it; a revoked one stays revoked.
RENEW_KEY = """
UPDATE api_keys SET expires_at = now() + make_interval(secs => $2)
WHERE id = $1 AND revoked_at IS NULL AND expires_at IS NOT NULL RETURNING id"""
TOUCH_KEYS = "UPDATE api_keys SET last_used_at = now() WHERE id = ANY($1::text[])"


async def create_org(conn: Conn, *, name: str) -> OrgRow:
    return row_to(OrgRow, await conn.fetchrow(INSERT_ORG, new_id("org-"), name))


async def get_org(conn: Conn, *, org_id: str) -> OrgRow | None:
    return maybe_row_to(OrgRow, await conn.fetchrow(GET_ORG, org_id))


async def list_orgs(conn: Conn) -> list[OrgRow]:
    return rows_to(OrgRow, await conn.fetch(LIST_ORGS))


async def create_key(
    conn: Conn,
    *,
    org_id: str,
    name: str | None,
    display_prefix: str,
    digest: bytes,
    kind: str = "user",
    ttl_s: float | None = None,
) -> KeyRow:
    """A key row; with `ttl_s`, one that expires that many seconds from now."""
    record = await conn.fetchrow(
        INSERT_KEY, new_id("key_"), org_id, name, display_prefix, digest, kind, ttl_s
    )
    return row_to(KeyRow, record)


async def list_keys(conn: Conn, *, org_id: str, kind: str | None = "user") -> list[KeyRow]:
    """An organisation's keys of one kind (None: of every kind)."""
    return rows_to(KeyRow, await conn.fetch(LIST_KEYS, org_id, kind))


async def revoke_key(conn: Conn, *, key_id: str) -> KeyRow | None:
    return maybe_row_to(KeyRow, await conn.fetchrow(REVOKE_KEY, key_id))


async def revoke_minted(conn: Conn, *, org_id: str, kind: str, name: str) -> list[str]:
    """Revoke the organisation's live keys of `kind` named `name`; returns their ids."""
    return [row["id"] for row in await conn.fetch(REVOKE_MINTED, org_id, kind, name)]


async def renew_key(conn: Conn, *, key_id: str, ttl_s: float) -> bool:
    """Push an expiring key's end to `ttl_s` from now; False when it is revoked (or never expires)."""
    return await conn.fetchval(RENEW_KEY, key_id, ttl_s) is not None


async def key_by_digest(conn: Conn, *, digest: bytes) -> LiveKey | None:
    return maybe_row_to(LiveKey, await conn.fetchrow(KEY_BY_DIGEST, digest))


async def touch_keys(conn: Conn, *, key_ids: list[str]) -> None:
    await conn.execute(TOUCH_KEYS, key_ids)

"""Organisations and keys: what the admin API and the CLI do."""

from __future__ import annotations

import asyncpg

from gateway.errors import not_found
from gateway.tenancy import store
from gateway.tenancy.keys import Authenticator, generate_key
from gateway.tenancy.protocol import ApiKey, Organization


async def create_org(pool: asyncpg.Pool, name: str) -> Organization:
    return Organization.from_row(await store.create_org(pool, name=name))


async def get_org(pool: asyncpg.Pool, org_id: str) -> Organization:
    row = await store.get_org(pool, org_id=org_id)
    if row is None:
        raise not_found("organization", org_id, param="org_id")
    return Organization.from_row(row)


async def list_orgs(pool: asyncpg.Pool) -> list[Organization]:
    return [Organization.from_row(r) for r in await store.list_orgs(pool)]


async def create_key(pool: asyncpg.Pool, org_id: str, name: str | None) -> ApiKey:
    await get_org(pool, org_id)
    plaintext, display, digest = generate_key()
    row = await store.create_key(pool, org_id=org_id, name=name, display_prefix=display, digest=digest)
    return ApiKey.from_row(row, key=plaintext)


async def list_keys(pool: asyncpg.Pool, org_id: str, kind: str | None = "user") -> list[ApiKey]:
    """An organisation's keys of one kind (None: every kind)."""
    await get_org(pool, org_id)
    return [ApiKey.from_row(r) for r in await store.list_keys(pool, org_id=org_id, kind=kind)]


async def revoke_key(pool: asyncpg.Pool, auth: Authenticator | None, key_id: str) -> ApiKey:
    row = await store.revoke_key(pool, key_id=key_id)
    if row is None:
        raise not_found("API key", key_id, param="key_id")
    if auth is not None:
        auth.forget_key(key_id)
    return ApiKey.from_row(row)

"""Keys the gateway mints for its own work (`gateway.tenancy.scoped`): scoped to their organisation, good
for the inference routes only, listed apart from people's keys, and dead once expired or revoked."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path

import httpx
import openai
import pytest

from gateway.app import create_app
from gateway.db import create_pool
from gateway.errors import AuthenticationFailed
from gateway.settings import Settings
from gateway.tenancy import scoped
from gateway.tenancy.keys import Authenticator
from tests.support.stack import Admin, GatewayServer, Tenant

MESSAGES = [{"role": "user", "content": "hi"}]
INFERENCE = (
    "/v1/chat/completions",
    "/v1/completions",
    "/v1/responses",
    "/v1/messages",
    "/v1/messages/count_tokens",  # Claude Code counts before it sends
)
OPEN = ("/healthz", "/readyz", "/metrics", "/api/v1/healthz")


def _mint(database: str, org_id: str, ttl_s: float, kind: str = "eval") -> scoped.MintedKey:
    async def run() -> scoped.MintedKey:
        pool = await create_pool(database, max_size=1)
        try:
            return await scoped.mint(pool, org_id=org_id, kind=kind, name="test run", ttl_s=ttl_s)
        finally:
            await pool.close()

    return asyncio.run(run())


def test_minted_key_calls_inference_only_and_is_listed_apart(
    stack: GatewayServer, admin: Admin, tenant: Tenant
) -> None:
    key = _mint(stack.settings.database_url or "", tenant.org_id, ttl_s=600)
    assert key.organization_id == tenant.org_id and key.secret not in repr(key)
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key=key.secret, max_retries=0)

    # Past authentication on the inference route: the model lookup answers (a 401 would come first).
    with pytest.raises(openai.NotFoundError) as err:
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert err.value.code == "model_not_found"
    for call in (client.files.list, client.fine_tuning.jobs.list, client.models.list, client.evals.list):
        with pytest.raises(openai.PermissionDeniedError) as denied:
            call()
        assert denied.value.code == "permission_denied"
    usage = httpx.get(
        f"{stack.url}/v1/organization/usage/completions",
        params={"start_time": 0},
        headers={"Authorization": f"Bearer {key.secret}"},
    )
    assert usage.status_code == 403 and usage.json()["error"]["code"] == "permission_denied"

    people = admin.http.get(f"/v1/admin/organizations/{tenant.org_id}/api_keys").json()["data"]
    assert [k["id"] for k in people] == [tenant.key_id] and people[0]["kind"] == "user"
    assert people[0]["expires_at"] is None
    every = admin.http.get(f"/v1/admin/organizations/{tenant.org_id}/api_keys", params={"kind": "all"})
    assert [k["id"] for k in every.json()["data"]] == [tenant.key_id, key.id]
    minted = admin.http.get(f"/v1/admin/organizations/{tenant.org_id}/api_keys", params={"kind": "eval"})
    (shown,) = minted.json()["data"]
    assert shown["id"] == key.id and shown["kind"] == "eval" and shown["expires_at"] > shown["created_at"]
    assert shown["key"] is None

    admin.http.delete(f"/v1/admin/api_keys/{key.id}").raise_for_status()
    with pytest.raises(openai.AuthenticationError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES)


async def test_expired_key_is_refused_even_when_cached(database: str, tenant: Tenant) -> None:
    pool = await create_pool(database, max_size=2)
    auth = Authenticator(pool, ttl_s=600)  # a cache that would otherwise trust it for ten minutes
    try:
        key = await scoped.mint(pool, org_id=tenant.org_id, kind="job", name="short", ttl_s=1.0)
        who = await auth.authenticate(key.secret)
        assert (who.organization_id, who.api_key_id, who.kind) == (tenant.org_id, key.id, "job")
        await asyncio.sleep(1.2)
        with pytest.raises(AuthenticationFailed):
            await auth.authenticate(key.secret)

        kept = await scoped.mint(pool, org_id=tenant.org_id, kind="eval", name="renewed", ttl_s=1.0)
        assert await scoped.renew(pool, kept.id, ttl_s=600)
        await asyncio.sleep(1.2)
        assert (await auth.authenticate(kept.secret)).api_key_id == kept.id
        await scoped.revoke(pool, kept.id)
        assert not await scoped.renew(pool, kept.id, ttl_s=600)  # a revoked key stays revoked
    finally:
        await pool.close()


async def test_minted_block_revokes_its_key(database: str, tenant: Tenant) -> None:
    pool = await create_pool(database, max_size=2)
    try:
        with pytest.raises(RuntimeError):
            async with scoped.minted(pool, org_id=tenant.org_id, kind="eval", name="b", ttl_s=600) as key:
                raise RuntimeError("the work failed")
        revoked = await pool.fetchval("SELECT revoked_at FROM api_keys WHERE id = $1", key.id)
        assert revoked is not None
        with pytest.raises(ValueError):
            await scoped.mint(pool, org_id=tenant.org_id, kind="user", name="no", ttl_s=1)
    finally:
        await pool.close()


def test_minted_keys_are_refused_on_every_route_but_inference(
    stack: GatewayServer, tenant: Tenant, tmp_path: Path
) -> None:
    """Every route of the app, filled with dummy ids: a minted key is 403 wherever a key is checked but on
    the inference routes (admin routes want the admin key: 401)."""
    key = _mint(stack.settings.database_url or "", tenant.org_id, ttl_s=600, kind="job")
    paths = create_app(Settings(data_dir=tmp_path)).openapi()["paths"]
    checked = 0
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key.secret}"}) as http:
        for path, operations in paths.items():
            if path in INFERENCE or path in OPEN:
                continue
            url = re.sub(r"\{[^}]+\}", "x", path)
            for method in operations:
                resp = http.request(method.upper(), url, params={"start_time": 0}, json={})
                error = resp.json()["error"]
                if path.startswith("/v1/admin/"):
                    assert resp.status_code == 401, (method, path, resp.text)
                else:
                    assert (resp.status_code, error["code"]) == (403, "permission_denied"), (method, path)
                    checked += 1
    assert checked > 20

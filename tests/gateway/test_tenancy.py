"""Organisations, API keys, authentication and the error envelope."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.support.stack import Admin, GatewayServer, Tenant


def test_admin_creates_org_and_key_that_works(admin: Admin) -> None:
    org = admin.http.post("/v1/admin/organizations", json={"name": "Initech"}).json()
    assert org["object"] == "organization" and org["id"].startswith("org-") and org["name"] == "Initech"
    assert admin.http.get(f"/v1/admin/organizations/{org['id']}").json() == org
    assert org["id"] in [o["id"] for o in admin.http.get("/v1/admin/organizations").json()["data"]]

    made = admin.http.post(f"/v1/admin/organizations/{org['id']}/api_keys", json={}).json()
    assert made["key"].startswith("sk-") and len(made["key"]) >= 32
    listed = admin.http.get(f"/v1/admin/organizations/{org['id']}/api_keys").json()["data"]
    assert [k["id"] for k in listed] == [made["id"]]
    assert listed[0]["key"] is None  # the plaintext is shown only once
    assert made["key"] not in str(listed)
    client = openai.OpenAI(base_url=f"{admin.gateway_url}/v1", api_key=made["key"], max_retries=0)
    assert "tiny-chat" in [m.id for m in client.models.list().data]


def test_admin_api_needs_the_admin_key(stack: GatewayServer, tenant: Tenant) -> None:
    for headers in ({}, {"Authorization": "Bearer nope"}, {"Authorization": f"Bearer {tenant.key}"}):
        r = httpx.post(f"{stack.url}/v1/admin/organizations", json={"name": "x"}, headers=headers)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert set(r.json()["error"]) == {"message", "type", "param", "code"}


def test_unknown_org_is_404(admin: Admin) -> None:
    r = admin.http.get("/v1/admin/organizations/org-missing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"
    r = admin.http.post("/v1/admin/organizations/org-missing/api_keys", json={})
    assert r.status_code == 404


def test_bad_key_is_authentication_error(stack: GatewayServer) -> None:
    client = openai.OpenAI(base_url=f"{stack.url}/v1", api_key="sk-tg-not-a-real-key", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        client.models.list()
    assert err.value.code == "invalid_api_key"
    r = httpx.get(f"{stack.url}/v1/files")
    assert r.status_code == 401 and r.headers["x-request-id"].startswith("req_")


def test_revoked_key_stops_working(admin: Admin, tenant: Tenant) -> None:
    tenant.client.models.list()
    revoked = admin.http.delete(f"/v1/admin/api_keys/{tenant.key_id}").json()
    assert revoked["revoked_at"] is not None
    with pytest.raises(openai.AuthenticationError):
        tenant.client.models.list()


def test_key_use_is_recorded(admin: Admin, tenant: Tenant) -> None:
    import time

    tenant.client.models.list()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        keys = admin.http.get(f"/v1/admin/organizations/{tenant.org_id}/api_keys").json()["data"]
        if keys[0]["last_used_at"] is not None:
            break
        time.sleep(0.5)
    assert keys[0]["last_used_at"] is not None


def test_every_response_has_a_request_id_and_errors_use_the_envelope(
    stack: GatewayServer, tenant: Tenant
) -> None:
    h = {"Authorization": f"Bearer {tenant.key}"}
    r = httpx.get(f"{stack.url}/v1/no/such/route", headers=h)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
    r = httpx.post(f"{stack.url}/v1/fine_tuning/jobs", headers=h, json={"model": 3})
    assert r.status_code == 400
    assert r.json()["error"]["param"] in ("model", "training_file")
    assert r.headers["x-request-id"]


def test_health_ready_metrics(stack: GatewayServer) -> None:
    assert httpx.get(f"{stack.url}/healthz").json() == {"status": "ok"}
    ready = httpx.get(f"{stack.url}/readyz")
    assert ready.status_code == 200 and ready.json()["checks"] == {"database": "ok", "redis": "ok"}
    text = httpx.get(f"{stack.url}/metrics").text
    assert "tunegate_http_requests_total" in text and 'route="/healthz"' in text

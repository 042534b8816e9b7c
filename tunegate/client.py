"""The `openai` client that tunegate's own client commands (`jobs follow`, `quickstart`) use, and the one way
to make a tenant through the admin API (`provision_tenant`: the quickstart's, the tests' and the benches').

The gateway URL and key come from command-line options or from the settings object (`TUNEGATE_BASE_URL`,
`TUNEGATE_API_KEY`); nothing here reads the environment itself.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, NamedTuple

from gateway.settings import Settings

if TYPE_CHECKING:
    import httpx
    import openai

logger = logging.getLogger(__name__)


def api_base_url(settings: Settings, override: str | None = None) -> str:
    """The gateway's OpenAI base URL (ending in `/v1`): the option, else `base_url`, else host and port."""
    url = override or settings.base_url or f"http://{settings.host}:{settings.port}/v1"
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def root_url(base_url: str) -> str:
    """The gateway's root (where `/readyz` and the admin API live) from its `/v1` base URL."""
    return base_url.rstrip("/").removesuffix("/v1")


def make_client(
    settings: Settings, *, base_url: str | None = None, api_key: str | None = None, timeout: float = 120.0
) -> openai.OpenAI:
    """An `openai.OpenAI` pointed at the gateway. Raises `ValueError` when no API key is known."""
    import openai

    key = api_key or (settings.api_key.get_secret_value() if settings.api_key else None)
    if not key:
        raise ValueError("no API key: pass --api-key or set TUNEGATE_API_KEY")
    return openai.OpenAI(base_url=api_base_url(settings, base_url), api_key=key, timeout=timeout)


class NewTenant(NamedTuple):
    """An organisation made through the admin API, with its first API key."""

    org_id: str
    key_id: str
    key: str
    """The key itself (the admin API shows it only this once)."""


def provision_tenant(admin: httpx.Client, name: str, key_name: str = "default") -> NewTenant:
    """Make organisation `name` and an API key `key_name` for it with `admin` (an httpx client of the
    gateway's root that sends the admin key). Raises `httpx.HTTPStatusError` on a refusal."""
    org = admin.post("/v1/admin/organizations", json={"name": name})
    org.raise_for_status()
    org_id: str = org.json()["id"]
    key = admin.post(f"/v1/admin/organizations/{org_id}/api_keys", json={"name": key_name})
    key.raise_for_status()
    return NewTenant(org_id, key.json()["id"], key.json()["key"])

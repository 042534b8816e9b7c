"""The models page in Chromium: an organisation's aliases, one moved from the page, and where its fine-tuned
models are loaded (what the gateway knows of its engine)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import asyncpg
import httpx
import pytest
from playwright.sync_api import expect

from gateway.serving.versions import adapter_version
from tests.dashboard.conftest import Tab
from tests.support.data import BASE, MESSAGES
from tests.support.engine import ft_model, make_lora_adapter
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant

pytestmark = pytest.mark.timeout(600)

gw = gateway_fixture("dashboard-models")
OpenTab = Callable[[], Tab]


@pytest.fixture(scope="module")
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("dash-models")


@pytest.fixture(scope="module")
def models(
    gw: GatewayServer, org: Tenant, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[tuple[str, str]]:
    """Two fine-tuned models of `org` and their versions (made before the browser's event loop runs)."""
    root = tmp_path_factory.mktemp("models-page")
    adapters = [make_lora_adapter(tiny_model_dir, root / f"lora{i}", seed=900 + i) for i in range(2)]
    made = [(ft_model(gw, org, a), adapter_version(str(a))) for a in adapters]

    async def name_their_method() -> None:  # the jobs page the sign-in lands on reads each job's method
        conn = await asyncpg.connect(gw.settings.database_url)
        try:
            await conn.execute(
                "UPDATE fine_tuning_jobs SET method = $2::jsonb WHERE organization_id = $1",
                org.org_id,
                '{"type": "supervised", "supervised": {"hyperparameters": {}}}',
            )
        finally:
            await conn.close()

    asyncio.run(name_their_method())
    return made


def test_an_alias_moved_from_the_page_and_the_models_residency(
    models: list[tuple[str, str]], gw: GatewayServer, org: Tenant, open_tab: OpenTab
) -> None:
    (first, first_version), (second, second_version) = models
    with httpx.Client(
        base_url=gw.url, headers={"authorization": f"Bearer {org.key}"}, timeout=120, trust_env=False
    ) as http:
        chat = {"model": first, "messages": MESSAGES, "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200  # loads it on the engine
        made = http.post("/v1/aliases", json={"name": "prod", "model": first})
        assert made.status_code == 200, made.text

        tab = open_tab()
        page = tab.sign_in(org.key)
        page.goto("/dashboard/models")
        row = page.locator("#aliases tr", has_text="prod")
        expect(row).to_contain_text(first)
        loaded = page.locator("#models tr", has_text=first)
        expect(loaded).to_contain_text(first_version)
        expect(loaded).to_contain_text("engine 0: loaded")
        expect(loaded).to_contain_text("last used")
        row.locator("select.move-to").select_option(second)
        row.locator("button.move").click()
        expect(page.locator("#aliases tr", has_text="prod")).to_contain_text(second_version)

        alias = http.get("/v1/aliases/prod").json()
        assert alias["model"] == second and alias["version"] == second_version
        served = http.post("/v1/chat/completions", json={**chat, "model": "prod"})
        assert served.headers["x-tunegate-model-version"] == alias["version"]
        assert BASE in {m["id"] for m in http.get("/v1/models").json()["data"]}
    assert tab.console_errors() == []

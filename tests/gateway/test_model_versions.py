"""Immutable adapter versions and movable aliases, on both engines.

Every adapter is served under a version id derived from its files (`gateway.serving.versions`); engines are
given only versions; every answer names its version (`X-Tunegate-Model-Version`, `system_fingerprint`);
aliases move between models and a request admitted after a move is served by the new model.

Each serving test runs on two gateways: one in front of an embedded engine holding a single adapter
(`max_loras=1`), one in front of the session's vLLM (2 adapters; skipped where vLLM is not installed).
Models are registered as the worker records them, with random LoRA adapters and no version yet (the first
request computes and stores it).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from gateway.serving.versions import adapter_version
from tests.support.data import BASE, MESSAGES
from tests.support.engine import EngineServer, ft_model, make_lora_adapter, register_model
from tests.support.fixtures import gateway_fixture
from tests.support.stack import GatewayServer, Tenant, admin_of
from tests.support.vllm import vllm_gateway_fixture

pytestmark = pytest.mark.timeout(900)  # vLLM's start, when this module is the first to use it

WARM_PREFIX = "You are a terse assistant. Answer in one word. " * 8
"""A system prompt every request of the alias test shares (engines keep its prefix cached)."""


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    """Five adapters of rank 8 with different weights."""
    root = tmp_path_factory.mktemp("version-adapters")
    return [str(make_lora_adapter(tiny_model_dir, root / f"lora{i}", seed=500 + i)) for i in range(5)]


@pytest.fixture(scope="module")
def one_slot_engine(tiny_model_dir: Path) -> Iterator[EngineServer]:
    """An embedded engine that holds one adapter at a time."""
    server = EngineServer.start({BASE: str(tiny_model_dir)}, max_loras=1)
    yield server
    server.stop()


embedded_gw = gateway_fixture("versions", engine="one_slot_engine")
"""A gateway in front of the embedded engine that holds one adapter at a time."""

vllm_gw = vllm_gateway_fixture("versions")


@dataclass
class Stack:
    """A gateway, its engine's URL and an organisation of it."""

    name: str
    gateway: GatewayServer
    engine_url: str
    org: Tenant

    def http(self, tenant: Tenant | None = None) -> httpx.Client:
        key = (tenant or self.org).key
        return httpx.Client(
            base_url=self.gateway.url,
            headers={"authorization": f"Bearer {key}"},
            timeout=120,
            trust_env=False,
        )

    def engine_models(self) -> set[str]:
        with httpx.Client(trust_env=False, timeout=30) as http:
            return {m["id"] for m in http.get(f"{self.engine_url}/v1/models").json()["data"]}


@pytest.fixture(scope="module", params=["embedded", "vllm"])
def stack(request: pytest.FixtureRequest) -> Stack:
    if request.param == "embedded":
        gateway = request.getfixturevalue("embedded_gw")
        url = request.getfixturevalue("one_slot_engine").url
    else:
        gateway = request.getfixturevalue("vllm_gw")
        url = request.getfixturevalue("vllm_server").url
    org = admin_of(gateway).tenant("versions-" + secrets.token_hex(3))
    return Stack(request.param, gateway, url, org)


@pytest.fixture(scope="module")
def versions(adapters: list[str]) -> list[str]:
    return [adapter_version(a) for a in adapters]


def _chat(http: httpx.Client, model: str, **extra: Any) -> httpx.Response:
    body = {"model": model, "messages": MESSAGES, "max_tokens": 2, "temperature": 0, **extra}
    return http.post("/v1/chat/completions", json=body)


def _served(resp: httpx.Response) -> str:
    """The version an answer names, checked to be the same in its header and its body."""
    assert resp.status_code == 200, resp.text
    version = resp.headers["x-tunegate-model-version"]
    assert resp.json()["system_fingerprint"] == version
    return version


def _db(stack: Stack, query: str, *args: Any) -> Any:
    import asyncio

    async def run() -> Any:
        conn = await asyncpg.connect(stack.gateway.settings.database_url)
        try:
            return await conn.fetchval(query, *args)
        finally:
            await conn.close()

    return asyncio.run(run())


# ------------------------------------------------------------------------------------------ versions
def test_answers_name_their_version_and_engines_know_only_versions(
    stack: Stack, adapters: list[str], versions: list[str]
) -> None:
    model = ft_model(stack.gateway, stack.org, adapters[0])
    twin = ft_model(stack.gateway, stack.org, adapters[0])  # same files, another name: the same version
    ckpt = f"{model}:ckpt-step-2"
    assert stack.gateway.settings.database_url is not None
    database = stack.gateway.settings.database_url
    register_model(database, stack.org.org_id, model + "x", adapters[1], checkpoint=ckpt)
    with stack.http() as http:
        first = _chat(http, model)
        assert _served(first) == versions[0] and versions[0].startswith("v-") and len(versions[0]) == 26
        assert first.json()["model"] == model
        assert _served(_chat(http, twin)) == versions[0]
        assert _served(_chat(http, ckpt)) == versions[1]
        assert _served(_chat(http, versions[0])) == versions[0]  # a version may be named directly
        base = _chat(http, BASE)
        assert _served(base) == BASE
        with http.stream("POST", "/v1/chat/completions", json={
            "model": model, "messages": MESSAGES, "max_tokens": 3, "stream": True,
            "stream_options": {"include_usage": True},
        }) as streamed:  # fmt: skip
            assert streamed.status_code == 200
            assert streamed.headers["x-tunegate-model-version"] == versions[0]
            events = [orjson.loads(line[6:]) for line in streamed.iter_lines() if line.startswith("data: {")]
    assert len(events) >= 2 and all(e["system_fingerprint"] == versions[0] for e in events)
    assert all(e["model"] == model for e in events)
    # the first request stored the version it computed for rows written without one
    assert _db(stack, "SELECT version FROM models WHERE id = $1", model) == versions[0]
    held = stack.engine_models()
    assert model not in held and twin not in held and ckpt not in held
    assert versions[0] in held or versions[1] in held  # the engine holds versions (as many as fit)


# ------------------------------------------------------------------------------------------ alias moved
def test_alias_moved_during_traffic_serves_the_new_version_to_later_requests(
    stack: Stack, adapters: list[str], versions: list[str]
) -> None:
    a = ft_model(stack.gateway, stack.org, adapters[0])
    b = ft_model(stack.gateway, stack.org, adapters[1])
    alias = "prod-" + secrets.token_hex(3)
    done = threading.Event()
    answered = 0
    lock = threading.Lock()
    moved_at: list[float] = []
    with stack.http() as http:
        assert http.post("/v1/aliases", json={"name": alias, "model": a}).json()["version"] == versions[0]

        def ask(i: int) -> tuple[float, float, str]:
            nonlocal answered
            messages = [{"role": "system", "content": WARM_PREFIX}, {"role": "user", "content": f"Say {i}."}]
            sent = time.monotonic()
            resp = _chat(http, alias, messages=messages)
            received = time.monotonic()
            with lock:
                answered += 1
                if answered >= 30:
                    done.set()
            return sent, received, _served(resp)

        with ThreadPoolExecutor(6) as pool:
            futures = [pool.submit(ask, i) for i in range(100)]
            assert done.wait(300)
            moved = http.post("/v1/aliases", json={"name": alias, "model": b})
            moved_at.append(time.monotonic())
            assert moved.status_code == 200 and moved.json()["version"] == versions[1]
            results = [f.result() for f in futures]
    after = [v for sent, received, v in results if sent > moved_at[0] and received > moved_at[0]]
    before = [v for sent, _, v in results if sent <= moved_at[0]]
    assert after and set(after) == {versions[1]}, f"{len(after)} after the move"
    assert set(before) <= {versions[0], versions[1]} and versions[0] in before


# ------------------------------------------------------------------------------------------ churn
def test_more_adapters_than_the_engine_holds_round_robin(
    stack: Stack, adapters: list[str], versions: list[str]
) -> None:
    models = [ft_model(stack.gateway, stack.org, path) for path in adapters]
    expected = dict(zip(models, versions, strict=True))
    rounds = 100
    evicted = _embedded_evictions(stack)
    with stack.http() as http:

        def ask(i: int) -> tuple[str, str]:
            model = models[i % len(models)]
            return model, _served(_chat(http, model))

        with ThreadPoolExecutor(3) as pool:
            served = list(pool.map(ask, range(rounds)))
    assert len(served) == rounds
    assert all(expected[model] == version for model, version in served)
    if evicted is not None:  # the embedded engine really swapped adapters in and out of its one slot
        after = _embedded_evictions(stack)
        assert after is not None and after - evicted >= len(models)


def _embedded_evictions(stack: Stack) -> int | None:
    """Adapters the embedded engine evicted so far (None on vLLM, which does not count them)."""
    if stack.name != "embedded":
        return None
    with httpx.Client(trust_env=False, timeout=30) as http:
        stats = http.get(f"{stack.engine_url}/v1/engine/stats").json()
    return int(stats["models"][BASE]["adapter_evictions"])


# ------------------------------------------------------------------------------------------ aliases API
@pytest.fixture(scope="module")
def api(embedded_gw: GatewayServer, one_slot_engine: EngineServer) -> Stack:
    org = admin_of(embedded_gw).tenant("aliases-" + secrets.token_hex(3))
    return Stack("embedded", embedded_gw, one_slot_engine.url, org)


def test_alias_objects_and_their_lifecycle(api: Stack, adapters: list[str], versions: list[str]) -> None:
    a = ft_model(api.gateway, api.org, adapters[2])
    b = ft_model(api.gateway, api.org, adapters[3])
    name = "support." + secrets.token_hex(3)
    with api.http() as http:
        made = http.post("/v1/aliases", json={"name": name, "model": a})
        assert made.status_code == 200
        body = made.json()
        assert set(body) == {"object", "name", "model", "version", "created_at", "updated_at"}
        assert body["object"] == "model.alias" and body["name"] == name and body["model"] == a
        assert body["version"] == versions[2] and body["created_at"] <= body["updated_at"]
        assert http.get(f"/v1/aliases/{name}").json() == body
        listed = http.get("/v1/aliases").json()
        assert listed["object"] == "list" and body in listed["data"]
        assert _served(_chat(http, name)) == versions[2]
        assert _chat(http, name).json()["model"] == name  # answers name what the client asked for

        moved = http.post("/v1/aliases", json={"name": name, "model": b}).json()
        assert moved["model"] == b and moved["version"] == versions[3]
        assert moved["created_at"] == body["created_at"] and moved["updated_at"] >= body["updated_at"]
        assert _served(_chat(http, name)) == versions[3]

        latest = f"{a}:latest"  # the other name form: one of the organisation's model ids, then :latest
        assert http.post("/v1/aliases", json={"name": latest, "model": b}).json()["version"] == versions[3]
        assert _served(_chat(http, latest)) == versions[3]
        on_base = http.post("/v1/aliases", json={"name": "base-" + name, "model": BASE}).json()
        assert on_base["version"] == BASE

        gone = http.delete(f"/v1/aliases/{name}")
        assert gone.json() == {"name": name, "object": "model.alias", "deleted": True}
        missing = http.get(f"/v1/aliases/{name}")
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "alias_not_found"
        assert _chat(http, name).json()["error"]["code"] == "model_not_found"
        assert http.delete(f"/v1/aliases/{name}").status_code == 404


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error: dict[str, Any] = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return error


def test_aliases_are_per_organisation(api: Stack, adapters: list[str], versions: list[str]) -> None:
    other = admin_of(api.gateway).tenant("alias-other-" + secrets.token_hex(3))
    theirs = ft_model(api.gateway, other, adapters[4])
    mine = ft_model(api.gateway, api.org, adapters[2])
    name = "shared-" + secrets.token_hex(3)
    with api.http(other) as them, api.http() as me:
        assert them.post("/v1/aliases", json={"name": name, "model": theirs}).status_code == 200
        assert _error(me.get(f"/v1/aliases/{name}"), 404)["code"] == "alias_not_found"
        assert _error(me.delete(f"/v1/aliases/{name}"), 404)["code"] == "alias_not_found"
        assert name not in {a["name"] for a in me.get("/v1/aliases").json()["data"]}
        error = _error(_chat(me, name), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        # the same name is the caller's own alias in its organisation
        assert me.post("/v1/aliases", json={"name": name, "model": mine}).status_code == 200
        assert _served(_chat(me, name)) == versions[2]
        assert _served(_chat(them, name)) == versions[4]


def test_bad_aliases_and_versions_get_openai_errors(api: Stack, adapters: list[str]) -> None:
    other = admin_of(api.gateway).tenant("alias-bad-" + secrets.token_hex(3))
    theirs = ft_model(api.gateway, other, adapters[4])
    mine = ft_model(api.gateway, api.org, adapters[2])
    first = "first-" + secrets.token_hex(3)
    with api.http() as http:
        error = _error(http.post("/v1/aliases", json={"name": "x-" + first, "model": theirs}), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"
        missing = {"name": "x-" + first, "model": f"{mine}:ckpt-step-99"}
        error = _error(http.post("/v1/aliases", json=missing), 404)
        assert error["code"] == "model_not_found" and error["param"] == "model"

        assert http.post("/v1/aliases", json={"name": first, "model": mine}).status_code == 200
        error = _error(http.post("/v1/aliases", json={"name": "second-" + first, "model": first}), 400)
        assert error["code"] == "alias_loop" and error["param"] == "model"
        error = _error(http.post("/v1/aliases", json={"name": first, "model": first}), 400)
        assert error["code"] == "alias_loop"

        for bad in ("has space", BASE, "v-" + "0" * 24, "-dash", "ft:nobody:latest", "a" * 65, "a/b"):
            error = _error(http.post("/v1/aliases", json={"name": bad, "model": mine}), 400)
            assert error["code"] == "invalid_value" and error["param"] == "name", bad
        error = _error(http.post("/v1/aliases", json={"name": first}), 400)
        assert error["type"] == "invalid_request_error"

        error = _error(_chat(http, "v-" + "0" * 24), 404)  # an unknown version
        assert error["code"] == "model_not_found" and error["param"] == "model"
        # another organisation's version (no model of the caller's has those files) is unknown here
        assert _error(_chat(http, adapter_version(adapters[4])), 404)["code"] == "model_not_found"

        assert http.delete(f"/v1/models/{mine}").status_code == 200  # the alias now points at nothing
        error = _error(_chat(http, first), 404)
        assert error["code"] == "model_not_found" and first in error["message"]
        assert http.get(f"/v1/aliases/{first}").json()["version"] is None

"""Adapters on the engines, as the gateway sees them: drained before an unload, shown on `/v1/models`, counted
on `/metrics`.

A gateway in front of an embedded engine, and for the drain one in front of the session's vLLM too (skipped
where vLLM is not installed); models are registered as the worker records them, with random LoRA adapters.
"""

from __future__ import annotations

import secrets
import threading
from pathlib import Path

import httpx
import orjson
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.serving.versions import adapter_version
from tests.support.data import BASE, MESSAGES
from tests.support.engine import EngineServer, ft_model, make_lora_adapter, resources_of
from tests.support.fixtures import gateway_fixture
from tests.support.stack import GatewayServer, Tenant, admin_of

pytestmark = pytest.mark.timeout(900)  # vLLM's start, when this module is the first to use it


gateway = gateway_fixture("residency")
"""A gateway in front of the module's embedded engine (`engine`)."""


def _engine_models(url: str) -> set[str]:
    with httpx.Client(trust_env=False, timeout=30) as http:
        return {m["id"] for m in http.get(f"{url}/v1/models").json()["data"]}


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("residency-adapters")
    return [str(make_lora_adapter(tiny_model_dir, root / f"lora{i}", seed=700 + i)) for i in range(3)]


@pytest.fixture(scope="module")
def org(gateway: GatewayServer) -> Tenant:
    return admin_of(gateway).tenant("residency-" + secrets.token_hex(3))


def _http(gateway: GatewayServer, tenant: Tenant) -> httpx.Client:
    return httpx.Client(
        base_url=gateway.url,
        headers={"authorization": f"Bearer {tenant.key}"},
        timeout=120,
        trust_env=False,
    )


def _adapter_metrics(gateway: GatewayServer) -> dict[str, float]:
    """`tunegate_adapter_*` samples of `tiny-chat` on `/metrics`, by sample name."""
    with httpx.Client(base_url=gateway.url, trust_env=False, timeout=30) as http:
        text = http.get("/metrics").text
    return {
        s.name: s.value
        for family in text_string_to_metric_families(text)
        if family.name.startswith("tunegate_adapter")
        for s in family.samples
        if s.labels.get("base_model") == BASE and "le" not in s.labels
    }


def test_a_stream_running_while_its_model_is_deleted_finishes_and_the_unload_waits_for_it(
    gateway: GatewayServer, engine: EngineServer, adapters: list[str]
) -> None:
    """On the embedded engine, whose 400-token stream outlasts the delete on any machine (vLLM's ended before
    it in a full run; vLLM finishing streams on an unloaded adapter is shown in test_adapter_churn.py)."""
    engine_url = engine.url
    org = admin_of(gateway).tenant("residency-drain-" + secrets.token_hex(3))
    model = ft_model(gateway, org, adapters[0])
    version = adapter_version(adapters[0])
    upstream = resources_of(gateway).engines.pools[BASE].upstreams[0]
    body = {
        "model": model, "messages": MESSAGES, "max_tokens": 400, "ignore_eos": True, "temperature": 0,
        "stream": True, "stream_options": {"include_usage": True},
    }  # fmt: skip
    events: list[dict] = []
    with _http(gateway, org) as http, http.stream("POST", "/v1/chat/completions", json=body) as streamed:
        assert streamed.status_code == 200
        lines = streamed.iter_lines()
        for line in lines:  # the first chunk: the request is running on the version
            if line.startswith("data: {"):
                events.append(orjson.loads(line[6:]))
                break
        with _http(gateway, org) as other:
            deleted = other.delete(f"/v1/models/{model}")
            assert deleted.status_code == 200, deleted.text  # answered at once, not after the stream
            again = other.post("/v1/chat/completions", json={"model": model, "messages": MESSAGES})
            assert again.status_code == 404 and again.json()["error"]["code"] == "model_not_found"
        assert upstream.running.get(version) == 1
        assert version in _engine_models(engine_url)  # not unloaded under the running stream
        done = False
        for line in lines:
            if line.startswith("data: {"):
                events.append(orjson.loads(line[6:]))
            done = done or line == "data: [DONE]"
    assert done and not any("error" in e for e in events)
    assert all(e["system_fingerprint"] == version for e in events)
    assert events[-1]["usage"]["completion_tokens"] == 400  # the whole answer, on the old version
    assert "".join(c["delta"].get("content") or "" for e in events for c in e["choices"])
    # the unload follows the stream's end
    for _ in range(600):
        if version not in _engine_models(engine_url):
            break
        threading.Event().wait(0.05)
    assert version not in _engine_models(engine_url)
    assert version not in upstream.loaded and not upstream.running.get(version)


def test_models_show_their_version_and_residency_and_metrics_count_adapters(
    gateway: GatewayServer, org: Tenant, adapters: list[str]
) -> None:
    model = ft_model(gateway, org, adapters[1])
    version = adapter_version(adapters[1])
    before = _adapter_metrics(gateway)
    with _http(gateway, org) as http:
        fresh = http.get(f"/v1/models/{model}").json()
        assert set(fresh) == {"id", "object", "created", "owned_by", "tunegate"}
        assert fresh["tunegate"] == {"version": None, "engines": []}  # no request has computed it yet
        for _ in range(2):  # a miss and a load, then a hit
            chat = {"model": model, "messages": MESSAGES, "max_tokens": 2}
            assert http.post("/v1/chat/completions", json=chat).status_code == 200
        one = http.get(f"/v1/models/{model}").json()
        listed = {m["id"]: m for m in http.get("/v1/models").json()["data"]}
    assert one["id"] == model and one["object"] == "model" and one["owned_by"] == org.org_id
    serving = one["tunegate"]
    assert serving["version"] == version
    [place] = serving["engines"]
    assert place["engine"] == 0 and place["loaded"] is True
    assert isinstance(place["last_used"], int) and place["last_used"] > 0
    assert place["load_s"] > 0
    assert "url" not in place and "127.0.0.1" not in orjson.dumps(one).decode()
    assert listed[model] == one
    assert "tunegate" not in listed[BASE]  # base models keep OpenAI's shape
    after = _adapter_metrics(gateway)

    def moved(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert moved("tunegate_adapter_misses_total") >= 1
    assert moved("tunegate_adapter_loads_total") >= 1
    assert moved("tunegate_adapter_hits_total") >= 1
    assert moved("tunegate_adapter_load_seconds_count") == moved("tunegate_adapter_loads_total")
    assert after["tunegate_adapter_load_seconds_sum"] > 0

    # another organisation sees none of it
    stranger = admin_of(gateway).tenant("residency-other-" + secrets.token_hex(3))
    with _http(gateway, stranger) as http:
        hidden = http.get(f"/v1/models/{model}")
        assert hidden.status_code == 404 and hidden.json()["error"]["code"] == "model_not_found"
        assert model not in {m["id"] for m in http.get("/v1/models").json()["data"]}

    with _http(gateway, org) as http:
        assert http.delete(f"/v1/models/{model}").status_code == 200
    assert _adapter_metrics(gateway)["tunegate_adapter_unloads_total"] >= 1


def test_residency_is_what_the_engine_says_it_holds(
    gateway: GatewayServer, engine: EngineServer, org: Tenant, adapters: list[str]
) -> None:
    """Loaded or not as the engine says (its `/v1/models`), not only as this gateway saw it: a version
    unloaded or loaded on the engine by others (another gateway, the worker before a job says `succeeded`)
    shows so at once."""
    model = ft_model(gateway, org, adapters[2])
    version = adapter_version(adapters[2])

    def loaded() -> bool:
        with _http(gateway, org) as http:
            [place] = http.get(f"/v1/models/{model}").json()["tunegate"]["engines"]
        return bool(place["loaded"])

    with _http(gateway, org) as http:  # a request stores the version and loads it
        chat = {"model": model, "messages": MESSAGES, "max_tokens": 2}
        assert http.post("/v1/chat/completions", json=chat).status_code == 200
    assert loaded()
    with httpx.Client(base_url=engine.url, trust_env=False, timeout=60) as direct:
        assert direct.post("/v1/unload_lora_adapter", json={"lora_name": version}).status_code == 200
        assert version in resources_of(gateway).engines.pools[BASE].upstreams[0].loaded  # the gateway's view
        assert not loaded()
        body = {"lora_name": version, "lora_path": adapters[2]}
        assert direct.post("/v1/load_lora_adapter", json=body).status_code == 200
    assert loaded()

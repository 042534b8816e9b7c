"""Serving through the gateway: chat and completions proxied to a real engine, through the `openai` SDK.

One engine (the embedded CPU engine on the tiny model) and one gateway configured to use it; fine-tuned models
are registered by inserting `models` / checkpoint rows as the worker would, with random LoRA adapters.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import shutil
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.serving.versions import adapter_version
from tests.support.data import BASE, MESSAGES, TOOLS
from tests.support.engine import EngineServer, make_lora_adapter, register_model, resources_of
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Services, Tenant, free_port, start_gateway


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("serving-adapters")
    return [str(make_lora_adapter(tiny_model_dir, root / f"lora{i}", seed=200 + i)) for i in range(2)]


gw = gateway_fixture("serving")


@pytest.fixture
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("serve-" + secrets.token_hex(3))


def _new_version_of(adapter: str, root: Path) -> str:
    """A copy of `adapter` with the same weights but another version (its config differs by a space)."""
    out = root / "copy"
    shutil.copytree(adapter, out)
    config = out / "adapter_config.json"
    config.write_text(config.read_text() + " ")
    return str(out)


def _ft_id(org: Tenant) -> str:
    return f"ft:{BASE}:{org.org_id}::ftjob-{secrets.token_hex(6)}"


# --------------------------------------------------------------------------------------- base model
def test_chat_non_stream_rewrites_model_and_records_usage(org: Tenant, gw: GatewayServer) -> None:
    resp = org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=8, temperature=0)
    assert resp.model == BASE and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage is not None and 0 < resp.usage.completion_tokens <= 8
    records = [r for r in resources_of(gw).usage.records if r.organization_id == org.org_id]
    assert records and records[-1].completion_tokens == resp.usage.completion_tokens
    assert records[-1].api_key_id == org.key_id and records[-1].model == BASE
    buffer = resources_of(gw).usage
    text = httpx.get(f"{gw.url}/metrics").text
    counts = {
        line.split()[0]: float(line.split()[1])
        for line in text.splitlines()
        if line.startswith("tunegate_usage_rows_")
    }
    assert counts["tunegate_usage_rows_dropped_total"] == buffer.dropped == 0
    assert counts["tunegate_usage_rows_written_total"] + counts["tunegate_usage_rows_waiting"] >= 1


def test_chat_stream_reassembles_with_usage_chunk(org: Tenant) -> None:
    kwargs: dict[str, Any] = dict(model=BASE, messages=MESSAGES, max_tokens=10, temperature=0, seed=3)
    whole = org.client.chat.completions.create(**kwargs).choices[0].message.content
    chunks = list(
        org.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.model == BASE for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens > 0
    # Without include_usage the client gets no usage (the gateway still asks the engine, for metering).
    plain = list(org.client.chat.completions.create(**kwargs, stream=True))
    assert all(c.usage is None and c.choices for c in plain)
    assert "".join(c.choices[0].delta.content or "" for c in plain) == whole


def test_n_stop_and_logprobs(org: Tenant) -> None:
    kwargs: dict[str, Any] = dict(model=BASE, messages=MESSAGES, max_tokens=16, temperature=0, seed=5)
    many = org.client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in many.choices] == [0, 1, 2]
    free = many.choices[0].message.content or ""
    if len(free) >= 4:
        stop = free[2:4]
        cut = org.client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
        assert cut.finish_reason == "stop" and cut.message.content == free[: free.index(stop)]
    lp = org.client.chat.completions.create(**kwargs, logprobs=True, top_logprobs=2).choices[0].logprobs
    assert lp is not None and lp.content
    assert all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in lp.content)


def test_tool_call_round_trip(org: Tenant) -> None:
    resp = org.client.chat.completions.create(
        model=BASE, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=24, seed=1
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls" and resp.model == BASE
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1
    call = calls[0]
    assert call.type == "function" and call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    follow_up: Any = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    answer = org.client.chat.completions.create(model=BASE, messages=follow_up, tools=TOOLS, max_tokens=8)
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_completions_endpoint(org: Tenant) -> None:
    resp = org.client.completions.create(model=BASE, prompt="Hello there", max_tokens=6, temperature=0)
    assert resp.object == "text_completion" and resp.model == BASE
    assert resp.usage is not None and resp.usage.completion_tokens <= 6
    chunks = list(
        org.client.completions.create(
            model=BASE,
            prompt="Hello there",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.model == BASE for c in chunks)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == resp.choices[0].text
    assert chunks[-1].usage is not None


def test_unknown_model_and_engine_errors_keep_openai_shape(org: Tenant) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        org.client.chat.completions.create(model="no-such-model", messages=MESSAGES)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as bad:  # the engine's 400, passed on
        org.client.chat.completions.create(model=BASE, messages=MESSAGES, top_logprobs=2)
    assert bad.value.status_code == 400 and bad.value.body is not None
    with pytest.raises(openai.BadRequestError):  # an early stream error is a real HTTP error
        list(org.client.chat.completions.create(model=BASE, messages=MESSAGES, top_logprobs=2, stream=True))


# --------------------------------------------------------------------------------------- fine-tuned
def test_ft_model_and_checkpoint_served_with_lazy_load(
    org: Tenant,
    other_org_factory: Any,
    gw: GatewayServer,
    engine: EngineServer,
    database: str,
    adapters: list[str],
) -> None:
    a, b = _ft_id(org), _ft_id(org)
    ckpt = f"{b}:ckpt-step-2"
    register_model(database, org.org_id, a, adapters[0])
    register_model(database, org.org_id, b, adapters[1], checkpoint=ckpt)
    assert adapter_version(adapters[0]) not in engine.models()
    kwargs: dict[str, Any] = dict(messages=MESSAGES, max_tokens=12, temperature=0.9, seed=7)
    base = org.client.chat.completions.create(model=BASE, **kwargs).choices[0].message.content
    out_a = org.client.chat.completions.create(model=a, **kwargs)
    assert out_a.model == a and adapter_version(adapters[0]) in engine.models()  # engines know versions
    assert a not in engine.models()
    out_b = org.client.chat.completions.create(model=b, **kwargs)
    assert out_b.model == b
    assert len({base, out_a.choices[0].message.content, out_b.choices[0].message.content}) == 3
    chunks = list(org.client.chat.completions.create(model=a, stream=True, **kwargs))
    assert all(c.model == a for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        out_a.choices[0].message.content
    )
    from_ckpt = org.client.chat.completions.create(model=ckpt, **kwargs)
    assert from_ckpt.model == ckpt and adapter_version(adapters[1]) in engine.models()
    assert from_ckpt.choices[0].message.content == out_b.choices[0].message.content  # same adapter dir

    other: Tenant = other_org_factory()
    for model in (a, ckpt):
        with pytest.raises(openai.NotFoundError) as info:
            other.client.chat.completions.create(model=model, **kwargs)
        assert info.value.code == "model_not_found"


@pytest.fixture
def other_org_factory(gw_admin: Admin) -> Any:
    return lambda: gw_admin.tenant("other-" + secrets.token_hex(3))


def test_concurrent_first_requests_load_once(
    org: Tenant,
    gw: GatewayServer,
    engine: EngineServer,
    database: str,
    adapters: list[str],
    tmp_path: Path,
) -> None:
    model = _ft_id(org)
    fresh = _new_version_of(adapters[0], tmp_path)  # a version no engine holds yet
    register_model(database, org.org_id, model, fresh)
    engines = resources_of(gw).engines
    before = engines.load_count

    def ask(_: int) -> str:
        r = org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)
        return r.model

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(ask, range(6))) == [model] * 6
    assert engines.load_count - before == 1
    assert adapter_version(fresh) in engine.models()


def test_delete_model_stops_serving_and_unloads(
    org: Tenant, engine: EngineServer, database: str, adapters: list[str]
) -> None:
    model = _ft_id(org)
    register_model(database, org.org_id, model, adapters[1])
    assert org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3).model == model
    assert adapter_version(adapters[1]) in engine.models()
    assert org.client.models.delete(model).deleted is True
    assert adapter_version(adapters[1]) not in engine.models()
    with pytest.raises(openai.NotFoundError) as info:
        org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
    assert info.value.code == "model_not_found"


# --------------------------------------------------------------------------------------- engine down
def test_upstream_down_is_a_quick_503(
    services: Services, database: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = start_gateway(
        services, database, tiny_model_dir, tmp_path, upstreams=[f"http://127.0.0.1:{free_port()}"]
    )
    try:
        key = server.settings.admin_key
        assert key is not None
        tenant = Admin(server.url, key.get_secret_value()).tenant("down-" + secrets.token_hex(3))
        for stream in (False, True):
            t0 = time.monotonic()
            with pytest.raises(openai.InternalServerError) as info:
                resp = tenant.client.chat.completions.create(model=BASE, messages=MESSAGES, stream=stream)
                list(resp) if stream else None  # noqa: B018 - consume a stream
            assert info.value.status_code == 503
            assert isinstance(info.value.body, dict) and info.value.body.get("code") == "service_unavailable"
            assert time.monotonic() - t0 < 5
    finally:
        server.stop()


def test_adapter_lost_by_the_engine_is_reloaded(
    org: Tenant, gw: GatewayServer, engine: EngineServer, database: str, adapters: list[str]
) -> None:
    model = _ft_id(org)
    register_model(database, org.org_id, model, adapters[0])
    assert org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3).model == model
    with httpx.Client(trust_env=False) as http:  # behind the gateway's back, as an engine restart would
        unload = {"lora_name": adapter_version(adapters[0])}
        assert http.post(f"{engine.url}/v1/unload_lora_adapter", json=unload).status_code == 200
    before = resources_of(gw).engines.load_count
    assert org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3).model == model
    assert resources_of(gw).engines.load_count == before + 1
    assert adapter_version(adapters[0]) in engine.models()


def test_worker_hook_loads_and_unloads_everywhere(
    org: Tenant, gw: GatewayServer, engine: EngineServer, adapters: list[str]
) -> None:
    from gateway.serving.engines import AdapterLoader

    model = _ft_id(org)
    version = adapter_version(adapters[1])

    async def hook() -> None:
        async with AdapterLoader(gw.settings) as loader:
            assert await loader.load_everywhere(model, BASE, adapters[1]) == {engine.url: None}
            assert version in engine.models()  # loaded as its version, computed from its files
            again = await loader.load_everywhere(model, BASE, adapters[1])  # "already loaded"
            assert again == {engine.url: None}
            assert await loader.unload_everywhere(version, BASE) == {engine.url: None}

    asyncio.run(hook())
    assert version not in engine.models()


def test_client_leaving_stops_the_engine(org: Tenant, gw: GatewayServer, engine: EngineServer) -> None:
    """A client that goes away before its answer is complete, streamed or not, stops the engine's work:
    far fewer tokens are generated than the request asked for (it ignores end-of-sequence)."""
    asked = 1900
    body = {"model": BASE, "messages": MESSAGES, "max_tokens": asked, "ignore_eos": True}
    headers = {"authorization": f"Bearer {org.key}"}

    def stats() -> dict[str, Any]:
        out: dict[str, Any] = httpx.get(engine.url + "/v1/engine/stats", timeout=10).json()
        return out

    def generated_until_idle(before: int) -> int:
        deadline = time.monotonic() + 30
        while (now := stats())["running"] + now["waiting"]:
            assert time.monotonic() < deadline, now
            time.sleep(0.05)
        return int(now["models"][BASE]["tokens_generated"]) - before

    with httpx.Client(base_url=gw.url, headers=headers, timeout=30) as http:
        before = stats()["models"][BASE]["tokens_generated"]
        with http.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as resp:
            assert resp.status_code == 200
            lines = resp.iter_lines()
            for _ in range(6):
                next(lines)
            assert stats()["running"] == 1
        assert generated_until_idle(before) < asked / 2
        before = stats()["models"][BASE]["tokens_generated"]
        with pytest.raises(httpx.ReadTimeout):  # the client gives up on a long non-streamed answer
            http.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(30, read=0.3))
        assert generated_until_idle(before) < asked / 2


def test_bad_body_is_a_400(org: Tenant, gw: GatewayServer) -> None:
    with httpx.Client(
        base_url=gw.url, headers={"Authorization": f"Bearer {org.key}"}, trust_env=False
    ) as http:
        for content in (b"{not json", b"[1, 2]", b'{"messages": []}'):
            resp = http.post("/v1/chat/completions", content=content)
            assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
        assert (
            http.post("/v1/chat/completions", content=b"{}", headers={"Authorization": "x"}).status_code
            == 401
        )


def test_engine_choice_spreads_load_and_keeps_adapters_where_loaded() -> None:
    from gateway.serving.upstreams import UpstreamPool

    pool = UpstreamPool(BASE, ["http://a", "http://b", "http://c"])
    firsts = {pool.candidates(None)[0].url for _ in range(3)}
    assert firsts == {"http://a", "http://b", "http://c"}  # round robin when idle
    a, b, c = pool.upstreams
    a.in_flight, b.in_flight, c.in_flight = 3, 1, 2
    assert [u.url for u in pool.candidates(None)] == ["http://b", "http://c", "http://a"]  # least in flight
    a.loaded.add("ft:x")
    assert pool.candidates("ft:x")[0] is a  # affinity beats load
    b.mark_down()
    assert pool.candidates(None)[-1] is b  # an unreachable engine is tried last

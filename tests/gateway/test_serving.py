"""Serving through the gateway: chat and completions proxied to a real engine, through the `openai` SDK.

One engine (the embedded CPU engine on the tiny model) and one gateway configured to use it; fine-tuned models
are registered by inserting `models` / checkpoint rows as the worker would, with random LoRA adapters.
"""

from __future__ import annotations

import asyncio
import json
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
import openai
import pytest
import uvicorn

from gateway.serving.upstreams import ServingState
from tests.support.stack import Admin, GatewayServer, Services, Tenant, free_port, make_settings

BASE = "tiny-chat"
MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]


def _make_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int = 8) -> str:
    """A LoRA adapter on `base_dir` with random B matrices, so it changes the model's outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(str(out_dir))
    return str(out_dir)


@dataclass
class Engine:
    url: str
    server: uvicorn.Server
    thread: threading.Thread

    def models(self) -> set[str]:
        with httpx.Client(trust_env=False) as http:
            return {m["id"] for m in http.get(f"{self.url}/v1/models").json()["data"]}


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[Engine]:
    from inference.server import create_app

    port = free_port()
    app = create_app({BASE: str(tiny_model_dir)}, device="cpu", max_loras=4)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "engine did not start"
        time.sleep(0.05)
    yield Engine(f"http://127.0.0.1:{port}", server, thread)
    server.should_exit = True
    thread.join(timeout=30)


@pytest.fixture(scope="module")
def adapters(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    root = tmp_path_factory.mktemp("serving-adapters")
    return [_make_adapter(tiny_model_dir, root / f"lora{i}", seed=200 + i) for i in range(2)]


def _gateway(
    services: Services, database: str, tiny_model_dir: Path, tmp: Path, upstreams: list[str]
) -> GatewayServer:
    settings = make_settings(
        data_dir=tmp, database_url=database, redis_url=services.redis_url, tiny_model=tiny_model_dir
    )
    settings.base_models[BASE].upstreams = upstreams
    return GatewayServer(settings).start()


@pytest.fixture(scope="module")
def gw(
    services: Services,
    database: str,
    tiny_model_dir: Path,
    engine: Engine,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[GatewayServer]:
    server = _gateway(services, database, tiny_model_dir, tmp_path_factory.mktemp("gw"), [engine.url])
    yield server
    server.stop()


def _state(server: GatewayServer) -> ServingState:
    app: Any = server.server.config.app
    state = app.state.resources.serving
    assert isinstance(state, ServingState)
    return state


@pytest.fixture(scope="module")
def gw_admin(gw: GatewayServer) -> Admin:
    key = gw.settings.admin_key
    assert key is not None
    return Admin(gw.url, key.get_secret_value())


@pytest.fixture
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("serve-" + secrets.token_hex(3))


def _register(
    database: str, org_id: str, model_id: str, adapter: str, *, checkpoint: str | None = None
) -> None:
    """What the worker does when a job succeeds: a `models` row (and a checkpoint row with its job)."""

    async def run() -> None:
        conn = await asyncpg.connect(database)
        try:
            job_id = model_id.rsplit(":", 1)[-1]
            await conn.execute(
                "INSERT INTO fine_tuning_jobs (id, organization_id, model, training_file, status, method,"
                " hyperparameters, seed) VALUES ($1, $2, $3, 'file-x', 'succeeded', '{}'::jsonb,"
                " '{}'::jsonb, 1) ON CONFLICT (id) DO NOTHING",
                job_id,
                org_id,
                BASE,
            )
            await conn.execute(
                "INSERT INTO models (id, organization_id, base_model, job_id, adapter_path)"
                " VALUES ($1, $2, $3, $4, $5)",
                model_id,
                org_id,
                BASE,
                job_id,
                adapter,
            )
            if checkpoint is not None:
                await conn.execute(
                    "INSERT INTO fine_tuning_job_checkpoints (id, job_id, organization_id, step_number,"
                    " fine_tuned_model_checkpoint, path) VALUES ($1, $2, $3, 2, $4, $5)",
                    "ftckpt-" + secrets.token_hex(6),
                    job_id,
                    org_id,
                    checkpoint,
                    adapter,
                )
        finally:
            await conn.close()

    asyncio.run(run())


def _ft_id(org: Tenant) -> str:
    return f"ft:{BASE}:{org.org_id}::ftjob-{secrets.token_hex(6)}"


# --------------------------------------------------------------------------------------- base model
def test_chat_non_stream_rewrites_model_and_records_usage(org: Tenant, gw: GatewayServer) -> None:
    resp = org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=8, temperature=0)
    assert resp.model == BASE and resp.object == "chat.completion"
    assert resp.choices[0].message.role == "assistant"
    assert resp.usage is not None and 0 < resp.usage.completion_tokens <= 8
    records = [r for r in _state(gw).usage.records if r.organization_id == org.org_id]
    assert records and records[-1].completion_tokens == resp.usage.completion_tokens
    assert records[-1].api_key_id == org.key_id and records[-1].model == BASE


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
    org: Tenant, other_org_factory: Any, gw: GatewayServer, engine: Engine, database: str, adapters: list[str]
) -> None:
    a, b = _ft_id(org), _ft_id(org)
    ckpt = f"{b}:ckpt-step-2"
    _register(database, org.org_id, a, adapters[0])
    _register(database, org.org_id, b, adapters[1], checkpoint=ckpt)
    assert a not in engine.models()
    kwargs: dict[str, Any] = dict(messages=MESSAGES, max_tokens=12, temperature=0.9, seed=7)
    base = org.client.chat.completions.create(model=BASE, **kwargs).choices[0].message.content
    out_a = org.client.chat.completions.create(model=a, **kwargs)
    assert out_a.model == a and a in engine.models()
    out_b = org.client.chat.completions.create(model=b, **kwargs)
    assert out_b.model == b
    assert len({base, out_a.choices[0].message.content, out_b.choices[0].message.content}) == 3
    chunks = list(org.client.chat.completions.create(model=a, stream=True, **kwargs))
    assert all(c.model == a for c in chunks)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
        out_a.choices[0].message.content
    )
    from_ckpt = org.client.chat.completions.create(model=ckpt, **kwargs)
    assert from_ckpt.model == ckpt and ckpt in engine.models()
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
    org: Tenant, gw: GatewayServer, engine: Engine, database: str, adapters: list[str]
) -> None:
    model = _ft_id(org)
    _register(database, org.org_id, model, adapters[0])
    state = _state(gw)
    before = state.load_count

    def ask(_: int) -> str:
        r = org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=4, temperature=0)
        return r.model

    with ThreadPoolExecutor(6) as pool:
        assert list(pool.map(ask, range(6))) == [model] * 6
    assert state.load_count - before == 1
    assert model in engine.models()


def test_delete_model_stops_serving_and_unloads(
    org: Tenant, engine: Engine, database: str, adapters: list[str]
) -> None:
    model = _ft_id(org)
    _register(database, org.org_id, model, adapters[1])
    assert org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3).model == model
    assert model in engine.models()
    assert org.client.models.delete(model).deleted is True
    assert model not in engine.models()
    with pytest.raises(openai.NotFoundError) as info:
        org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3)
    assert info.value.code == "model_not_found"


# --------------------------------------------------------------------------------------- engine down
def test_upstream_down_is_a_quick_503(
    services: Services, database: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    server = _gateway(services, database, tiny_model_dir, tmp_path, [f"http://127.0.0.1:{free_port()}"])
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
    org: Tenant, gw: GatewayServer, engine: Engine, database: str, adapters: list[str]
) -> None:
    model = _ft_id(org)
    _register(database, org.org_id, model, adapters[0])
    assert org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3).model == model
    with httpx.Client(trust_env=False) as http:  # behind the gateway's back, as an engine restart would
        assert http.post(f"{engine.url}/v1/unload_lora_adapter", json={"lora_name": model}).status_code == 200
    before = _state(gw).load_count
    assert org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=3).model == model
    assert _state(gw).load_count == before + 1 and model in engine.models()


def test_worker_hook_loads_and_unloads_everywhere(
    org: Tenant, gw: GatewayServer, engine: Engine, adapters: list[str]
) -> None:
    from gateway.serving.service import load_adapter_everywhere, unload_adapter_everywhere

    model = _ft_id(org)
    loaded = asyncio.run(load_adapter_everywhere(gw.settings, model, BASE, adapters[1]))
    assert loaded == {engine.url: None} and model in engine.models()
    again = asyncio.run(load_adapter_everywhere(gw.settings, model, BASE, adapters[1]))  # "already loaded"
    assert again == {engine.url: None}
    assert asyncio.run(unload_adapter_everywhere(gw.settings, model, BASE)) == {engine.url: None}
    assert model not in engine.models()


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

"""vLLM behind a gateway with more adapters than it keeps: used in turn, unloaded, and metered by vLLM's own
`usage`.

The session's vLLM (`vllm_server`) batches 2 adapters and caches 2 in host memory (`VLLM_MAX_LORAS`). An
adapter loaded at run time keeps its name registered with its path; when the cache evicts its weights, vLLM
reads them again from that path at the next request for it. So the gateway loads each adapter once, and a
model in use never answers 404 however many others are used between its requests.

Skipped where vLLM is not installed or cannot run.
"""

from __future__ import annotations

import asyncio
import secrets
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest

from gateway.serving.versions import adapter_version
from tests.support.data import BASE, MESSAGES
from tests.support.engine import ft_model, resources_of
from tests.support.stack import GatewayServer, Tenant, admin_of
from tests.support.vllm import VLLM_MAX_LORAS, vllm_gateway_fixture
from tunegate.vllm_process import VllmEngineProcess

pytestmark = pytest.mark.timeout(900)  # vLLM's start, when this module is the first to use it


gateway = vllm_gateway_fixture("vllm-adapters", usage_flush_interval_s=0.3)
"""A gateway on the session's vLLM, sized as it is, writing usage rows every 0.3 s."""


@pytest.fixture
def org(gateway: GatewayServer) -> Tenant:
    return admin_of(gateway).tenant("vllm-ad-" + secrets.token_hex(3))


def _served(vllm_server: VllmEngineProcess) -> set[str]:
    """What vLLM lists in `/v1/models`: its base model and the adapters registered with it."""
    return {m["id"] for m in httpx.get(f"{vllm_server.url}/v1/models").json()["data"]}


def _answer(org: Tenant, model: str) -> str | None:
    out = org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert out.model == model
    return out.choices[0].message.content


def test_more_adapters_than_vllm_keeps_are_used_in_turn_and_never_404(
    gateway: GatewayServer, org: Tenant, adapter_dirs: list[Path], vllm_server: VllmEngineProcess
) -> None:
    """Four adapters, twice what vLLM batches and caches, asked for round robin, one at a time and then
    eight at once: each gives its own greedy answer every time (its weights read again after each eviction)
    and the gateway loaded each once (no 404 sent it to load one again)."""
    models = [ft_model(gateway, org, path) for path in adapter_dirs]
    assert len(models) == 2 * VLLM_MAX_LORAS
    engines = resources_of(gateway).engines
    loads = engines.load_count
    first = [_answer(org, model) for model in models]
    assert len(set(first)) == len(models)  # four adapters, four answers
    for _ in range(2):
        assert [_answer(org, model) for model in models] == first
    with ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda i: _answer(org, models[i % 4]), range(16)))
    assert together == first * 4
    assert engines.load_count == loads + len(models)
    assert {adapter_version(path) for path in adapter_dirs} <= _served(vllm_server)  # served as versions


def test_deleted_model_is_unloaded_and_its_folder_serves_again(
    gateway: GatewayServer, org: Tenant, adapter_dirs: list[Path], vllm_server: VllmEngineProcess
) -> None:
    """Deleting a model unloads it from vLLM (gone from its `/v1/models`) and the gateway answers 404 for
    it; the same folder registered as another model is loaded again and gives the same answers."""
    model = ft_model(gateway, org, adapter_dirs[1])
    version = adapter_version(adapter_dirs[1])  # what vLLM is given as the adapter's name
    before = _answer(org, model)
    assert version in _served(vllm_server)
    assert org.client.models.delete(model).deleted is True
    assert version not in _served(vllm_server)
    with pytest.raises(openai.NotFoundError) as info:
        _answer(org, model)
    assert info.value.code == "model_not_found"
    body = {"model": version, "messages": MESSAGES, "max_tokens": 2}
    direct = httpx.post(f"{vllm_server.url}/v1/chat/completions", json=body)
    assert direct.status_code == 404

    again = ft_model(gateway, org, adapter_dirs[1])
    assert _answer(org, again) == before


def _usage_rows(database: str, org_id: str, count: int) -> list[asyncpg.Record]:
    """The organisation's usage rows, once `count` of them are written (the gateway writes in batches)."""

    async def fetch() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(database)
        try:
            return await conn.fetch(
                "SELECT model, prompt_tokens, completion_tokens FROM completion_usage"
                " WHERE organization_id = $1 ORDER BY id",
                org_id,
            )
        finally:
            await conn.close()

    deadline = time.monotonic() + 30
    while len(rows := asyncio.run(fetch())) < count and time.monotonic() < deadline:
        time.sleep(0.2)
    return rows


def test_usage_is_metered_from_vllms_own_usage(
    gateway: GatewayServer, org: Tenant, adapter_dirs: list[Path]
) -> None:
    """Each request is one usage row of the tokens vLLM counted, streamed or not: the gateway asks vLLM for
    the usage chunk of every stream (`stream_options.include_usage`), and passes it on only to a client
    that asked for it. (Without it the gateway would bill an estimate: 12 prompt tokens for this chat, not
    vLLM's 35.)"""
    model = ft_model(gateway, org, adapter_dirs[3])
    kwargs: dict[str, Any] = dict(
        messages=MESSAGES, max_tokens=8, temperature=0, extra_body={"ignore_eos": True}
    )
    whole = org.client.chat.completions.create(model=model, **kwargs)
    assert whole.usage is not None and whole.usage.completion_tokens == 8
    prompt_tokens = whole.usage.prompt_tokens

    quiet = list(org.client.chat.completions.create(model=model, stream=True, **kwargs))
    assert all(c.usage is None and c.choices for c in quiet)
    told = list(
        org.client.chat.completions.create(
            model=BASE, stream=True, stream_options={"include_usage": True}, **kwargs
        )
    )
    assert told[-1].choices == [] and told[-1].usage is not None
    assert (told[-1].usage.prompt_tokens, told[-1].usage.completion_tokens) == (prompt_tokens, 8)
    legacy = list(
        org.client.completions.create(
            model=model, prompt="Hello there", max_tokens=5, stream=True, extra_body={"ignore_eos": True}
        )
    )
    assert all(c.usage is None for c in legacy)
    hello_tokens = org.client.completions.create(model=BASE, prompt="Hello there", max_tokens=1).usage
    assert hello_tokens is not None

    assert gateway.settings.database_url is not None
    rows = _usage_rows(gateway.settings.database_url, org.org_id, 5)
    assert [(r["model"], r["prompt_tokens"], r["completion_tokens"]) for r in rows] == [
        (model, prompt_tokens, 8),
        (model, prompt_tokens, 8),
        (BASE, prompt_tokens, 8),
        (model, hello_tokens.prompt_tokens, 5),
        (BASE, hello_tokens.prompt_tokens, 1),
    ]

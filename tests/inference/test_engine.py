"""The engine's own behaviour: mixed-adapter batching, LRU eviction, freeing adapters, disconnects, errors."""

from __future__ import annotations

import asyncio
import gc
import time
import weakref
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from inference.engine import GenerationRequest, ModelEngine
from inference.options import EngineOptions
from inference.sampling import SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], [20, 21, 22], [30, 31, 32, 33, 34, 35, 36], [40, 41]]


@pytest.fixture
async def engine(tiny_model_dir: Path) -> AsyncIterator[ModelEngine]:
    eng = ModelEngine(
        "tiny-chat", str(tiny_model_dir), EngineOptions(max_loras=2, device="cpu", batch_window_s=0.01)
    )
    eng.start()
    yield eng
    await eng.stop()


async def _collect(req: GenerationRequest) -> list[list[int]]:
    tokens: list[list[int]] = [[] for _ in range(req.n)]
    async for event in req.events():
        tokens[event.index].extend(event.token_ids)
    return tokens


def _request(engine: ModelEngine, prompt: list[int], adapter: str | None, **params: Any) -> GenerationRequest:
    n = params.pop("n", 1)
    sampling = SamplingParams(max_tokens=params.pop("max_tokens", 12), **params)
    req = GenerationRequest(prompt_ids=list(prompt), params=sampling, n=n)
    req.adapter = engine.resolve(adapter) if adapter else None
    return req


async def _run_alone(engine: ModelEngine, prompt: list[int], adapter: str | None, **params: Any) -> list[int]:
    return (await _collect(engine.submit(_request(engine, prompt, adapter, **params))))[0]


async def test_mixed_adapter_batch_matches_single_runs(engine: ModelEngine, adapter_dirs: list[Path]) -> None:
    await asyncio.to_thread(engine.load_adapter, "a", str(adapter_dirs[0]))
    await asyncio.to_thread(engine.load_adapter, "b", str(adapter_dirs[1]))
    plan = [(PROMPTS[0], None), (PROMPTS[1], "a"), (PROMPTS[2], "b"), (PROMPTS[3], "a")]
    alone = [await _run_alone(engine, p, a, temperature=0.0) for p, a in plan]
    batches_before = engine.runner.batches_run

    reqs = [engine.submit(_request(engine, p, a, temperature=0.0)) for p, a in plan]
    together = [(await _collect(r))[0] for r in reqs]

    assert engine.runner.batches_run == batches_before + 1, "the four requests should share one batch"
    assert engine.runner.largest_batch >= 4
    assert together == alone
    # the adapters really change the output of the same prompt
    same_prompt = [await _run_alone(engine, PROMPTS[0], a, temperature=0.0) for a in (None, "a", "b")]
    assert len({tuple(t) for t in same_prompt}) == 3


async def test_seeded_sampling_is_per_row(engine: ModelEngine) -> None:
    alone = await _run_alone(engine, PROMPTS[0], None, temperature=1.0, seed=42)
    other = engine.submit(_request(engine, PROMPTS[1], None, temperature=0.7, top_p=0.9, seed=1))
    mine = engine.submit(_request(engine, PROMPTS[0], None, temperature=1.0, seed=42))
    await _collect(other)
    assert (await _collect(mine))[0] == alone
    different = await _run_alone(engine, PROMPTS[0], None, temperature=1.0, seed=43)
    assert different != alone


async def test_stop_token_ids_end_a_choice_and_stay_in_its_tokens(engine: ModelEngine) -> None:
    """The first sampled token that is a stop token ends the choice, kept as its last token (as vLLM does),
    even where end-of-sequence tokens do not end it."""
    greedy = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 12}
    free = await _run_alone(engine, PROMPTS[2], None, **greedy)
    stop = free[3]
    stopped = await _run_alone(engine, PROMPTS[2], None, stop_token_ids=[stop], **greedy)
    assert stopped == free[: free.index(stop) + 1]


async def test_lru_eviction_and_transparent_reload(engine: ModelEngine, adapter_dirs: list[Path]) -> None:
    for i, name in enumerate(["x", "y"]):
        await asyncio.to_thread(engine.load_adapter, name, str(adapter_dirs[i]))
    before = await _run_alone(engine, PROMPTS[0], "x", temperature=0.0)
    await _run_alone(engine, PROMPTS[0], "y", temperature=0.0)  # x is now the least recently used
    await asyncio.to_thread(engine.load_adapter, "z", str(adapter_dirs[2]))

    assert [a.name for a in engine.registry.resident()] == ["y", "z"]
    assert set(engine.registry.known) == {"x", "y", "z"}
    assert len(engine.host.keys) == 2

    after = await _run_alone(engine, PROMPTS[0], "x", temperature=0.0)  # reloads x, evicts y
    assert after == before
    assert [a.name for a in engine.registry.resident()] == ["z", "x"]
    assert not engine.registry.known["y"].resident


async def test_unload_frees_adapter_weights(engine: ModelEngine, adapter_dirs: list[Path]) -> None:
    base_count = engine.host.parameter_count()
    assert base_count == engine.base_parameter_count
    adapter = await asyncio.to_thread(engine.load_adapter, "freed", str(adapter_dirs[3]))
    assert engine.host.parameter_count() > base_count
    lora_weight = next(
        p
        for n, p in engine.host.base.named_parameters()
        if "lora_B" in n and n.endswith(f".{adapter.key}.weight")
    )
    ref = weakref.ref(lora_weight)
    del lora_weight
    await asyncio.to_thread(engine.unload_adapter, "freed")
    gc.collect()
    assert ref() is None
    assert engine.host.parameter_count() == base_count
    assert engine.registry.get("freed") is None


async def test_unload_while_running_waits_for_the_batch(
    engine: ModelEngine, adapter_dirs: list[Path]
) -> None:
    await asyncio.to_thread(engine.load_adapter, "busy", str(adapter_dirs[0]))
    # all of its tokens (no end of turn), so the batch outlasts the unload on any machine
    params = {"temperature": 0.0, "max_tokens": 1000, "ignore_eos": True}
    req = engine.submit(_request(engine, PROMPTS[0], "busy", **params))
    events = req.events()
    await anext(events)  # the batch is running and has the adapter pinned
    key = engine.registry.known["busy"].key
    await asyncio.to_thread(engine.unload_adapter, "busy")
    assert key in engine.host.keys, "a pinned adapter is deleted only when its batch ends"
    async for _ in events:
        pass
    for _ in range(50):
        if key not in engine.host.keys:
            break
        await asyncio.sleep(0.02)
    assert key not in engine.host.keys


async def test_client_disconnect_stops_generation(
    server_factory: Callable[..., Any],
) -> None:
    server = server_factory(max_loras=2)
    body = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "max_tokens": 1900,
        "stream": True,
        "temperature": 1.0,
    }
    async with httpx.AsyncClient(base_url=server.url, timeout=30) as client:
        async with client.stream("POST", "/v1/chat/completions", json=body) as resp:
            assert resp.status_code == 200
            lines = resp.aiter_lines()
            for _ in range(6):
                await anext(lines)
            stats = (await client.get("/v1/engine/stats")).json()
            assert stats["running"] == 1
        # the client closed the stream after a few tokens
        deadline = time.monotonic() + 10
        while True:
            stats = (await client.get("/v1/engine/stats")).json()
            if stats["running"] == 0 and stats["waiting"] == 0:
                break
            assert time.monotonic() < deadline, stats
            await asyncio.sleep(0.05)
    assert server.engine.runner.batches_run == 1


def test_error_envelopes(engine_server: Any) -> None:
    with httpx.Client(base_url=engine_server.url, timeout=30) as http:
        bad = http.post(
            "/v1/chat/completions",
            json={"model": "tiny-chat", "messages": [{"role": "user", "content": "x"}], "temperature": 5},
        )
        assert bad.status_code == 400
        assert bad.json()["error"]["param"] == "temperature"
        missing = http.post("/v1/chat/completions", json={"model": "tiny-chat"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "messages"
        unknown = http.post("/v1/completions", json={"model": "nope", "prompt": "x", "max_tokens": 2})
        assert unknown.status_code == 404
        assert unknown.json()["error"]["code"] == "model_not_found"
        assert unknown.json()["error"]["param"] == "model"


def test_json_mode_output_starts_an_object(engine_server: Any) -> None:
    with httpx.Client(base_url=engine_server.url, timeout=30) as http:
        resp = http.post(
            "/v1/chat/completions",
            json={
                "model": "tiny-chat",
                "messages": [{"role": "user", "content": "json please"}],
                "response_format": {"type": "json_object"},
                "max_tokens": 8,
                "seed": 0,
            },
        )
    assert resp.status_code == 200
    assert resp.json()["choices"][0]["message"]["content"].startswith("{")


def test_prompts_over_the_context_are_refused_by_length(engine_server: Any) -> None:
    """Refused with the field named, whether the text is far over (by its length alone, never tokenized)
    or just over (by its tokens, counted on a thread); a long prompt that fits is served."""
    models = httpx.get(f"{engine_server.url}/v1/models", timeout=30).json()["data"]
    context = next(m for m in models if m["id"] == "tiny-chat")["max_model_len"]
    with httpx.Client(base_url=engine_server.url, timeout=60) as http:
        for text in ("lorem ipsum " * 200_000, "7 " * (context + 10)):
            chat = http.post(
                "/v1/chat/completions",
                json={"model": "tiny-chat", "messages": [{"role": "user", "content": text}], "max_tokens": 2},
            )
            assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages", chat.text
            assert chat.json()["error"]["code"] == "context_length_exceeded"
            legacy = http.post(
                "/v1/completions", json={"model": "tiny-chat", "prompt": text, "max_tokens": 2}
            )
            assert legacy.status_code == 400 and legacy.json()["error"]["param"] == "prompt"
            assert legacy.json()["error"]["code"] == "context_length_exceeded", legacy.text
        ids = http.post("/v1/completions", json={"model": "tiny-chat", "prompt": [5] * (context + 1)})
        assert ids.status_code == 400 and ids.json()["error"]["code"] == "context_length_exceeded"
        fits = http.post(
            "/v1/completions", json={"model": "tiny-chat", "prompt": " summarize" * 900, "max_tokens": 2}
        )
        assert fits.status_code == 200, fits.text


def test_tool_calls_are_split_in_one_pass() -> None:
    """The same blocks and outside text as the lazy regex it replaces, on texts that would take that regex
    the square of their length (a megabyte of openings is minutes for it)."""
    import random
    import re

    from inference.chat import split_tool_calls

    lazy = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)
    atoms = ["<tool_call>", "</tool_call>", " ", "\n", "x", '{"name": "f"}']
    rng = random.Random(0)
    for _ in range(3000):
        text = "".join(rng.choice(atoms) for _ in range(rng.randint(0, 10)))
        assert split_tool_calls(text) == ([m.group(1) for m in lazy.finditer(text)], lazy.sub("", text))
    bodies, outside = split_tool_calls("<tool_call>" * 100_000)
    assert len(bodies) == 1 and outside == ""

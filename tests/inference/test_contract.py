"""The engine HTTP contract, driven through the official ``openai`` SDK and httpx.

Runs against both engines serving the tiny model, each on a free port: the embedded engine, and vLLM where
it is installed (``scripts/install-vllm``; skipped otherwise). Or against any engine given by
``TUNEGATE_ENGINE_URL`` (with ``TUNEGATE_ENGINE_MODEL``, ``TUNEGATE_ENGINE_ADAPTER_PATH`` and
``TUNEGATE_ENGINE_KIND``, ``vllm`` unless ``embedded``), e.g. vLLM on a GPU box.

vLLM is the reference. Where the two differ, the difference is a table below with its reason, and the test
holds each engine to what it does.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.data import MESSAGES, TOOLS

TOOL_CALL_ID_PREFIX = {"embedded": "call_", "vllm": "chatcmpl-tool-"}
"""How tool call ids start: OpenAI's and the embedded engine's with ``call_``, vLLM's (0.32) with
``chatcmpl-tool-`` and 16 hex digits (``make_tool_call_id``). Clients echo ids back; none reads them."""


@dataclass
class Target:
    url: str
    model: str
    adapter_path: str
    client: openai.OpenAI
    http: httpx.Client
    engine: str
    """``embedded`` or ``vllm``: whose side of a documented difference applies."""

    def load(self, name: str, path: str | None = None, **extra: Any) -> httpx.Response:
        body = {"lora_name": name, "lora_path": path or self.adapter_path, **extra}
        return self.http.post("/v1/load_lora_adapter", json=body)

    def unload(self, name: str) -> httpx.Response:
        return self.http.post("/v1/unload_lora_adapter", json={"lora_name": name})


ENGINES = (
    ["external"]
    if os.environ.get("TUNEGATE_ENGINE_URL")
    # vLLM's start (three processes import torch and vLLM) is part of its first test's time.
    else ["embedded", pytest.param("vllm", marks=pytest.mark.timeout(900))]
)


@pytest.fixture(scope="module", params=ENGINES)
def target(request: pytest.FixtureRequest) -> Iterator[Target]:
    if request.param == "external":
        url = os.environ["TUNEGATE_ENGINE_URL"]
        model = os.environ["TUNEGATE_ENGINE_MODEL"]
        adapter_path = os.environ["TUNEGATE_ENGINE_ADAPTER_PATH"]
        engine = os.environ.get("TUNEGATE_ENGINE_KIND", "vllm")
    else:
        server = request.getfixturevalue("engine_server" if request.param == "embedded" else "vllm_server")
        adapters: list[Path] = request.getfixturevalue("adapter_dirs")
        url, model, adapter_path, engine = server.url, "tiny-chat", str(adapters[0]), request.param
    url = url.rstrip("/")
    client = openai.OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
    with httpx.Client(base_url=url, timeout=120) as http:
        yield Target(url, model, adapter_path, client, http, engine)


def _name() -> str:
    return f"contract-{uuid.uuid4().hex[:8]}"


def test_health_and_models(target: Target) -> None:
    assert target.http.get("/health").status_code == 200
    models = target.client.models.list().data
    assert target.model in [m.id for m in models]


def test_chat_non_stream_shape(target: Target) -> None:
    resp = target.client.chat.completions.create(
        model=target.model, messages=MESSAGES, max_tokens=8, temperature=0, seed=7
    )
    assert resp.object == "chat.completion"
    assert resp.id and resp.created > 0 and resp.model == target.model
    (choice,) = resp.choices
    assert choice.index == 0 and choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.prompt_tokens > 0
    assert 1 <= resp.usage.completion_tokens <= 8
    assert resp.usage.total_tokens == resp.usage.prompt_tokens + resp.usage.completion_tokens


def test_stream_reassembles_to_non_stream(target: Target) -> None:
    kwargs: dict[str, Any] = dict(model=target.model, messages=MESSAGES, max_tokens=12, temperature=0, seed=3)
    whole = target.client.chat.completions.create(**kwargs)
    chunks = list(
        target.client.chat.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    content_chunks = [c for c in chunks if c.choices]
    first = content_chunks[0].choices[0].delta
    assert first.role == "assistant" and first.content == ""
    last = content_chunks[-1].choices[0]
    assert last.finish_reason == whole.choices[0].finish_reason
    assert all(c.usage is None for c in content_chunks)
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens  # type: ignore[union-attr]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == whole.choices[0].message.content


def test_raw_sse_has_no_event_lines(target: Target) -> None:
    body = {"model": target.model, "messages": MESSAGES, "max_tokens": 4, "stream": True}
    with target.http.stream("POST", "/v1/chat/completions", json=body) as resp:
        assert resp.status_code == 200
        lines = [line for line in resp.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines)
    assert lines[-1] == "data: [DONE]"


def test_n_choices_and_seed(target: Target) -> None:
    kwargs: dict[str, Any] = dict(
        model=target.model, messages=MESSAGES, max_tokens=10, temperature=1.0, seed=11
    )
    a = target.client.chat.completions.create(**kwargs, n=3)
    b = target.client.chat.completions.create(**kwargs, n=3)
    assert [c.index for c in a.choices] == [0, 1, 2]
    assert [c.message.content for c in a.choices] == [c.message.content for c in b.choices]


def test_stop_string_is_trimmed(target: Target) -> None:
    kwargs: dict[str, Any] = dict(model=target.model, messages=MESSAGES, max_tokens=24, temperature=0, seed=5)
    free = target.client.chat.completions.create(**kwargs).choices[0].message.content or ""
    if len(free) < 4:
        pytest.skip("the model's greedy output is too short to cut")
    stop = free[2:4]
    cut = target.client.chat.completions.create(**kwargs, stop=[stop]).choices[0]
    assert cut.finish_reason == "stop"
    assert cut.message.content == free[: free.index(stop)]


def test_logprobs_shape(target: Target) -> None:
    resp = target.client.chat.completions.create(
        model=target.model, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    choice = resp.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content
    assert len(choice.logprobs.content) == resp.usage.completion_tokens  # type: ignore[union-attr]
    for item in choice.logprobs.content:
        assert item.logprob <= 0.0 and isinstance(item.token, str)
        assert len(item.top_logprobs) == 3
        # greedy: the chosen token is the most likely one
        assert item.logprob == pytest.approx(item.top_logprobs[0].logprob, abs=1e-4)


def test_tool_call_round_trip(target: Target) -> None:
    resp = target.client.chat.completions.create(
        model=target.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=24, seed=1
    )
    choice = resp.choices[0]
    assert choice.finish_reason == "tool_calls"
    calls = choice.message.tool_calls
    assert calls and len(calls) == 1
    call = calls[0]
    assert call.id.startswith(TOOL_CALL_ID_PREFIX[target.engine]) and call.type == "function"
    assert call.function.name == "get_weather"
    assert isinstance(json.loads(call.function.arguments), dict)
    follow_up = [
        *MESSAGES,
        {"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature_c": 21})},
    ]
    answer = target.client.chat.completions.create(
        model=target.model, messages=follow_up, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_named_tool_choice_is_a_call_that_stops(target: Target) -> None:
    """A call forced by a named ``tool_choice`` ends with ``finish_reason: "stop"``, streamed and not, as
    OpenAI's API answers (vllm-project/vllm#25054 aligned vLLM); ``required`` ends with ``tool_calls``."""
    # Greedy, with room for the whole call: vLLM decodes the arguments under the tool's JSON schema, and
    # tiny-chat spells its greedy `{"city": "Berlin"}` in 22 tokens (16 end it with `length`).
    kwargs: dict[str, Any] = dict(
        model=target.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
    )
    whole = target.client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "stop"
    assert whole.message.tool_calls and len(whole.message.tool_calls) == 1
    assert whole.message.tool_calls[0].function.name == "get_weather"

    chunks = [c for c in target.client.chat.completions.create(**kwargs, stream=True) if c.choices]
    deltas = [d.choices[0].delta for d in chunks]
    calls = [tc for d in deltas for tc in (d.tool_calls or [])]
    assert calls and calls[0].function is not None and calls[0].function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.function is not None)
    assert isinstance(json.loads(arguments), dict)
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_completions(target: Target) -> None:
    resp = target.client.completions.create(
        model=target.model, prompt="Hello there", max_tokens=6, temperature=0
    )
    assert resp.object == "text_completion"
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage is not None and resp.usage.completion_tokens <= 6
    batch = target.client.completions.create(model=target.model, prompt=["a b", "c d"], max_tokens=3, n=2)
    assert [c.index for c in batch.choices] == [0, 1, 2, 3]
    echoed = target.client.completions.create(
        model=target.model, prompt="Hello there", max_tokens=4, temperature=0, echo=True, logprobs=2
    )
    assert echoed.choices[0].text.startswith("Hello there")
    lp = echoed.choices[0].logprobs
    assert lp is not None and lp.tokens and lp.token_logprobs and len(lp.tokens) == len(lp.token_logprobs)


def test_adapter_lifecycle(target: Target) -> None:
    name = _name()
    resp = target.load(name)
    assert resp.status_code == 200, resp.text
    assert resp.text == f"Success: LoRA adapter '{name}' added successfully."
    listed = {m.id: m for m in target.client.models.list().data}
    assert name in listed
    assert listed[name].model_extra is not None and listed[name].model_extra.get("parent") == target.model

    kwargs: dict[str, Any] = dict(messages=MESSAGES, max_tokens=16, temperature=0, seed=9, logprobs=True)
    base = target.client.chat.completions.create(model=target.model, **kwargs).choices[0]
    tuned = target.client.chat.completions.create(model=name, **kwargs).choices[0]
    assert tuned.logprobs is not None and base.logprobs is not None
    base_lp = [t.logprob for t in base.logprobs.content or []]
    tuned_lp = [t.logprob for t in tuned.logprobs.content or []]
    assert tuned.message.content != base.message.content or tuned_lp != pytest.approx(base_lp, abs=1e-3)

    again = target.load(name)
    assert again.status_code == 400
    assert again.json()["error"]["message"]

    gone = target.unload(name)
    assert gone.status_code == 200 and gone.text == f"Success: LoRA adapter '{name}' removed successfully."
    with pytest.raises(openai.NotFoundError):
        target.client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=2)
    assert name not in [m.id for m in target.client.models.list().data]


def test_unload_unknown_is_404(target: Target) -> None:
    resp = target.unload(_name())
    assert resp.status_code == 404
    assert resp.json()["error"]["type"] == "NotFoundError"


def test_load_errors(target: Target, tmp_path: Path) -> None:
    missing = target.http.post("/v1/load_lora_adapter", json={"lora_name": _name()})
    assert missing.status_code == 400
    no_config = target.load(_name(), str(tmp_path))
    assert no_config.status_code in (400, 404)
    assert set(no_config.json()["error"]) >= {"message", "type", "param", "code"}


def test_unknown_model_is_404(target: Target) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        target.client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)
    assert info.value.status_code == 404

"""Everything the gateway does, with vLLM as its engine: one gateway and one worker of the module's own in
front of the session's vLLM (`vllm_server`), driven through the official `openai` and `tinker` SDKs.

- chat and completions, streamed or not, with tools (vLLM's hermes parser), logprobs, `n`, `seed` and
  `stop`, on the base model, a fine-tuned model and one of its checkpoints: OpenAI's shapes, the client's
  model name in every answer, and the adapter's own answers;
- a job's model is on vLLM (its own `/v1/models`) the moment the job reads `succeeded`, and answers;
- an organisation's rate limit and budget: 429s in OpenAI's envelope, what they admit answered and metered
  from vLLM's own usage;
- the Tinker API's sampling (the gateway's own `/v1/completions`): a base model, and the saved weights of a
  LoRA training client, sampled from vLLM;
- model graders and an eval run whose model and grader vLLM serves: scores computed, equal to what vLLM
  answers directly.

Skipped where vLLM is not installed or cannot run. What `test_vllm.py` and `test_vllm_adapters.py` show
(engine errors mapped, a killed vLLM, adapters evicted and unloaded, usage of streams) is not repeated.
"""

from __future__ import annotations

import json
import re
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import tinker
from tinker import types

from envsdk.graders import parse_score
from gateway.serving.tokens import estimate_prompt_tokens
from gateway.settings import ModelPrice
from gateway.tinker.paths import parse_tinker_path, served_model_id
from tests.support.data import BASE, HELLO_SFT, MESSAGES
from tests.support.engine import make_lora_adapter, register_model
from tests.support.fixtures import worker_fixture
from tests.support.jobs import FINAL_STATES, upload_rows
from tests.support.stack import Admin, GatewayServer, Tenant
from tests.support.tinker import datum
from tests.support.vllm import vllm_gateway_fixture
from tunegate.quickstart import QUESTION_ITEMS
from tunegate.vllm_process import VllmEngineProcess

pytestmark = pytest.mark.timeout(900)  # vLLM's start, when this module is the first to use it

DOLLAR_PER_TOKEN = ModelPrice(input_per_million=1e6, output_per_million=1e6)
"""The module's price: a budget in dollars is a budget in tokens."""

gw = vllm_gateway_fixture("vllm-gw", usage_flush_interval_s=0.3, prices={BASE: DOLLAR_PER_TOKEN})
worker = worker_fixture(
    TUNEGATE_TRAINING_SLOTS="2",  # a job and a Tinker training client at once
    TUNEGATE_HEARTBEAT_INTERVAL_S="0.5",
    TUNEGATE_TINKER_IDLE_TIMEOUT_S="2",  # a finished test's training client lets its slot go
)

KINDS = ("base", "fine-tuned", "checkpoint")
"""The models of the serving tests: `tiny-chat`, an `ft:` model on a random adapter, and a checkpoint of its
job (`...:ckpt-step-2`, on the same adapter)."""
TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "strict": True,  # vLLM guides the arguments by the schema only for a strict tool
            "description": "The weather of a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "enum": ["Paris", "Berlin"]}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    }
]
"""One tool whose arguments vLLM decodes under their schema (`strict`): tiny-chat's call is 22 tokens."""
CITIES = ({"city": "Paris"}, {"city": "Berlin"})
PROMPT = "The weather in Paris is"
SPECIAL_TOKEN = re.compile(r"<\|[a-z_]+\|>")
"""tiny-chat's special tokens (`<|im_end|>`): in vLLM's logprobs, not in the text."""


@pytest.fixture(scope="module")
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("vllm-gw-" + secrets.token_hex(3))


@pytest.fixture(scope="module")
def adapter(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random LoRA adapter: it changes the model's answers, and at rank 4 (not the default 8) leaves it
    able to write a tool call within `max_tokens` (at rank 8 its greedy answers under the tool's schema are
    newlines, which JSON allows, to the end)."""
    root = tmp_path_factory.mktemp("vllm-gw-lora")
    return make_lora_adapter(tiny_model_dir, root / "lora", seed=31, rank=4)


def _ft_model(gw: GatewayServer, org: Tenant, adapter: Path, *, checkpoint: bool = False) -> str:
    """A fine-tuned model of `org` on `adapter` (and a checkpoint of its job, `...:ckpt-step-2`), registered
    as the worker registers a job's."""
    ft = f"ft:{BASE}:{org.org_id}:vllm:ftjob-{secrets.token_hex(6)}"
    ckpt = f"{ft}:ckpt-step-2" if checkpoint else None
    register_model(gw.settings.database_url or "", org.org_id, ft, str(adapter), checkpoint=ckpt)
    return ft


@pytest.fixture(scope="module")
def models(gw: GatewayServer, org: Tenant, adapter: Path) -> dict[str, str]:
    """`KINDS` by name."""
    ft = _ft_model(gw, org, adapter, checkpoint=True)
    return {"base": BASE, "fine-tuned": ft, "checkpoint": f"{ft}:ckpt-step-2"}


def _served(vllm_server: VllmEngineProcess) -> dict[str, dict[str, Any]]:
    """vLLM's own `/v1/models`, by id."""
    return {m["id"]: m for m in httpx.get(f"{vllm_server.url}/v1/models", timeout=30).json()["data"]}


def _engine_name(org: Tenant, model: str) -> str:
    """The name vLLM knows `model` by: the version the gateway serves it as (its answers'
    `system_fingerprint`), found by one request through the gateway."""
    out = org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1)
    assert out.system_fingerprint is not None
    return out.system_fingerprint


def _vllm(vllm_server: VllmEngineProcess, path: str, body: dict[str, Any]) -> dict[str, Any]:
    """vLLM's own answer to `body`, asked directly (not through the gateway)."""
    resp = httpx.post(f"{vllm_server.url}/v1/{path}", json=body, timeout=120)
    assert resp.status_code == 200, resp.text
    answer: dict[str, Any] = resp.json()
    return answer


def _stop_within(text: str) -> str:
    """A stop string found in `text` after its start (two characters from its middle)."""
    middle = max(1, len(text) // 2)
    return text[middle : middle + 2]


# --------------------------------------------------------------------------------------- chat
def _check_chat(out: Any, model: str, n: int) -> None:
    """OpenAI's chat completion: its object, the client's model name, `n` choices in order, usage summed."""
    assert out.object == "chat.completion" and out.id and isinstance(out.created, int)
    assert out.model == model
    assert [c.index for c in out.choices] == list(range(n))
    for choice in out.choices:
        assert choice.message.role == "assistant"
        assert choice.finish_reason in ("stop", "length", "tool_calls")
    usage = out.usage
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_chat_streaming_tools_logprobs_n_seed_and_stop(
    org: Tenant, models: dict[str, str], kind: str
) -> None:
    model = models[kind]
    chat = org.client.chat.completions
    base: dict[str, Any] = dict(model=model, messages=MESSAGES, max_tokens=12, temperature=0)

    # greedy, with logprobs: one entry a completion token, its bytes the answer's, its top 2 alternatives
    greedy = chat.create(**base, logprobs=True, top_logprobs=2)
    _check_chat(greedy, model, 1)
    (choice,) = greedy.choices
    text = choice.message.content
    assert isinstance(text, str) and text and choice.message.tool_calls in (None, [])
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert greedy.usage is not None and len(entries) == greedy.usage.completion_tokens
    said = b"".join(bytes(e.bytes or []) for e in entries).decode()
    assert SPECIAL_TOKEN.sub("", said) == text  # vLLM lists the special tokens the answer leaves out
    for entry in entries:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the likeliest

    # streamed: the same answer and logprobs in chunks of one id, the role first, the usage chunk last
    chunks = list(
        chat.create(
            **base, logprobs=True, top_logprobs=2, stream=True, stream_options={"include_usage": True}
        )
    )
    assert {c.object for c in chunks} == {"chat.completion.chunk"}
    assert {c.model for c in chunks} == {model} and len({c.id for c in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    *body, last = chunks
    assert "".join(c.choices[0].delta.content or "" for c in body) == text
    assert [c.choices[0].finish_reason for c in body if c.choices[0].finish_reason] == [choice.finish_reason]
    streamed_lp = [e for c in body if c.choices[0].logprobs for e in c.choices[0].logprobs.content or []]
    assert [(e.token, e.logprob) for e in streamed_lp] == [(e.token, e.logprob) for e in entries]
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == greedy.usage.model_dump()

    # stop: the answer up to the stop string, which ends it
    stop = _stop_within(text)
    stopped = chat.create(**base, stop=[stop])
    assert stopped.choices[0].message.content == text[: text.index(stop)]
    assert stopped.choices[0].finish_reason == "stop"

    # n and seed: n choices; the same seed the same choices, another seed others
    sampled = [
        chat.create(model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=seed)
        for seed in (7, 7, 8)
    ]
    for out in sampled:
        _check_chat(out, model, 3)
    contents = [[c.message.content for c in out.choices] for out in sampled]
    assert contents[0] == contents[1] and contents[0] != contents[2]
    by_index = ["", "", ""]
    for chunk in chat.create(
        model=model, messages=MESSAGES, max_tokens=8, temperature=1.0, n=3, seed=7, stream=True
    ):
        assert chunk.model == model
        for c in chunk.choices:
            by_index[c.index] += c.delta.content or ""
    assert by_index == contents[0]  # streamed, the same seed gives the same choices

    # tools: a named function is called (`stop`, as OpenAI answers), `required` calls one (`tool_calls`)
    named = chat.create(
        **{**base, "max_tokens": 40},
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    _check_chat(named, model, 1)
    (call,) = named.choices[0].message.tool_calls or []
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) in CITIES
    assert named.choices[0].finish_reason == "stop"
    streamed = list(
        chat.create(**{**base, "max_tokens": 40}, tools=TOOLS, tool_choice="required", stream=True)
    )
    calls = [tc for c in streamed if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert calls and calls[0].id and calls[0].type == "function" and {tc.index for tc in calls} == {0}
    assert calls[0].function is not None and calls[0].function.name == "get_weather"
    arguments = "".join(tc.function.arguments or "" for tc in calls if tc.function is not None)
    assert json.loads(arguments) in CITIES
    assert [c.choices[0].finish_reason for c in streamed if c.choices and c.choices[0].finish_reason] == [
        "tool_calls"
    ]


# --------------------------------------------------------------------------------- completions
def _check_completion(out: Any, model: str, n: int) -> None:
    """OpenAI's text completion: its object, the client's model name, `n` choices in order, usage summed."""
    assert out.object == "text_completion" and out.id and isinstance(out.created, int)
    assert out.model == model
    assert [c.index for c in out.choices] == list(range(n))
    assert all(c.finish_reason in ("stop", "length") and isinstance(c.text, str) for c in out.choices)
    usage = out.usage
    assert usage is not None and usage.completion_tokens >= 1
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


@pytest.mark.parametrize("kind", KINDS)
def test_completions_streaming_logprobs_n_seed_and_stop(
    org: Tenant, models: dict[str, str], kind: str
) -> None:
    model = models[kind]
    legacy = org.client.completions
    base: dict[str, Any] = dict(model=model, prompt=PROMPT, max_tokens=10, temperature=0)

    greedy = legacy.create(**base, logprobs=2)
    _check_completion(greedy, model, 1)
    (choice,) = greedy.choices
    assert choice.text and greedy.usage is not None
    lp = choice.logprobs
    assert lp is not None and lp.tokens is not None and lp.token_logprobs is not None
    assert lp.top_logprobs is not None and lp.text_offset is not None
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == greedy.usage.completion_tokens
    assert SPECIAL_TOKEN.sub("", "".join(lp.tokens)) == choice.text
    assert all(x is not None and x <= 0 for x in lp.token_logprobs)
    assert all(
        2 <= len(top) <= 3 for top in lp.top_logprobs
    )  # the top 2, and the token chosen if not in them
    assert lp.text_offset == sorted(lp.text_offset)

    chunks = list(legacy.create(**base, stream=True, stream_options={"include_usage": True}))
    assert {c.model for c in chunks} == {model} and len({c.id for c in chunks}) == 1
    *body, last = chunks
    assert "".join(c.choices[0].text for c in body) == choice.text
    assert last.choices == [] and last.usage is not None
    assert last.usage.model_dump() == greedy.usage.model_dump()

    stop = _stop_within(choice.text)
    stopped = legacy.create(**base, stop=stop)
    assert (stopped.choices[0].text, stopped.choices[0].finish_reason) == (
        choice.text[: choice.text.index(stop)],
        "stop",
    )

    sampled = [
        legacy.create(model=model, prompt=PROMPT, max_tokens=8, temperature=1.0, n=2, seed=seed)
        for seed in (7, 7, 8)
    ]
    for out in sampled:
        _check_completion(out, model, 2)
    texts = [[c.text for c in out.choices] for out in sampled]
    assert texts[0] == texts[1] and texts[0] != texts[2]


def test_fine_tuned_models_answer_with_their_adapter(
    org: Tenant, models: dict[str, str], vllm_server: VllmEngineProcess
) -> None:
    """The fine-tuned model's greedy answers differ from the base model's; its checkpoint (the same adapter)
    answers as it does; each is what vLLM answers for the model directly."""
    answers = {}
    for kind, model in models.items():
        out = org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=12, temperature=0)
        answers[kind] = out.choices[0].message.content
        assert out.system_fingerprint is not None  # the name vLLM has for it: its version, or the base's
        direct = _vllm(
            vllm_server,
            "chat/completions",
            {"model": out.system_fingerprint, "messages": MESSAGES, "max_tokens": 12, "temperature": 0},
        )
        assert direct["choices"][0]["message"]["content"] == answers[kind]
    assert answers["fine-tuned"] != answers["base"]
    assert answers["checkpoint"] == answers["fine-tuned"]


# ------------------------------------------------------------------------------------- training
def test_a_jobs_model_is_on_vllm_when_the_job_succeeds(
    org: Tenant, worker: Any, vllm_server: VllmEngineProcess
) -> None:
    """A two-step supervised job (LoRA rank 8 by default, within vLLM's 16): the worker loads its adapter
    into vLLM before the job reports `succeeded`, so vLLM lists the model as soon as the job reads so."""
    job = org.client.fine_tuning.jobs.create(
        model=BASE,
        training_file=upload_rows(org, HELLO_SFT),
        suffix="on-vllm",
        method={"type": "supervised", "supervised": {"hyperparameters": {"max_steps": 2, "batch_size": 2}}},
    )
    deadline = time.monotonic() + 300
    while (current := org.client.fine_tuning.jobs.retrieve(job.id)).status not in FINAL_STATES:
        assert time.monotonic() < deadline, f"job {job.id} stuck in {current.status}"
        time.sleep(0.1)
    listed = _served(vllm_server)  # at once: nothing may load it after the job read `succeeded`
    assert current.status == "succeeded", current.error
    model = current.fine_tuned_model
    assert model is not None and model.startswith(f"ft:{BASE}:{org.org_id}:on-vllm:")
    reply = org.client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=8, temperature=0)
    assert reply.model == model and reply.choices[0].message.content
    version = reply.system_fingerprint  # vLLM knows the model by its version
    assert version is not None and version in listed and listed[version]["parent"] == BASE
    assert reply.usage is not None and reply.usage.completion_tokens >= 1


# ------------------------------------------------------------------------------- limits, budgets
def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    error: dict[str, Any] = body["error"]
    return error


def _usage(admin: Admin, org: Tenant, start: int, requests: int) -> dict[str, Any]:
    """The organisation's usage by model once it counts `requests` requests (usage is written in batches);
    read with the admin key, which no rate limit of the organisation's holds."""
    deadline = time.monotonic() + 30
    while True:
        page = admin.http.get(
            "/v1/organization/usage/completions",
            params={"start_time": start, "group_by": "model", "organization_id": org.org_id},
        ).json()
        found = {r["model"]: r for b in page["data"] for r in b["results"]}
        if sum(r["num_model_requests"] for r in found.values()) >= requests:
            return found
        assert time.monotonic() < deadline, f"usage not recorded: {found}"
        time.sleep(0.3)


def test_rate_limit_refuses_past_it_and_meters_what_it_admits(
    gw: GatewayServer, gw_admin: Admin, adapter: Path
) -> None:
    """Two requests a minute for the organisation: a chat of its fine-tuned model and a stream of the base
    model are answered and metered with vLLM's counts; the third is the 429 `rate_limit_exceeded`."""
    org = gw_admin.tenant("vllm-rl-" + secrets.token_hex(3))
    ft = _ft_model(gw, org, adapter)
    limits = gw_admin.http.post(
        f"/v1/admin/organizations/{org.org_id}/limits", json={"max_requests_per_1_minute": 2}
    )
    assert limits.status_code == 200, limits.text
    start = int(time.time()) - 5
    whole = org.client.chat.completions.create(model=ft, messages=MESSAGES, max_tokens=4, temperature=0)
    chunks = list(
        org.client.chat.completions.create(
            model=BASE, messages=MESSAGES, max_tokens=4, stream=True, stream_options={"include_usage": True}
        )
    )
    with pytest.raises(openai.RateLimitError) as refused:
        org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=4)
    error = _error(refused.value)
    assert error["message"].startswith("Rate limit reached for this organization or API key")
    assert {k: error[k] for k in ("type", "param", "code")} == {
        "type": "requests",
        "param": None,
        "code": "rate_limit_exceeded",
    }
    assert int(refused.value.response.headers["retry-after"]) >= 1

    used = _usage(gw_admin, org, start, 2)
    answered = {ft: whole.usage, BASE: chunks[-1].usage}
    assert set(used) == set(answered)
    for model, usage in answered.items():
        assert usage is not None
        row = used[model]
        assert (row["num_model_requests"], row["input_tokens"], row["output_tokens"]) == (
            1,
            usage.prompt_tokens,
            usage.completion_tokens,
        )


def test_budget_refuses_once_spent_and_meters_what_it_admits(gw_admin: Admin) -> None:
    """A budget that admits one chat by the gateway's estimate (at $1 a token): vLLM counts the chat
    template's tokens too, so the chat's cost, metered from vLLM's usage, spends the budget, and the next
    request is the 429 `insufficient_quota` (which the SDK does not retry)."""
    org = gw_admin.tenant("vllm-budget-" + secrets.token_hex(3))
    max_tokens = 2
    estimate = estimate_prompt_tokens({"messages": MESSAGES}) + max_tokens  # USD, at $1 a token
    billing = gw_admin.http.post(
        f"/v1/admin/organizations/{org.org_id}/billing", json={"monthly_budget_usd": estimate + 0.5}
    )
    assert billing.status_code == 200, billing.text
    start = int(time.time()) - 5
    answered = org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=max_tokens)
    usage = answered.usage
    assert usage is not None and usage.prompt_tokens + usage.completion_tokens > estimate + 0.5
    used = _usage(gw_admin, org, start, 1)
    assert (used[BASE]["input_tokens"], used[BASE]["output_tokens"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )

    with pytest.raises(openai.RateLimitError) as refused:
        org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=max_tokens)
    assert _error(refused.value) == {
        "message": "You exceeded your current quota: the organization's monthly budget is spent.",
        "type": "insufficient_quota",
        "param": None,
        "code": "insufficient_quota",
    }
    assert refused.value.response.headers["x-should-retry"] == "false"
    costs = gw_admin.http.get(
        "/v1/organization/costs",
        params={"start_time": start, "group_by": "line_item", "organization_id": org.org_id},
    ).json()
    spent = sum(r["amount"]["value"] for b in costs["data"] for r in b["results"])
    assert spent == pytest.approx(usage.prompt_tokens + usage.completion_tokens)


# ----------------------------------------------------------------------------------------- Tinker
TOKENS = [5, 17, 42, 9, 33, 7, 61, 12]
"""Token ids to train on and to prompt with."""


def _vllm_tokens(vllm_server: VllmEngineProcess, model: str, prompt: list[int], max_tokens: int) -> list[int]:
    """vLLM's greedy tokens for `prompt`, asked directly."""
    out = _vllm(
        vllm_server,
        "completions",
        {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        },
    )
    return [int(t.removeprefix("token_id:")) for t in out["choices"][0]["logprobs"]["tokens"]]


def test_tinker_samples_a_base_model_and_saved_weights_from_vllm(
    gw: GatewayServer, gw_admin: Admin, worker: Any, vllm_server: VllmEngineProcess
) -> None:
    """The `tinker` SDK: a base model sampled, then a LoRA training client trained a step, its weights
    saved for a sampler (loaded on vLLM as they are saved) and sampled; greedy tokens are vLLM's own."""
    org = gw_admin.tenant("vllm-tinker-" + secrets.token_hex(3))
    prompt = types.ModelInput.from_ints(TOKENS[:4])
    greedy = types.SamplingParams(max_tokens=6, temperature=0.0)
    with tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key) as service:
        base = service.create_sampling_client(base_model=BASE)
        (seq,) = base.sample(prompt, 1, greedy).result().sequences
        assert seq.tokens == _vllm_tokens(vllm_server, BASE, TOKENS[:4], 6)

        tc = service.create_lora_training_client(base_model=BASE, rank=4, seed=0)
        tc.forward_backward([datum(TOKENS)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.05)).result()
        saved = tc.save_weights_for_sampler("on-vllm").result()
        model_id, _, name = parse_tinker_path(saved.path) or ("", "", "")
        served = served_model_id(BASE, org.org_id, model_id, name)
        listed = _served(vllm_server)  # before any request for it
        version = _engine_name(org, served)
        assert version in listed

        sampler = service.create_sampling_client(model_path=saved.path)
        res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=5, seed=3)).result()
        assert len(res.sequences) == 2
        for sequence in res.sequences:
            assert 1 <= len(sequence.tokens) <= 5 and sequence.stop_reason in ("length", "stop")
            assert sequence.logprobs is not None and len(sequence.logprobs) == len(sequence.tokens)
            assert all(lp <= 0 for lp in sequence.logprobs)
        (tuned,) = sampler.sample(prompt, 1, greedy).result().sequences
        assert tuned.tokens == _vllm_tokens(vllm_server, version, TOKENS[:4], 6)
        # stop token ids (vLLM's `stop_token_ids`) end a sequence at the first of them, its last token
        stop = tuned.tokens[2]
        params = greedy.model_copy(update={"stop": [stop]})
        (stopped,) = sampler.sample(prompt, 1, params).result().sequences
        assert stopped.tokens == tuned.tokens[: tuned.tokens.index(stop) + 1]
        assert stopped.stop_reason == "stop"


# -------------------------------------------------------------------------------- graders, evals
SCORE_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "score", "strict": True, "schema": {"type": "integer", "enum": [0, 1]}},
}
"""A verdict vLLM's schema-guided decoding holds to 0 or 1, so a tiny model's verdict parses."""
LABEL_FORMAT: Any = {
    "type": "json_schema",
    "json_schema": {"name": "label", "strict": True, "schema": {"type": "string", "enum": ["yes", "no"]}},
}
"""A label vLLM's schema-guided decoding holds to `"yes"` or `"no"`."""
JUDGE_PROMPT = "Score 0 to 1: {{ item.question }} -> {{ sample.output_text }}"
LABEL_PROMPT = "Is '{{ sample.output_text }}' right? Say yes or no."
ITEM = {"question": "What is 2 + 2?", "answer": "4"}


def _judge(model: str) -> dict[str, Any]:
    return {
        "type": "score_model",
        "name": "judge",
        "model": model,
        "input": [{"role": "user", "content": JUDGE_PROMPT}],
        "sampling_params": {"temperature": 0, "max_completion_tokens": 4, "response_format": SCORE_FORMAT},
    }


def _labeller(model: str) -> dict[str, Any]:
    return {
        "type": "label_model",
        "name": "tone",
        "model": model,
        "input": [{"role": "user", "content": LABEL_PROMPT}],
        "labels": ["yes", "no"],
        "passing_labels": ["yes"],
        "sampling_params": {"temperature": 0, "max_completion_tokens": 8, "response_format": LABEL_FORMAT},
    }


def test_model_graders_score_with_vllms_verdicts(
    gw: GatewayServer, org: Tenant, models: dict[str, str], vllm_server: VllmEngineProcess
) -> None:
    """`graders/run` with a score_model grader on the fine-tuned model and a label_model grader on the base
    model, alone and in a multi grader: each reward is the verdict vLLM gives the same messages directly,
    and its tokens are vLLM's count."""
    ft = models["fine-tuned"]
    sample = "4"
    direct = {
        "judge": _vllm(
            vllm_server,
            "chat/completions",
            {
                "model": _engine_name(org, ft),
                "messages": [{"role": "user", "content": f"Score 0 to 1: {ITEM['question']} -> {sample}"}],
                "temperature": 0,
                "max_completion_tokens": 4,
                "response_format": SCORE_FORMAT,
            },
        ),
        "tone": _vllm(
            vllm_server,
            "chat/completions",
            {
                "model": BASE,
                "messages": [{"role": "user", "content": f"Is '{sample}' right? Say yes or no."}],
                "temperature": 0,
                "max_completion_tokens": 8,
                "response_format": LABEL_FORMAT,
            },
        ),
    }
    expected = {
        "judge": parse_score(direct["judge"]["choices"][0]["message"]["content"]),
        "tone": float(
            json.loads(direct["tone"]["choices"][0]["message"]["content"]) == "yes"
        ),  # "yes" or "no"
    }

    def run(grader: dict[str, Any]) -> dict[str, Any]:
        resp = httpx.post(
            f"{gw.url}/v1/fine_tuning/alpha/graders/run",
            json={"grader": grader, "model_sample": sample, "item": ITEM},
            headers={"Authorization": f"Bearer {org.key}"},
            timeout=120,
        )
        assert resp.status_code == 200, resp.text
        result: dict[str, Any] = resp.json()
        assert not any(v for k, v in result["metadata"]["errors"].items() if k.endswith("_error")), result
        return result

    for name, grader, model in (("judge", _judge(ft), ft), ("tone", _labeller(BASE), BASE)):
        result = run(grader)
        assert result["reward"] == expected[name]
        usage = result["model_grader_token_usage_per_model"][model]
        assert (usage["prompt_tokens"], usage["completion_tokens"]) == (
            direct[name]["usage"]["prompt_tokens"],
            direct[name]["usage"]["completion_tokens"],
        )
    both = run(
        {
            "type": "multi",
            "name": "both",
            "graders": {"judge": _judge(ft), "tone": _labeller(BASE)},
            "calculate_output": "0.5 * judge + 0.5 * tone",
        }
    )
    assert both["sub_rewards"] == expected
    assert both["reward"] == pytest.approx(0.5 * expected["judge"] + 0.5 * expected["tone"])


def test_eval_run_of_a_fine_tuned_model_graded_by_a_model(
    org: Tenant, models: dict[str, str], worker: Any, vllm_server: VllmEngineProcess
) -> None:
    """An eval run sampling the fine-tuned model, graded by a score_model grader on the base model and a
    string check: completed, no item errored, each sample vLLM's own answer and each score computed."""
    ft = models["fine-tuned"]
    version = _engine_name(org, ft)
    questions = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in (1, 2)]
    sampling = {"temperature": 0, "max_completion_tokens": 6, "seed": 7}
    system = "Answer with the number only."
    ev = org.client.evals.create(
        name="on vllm",
        data_source_config=QUESTION_ITEMS,
        testing_criteria=[
            _judge(BASE),
            {
                "type": "string_check",
                "name": "has a 2",
                "input": "{{ sample.output_text }}",
                "reference": "2",
                "operation": "like",
            },
        ],
    )
    run = org.client.evals.runs.create(
        ev.id,
        data_source={
            "type": "completions",
            "model": ft,
            "source": {"type": "file_content", "content": [{"item": q} for q in questions]},
            "input_messages": {
                "type": "template",
                "template": [
                    {"role": "system", "content": system},
                    {"role": "user", "content": "{{ item.question }}"},
                ],
            },
            "sampling_params": sampling,
        },
    )
    deadline = time.monotonic() + 240
    while (done := org.client.evals.runs.retrieve(run.id, eval_id=ev.id)).status not in (
        "completed",
        "failed",
        "canceled",
    ):
        assert time.monotonic() < deadline, f"run {run.id} stuck in {done.status}"
        time.sleep(0.3)
    assert done.status == "completed", done.error
    assert (done.result_counts.total, done.result_counts.errored) == (2, 0)
    items = sorted(
        org.client.evals.runs.output_items.list(run.id, eval_id=ev.id), key=lambda i: i.datasource_item_id
    )
    assert len(items) == 2
    for item, question in zip(items, questions, strict=True):
        assert item.sample.error is None and item.sample.model == ft
        messages = [{"role": "system", "content": system}, {"role": "user", "content": question["question"]}]
        direct = _vllm(vllm_server, "chat/completions", {"model": version, "messages": messages, **sampling})
        output = item.sample.output[0].content
        assert output == direct["choices"][0]["message"]["content"]
        judge, check = item.results
        assert judge.name == "judge" and judge.score in (0.0, 1.0) and "error" not in judge.to_dict()
        assert check.score == float("2" in output)
        assert item.status == ("pass" if judge.passed and check.passed else "fail")
    usage = {u.run_model_name: u.invocation_count for u in done.per_model_usage}
    assert usage == {ft: 2, BASE: 2}

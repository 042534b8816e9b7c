"""Capture of legacy text completions (`POST /v1/completions`), through the official `openai` SDK against a
gateway whose engine serves tiny-chat: a text completion of an episode is captured, streamed or not, with
the ids its prompt was encoded to and the ids it sampled (the same both ways), while the client sees what it
sees without capture; a prompt of token ids that extends the last call's sampled ids continues its sequence
(token in, token out: one sample, no break); `store` alone captures no text completion, a batch of prompts
in an episode is a 400 naming `prompt`, and the stored chat completions API never lists a text
completion."""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx
import openai
import pytest

from tests.support.capture import capture_on, eventually
from tests.support.data import BASE
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant

gw = gateway_fixture("capture-text")

SEEDED: dict[str, Any] = {"model": BASE, "prompt": "2 + 3 =", "max_tokens": 6, "temperature": 1.0, "seed": 77}


@pytest.fixture(scope="module")
def capturing(gw_admin: Admin) -> Tenant:
    t = gw_admin.tenant("capture-text-" + secrets.token_hex(3))
    capture_on(gw_admin, t)
    return t


@pytest.fixture(scope="module")
def tokenizer(gw: GatewayServer) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gw.settings.base_model_path(BASE)))


def _export(t: Tenant, episode: str, calls: int) -> dict[str, Any]:
    """The episode's export once its `calls` calls are written."""

    def probe() -> dict[str, Any] | None:
        got = httpx.get(
            f"{t.client.base_url}episodes/{episode}",
            headers={"Authorization": f"Bearer {t.key}"},
            timeout=30,
        )
        if got.status_code != 200 or len(got.json()["calls"]) < calls:
            return None
        out = t.client.get(f"episodes/{episode}/export", cast_to=object)
        assert isinstance(out, dict)
        return out

    return eventually(probe, f"{calls} calls of {episode} written")


def _plain(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def test_text_completions_of_an_episode_are_captured_with_their_ids(
    gw_admin: Admin, capturing: Tenant, tokenizer: Any
) -> None:
    plain = gw_admin.tenant("capture-text-plain-" + secrets.token_hex(3))
    episode = "text-" + secrets.token_hex(4)
    headers = {"X-Episode-Id": episode}
    whole = capturing.client.completions.create(**SEEDED, extra_headers=headers)
    # The client sees what it sees without capture: no token ids, no log-probabilities it did not ask for.
    assert _plain(whole.to_dict()) == _plain(plain.client.completions.create(**SEEDED).to_dict())
    assert "token_ids" not in whole.to_dict()["choices"][0] and whole.choices[0].logprobs is None
    with capturing.client.completions.with_streaming_response.create(
        **SEEDED, stream=True, extra_headers=headers
    ) as resp:
        chunks = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    with plain.client.completions.with_streaming_response.create(**SEEDED, stream=True) as resp:
        unseen = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert [_plain(c) for c in chunks] == [_plain(c) for c in unseen]
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    assert text == whole.choices[0].text

    export = _export(capturing, episode, 2)
    samples = export["samples"]
    assert len(samples) == 2  # the same prompt twice: the second extends no sampled ids, a segment break
    assert samples[1]["segment_break"]["reason"] == "prompt_diverged"
    prompt = tokenizer("2 + 3 =")["input_ids"]
    assert whole.usage is not None
    for s in samples:
        ids, mask = s["input_ids"], s["completion_mask"]
        assert ids[: len(prompt)] == prompt and mask[: len(prompt)] == [0] * len(prompt)
        sampled = ids[len(prompt) :]
        assert mask[len(prompt) :] == [1] * len(sampled) and len(sampled) == whole.usage.completion_tokens
        assert tokenizer.decode(sampled, skip_special_tokens=True) == text
        assert all(isinstance(lp, float) and lp <= 0 for lp in s["logprobs"][len(prompt) :])
    assert samples[0]["input_ids"] == samples[1]["input_ids"]  # streamed and whole: the same ids
    assert samples[0]["logprobs"] == pytest.approx(samples[1]["logprobs"], abs=1e-4)


def test_a_prompt_of_the_sampled_ids_continues_the_sequence(capturing: Tenant, tokenizer: Any) -> None:
    episode = "text-tito-" + secrets.token_hex(4)
    headers = {"X-Episode-Id": episode}
    prompt = tokenizer("Count: 1, 2,")["input_ids"]
    first = capturing.client.completions.create(
        model=BASE,
        prompt=prompt,
        max_tokens=4,
        temperature=1.0,
        seed=5,
        extra_headers=headers,
        extra_body={"return_token_ids": True},
    )
    choice: Any = first.model_dump()["choices"][0]
    sampled = choice["token_ids"]  # asked for: the client gets them
    assert choice["prompt_token_ids"] == prompt and sampled
    follow = tokenizer(" and then", add_special_tokens=False)["input_ids"]
    capturing.client.completions.create(
        model=BASE,
        prompt=prompt + sampled + follow,
        max_tokens=4,
        temperature=1.0,
        seed=6,
        extra_headers=headers,
        logprobs=0,
    )
    samples = _export(capturing, episode, 2)["samples"]
    assert len(samples) == 1 and samples[0]["segment_break"] is None  # one sequence, exact
    ids, mask = samples[0]["input_ids"], samples[0]["completion_mask"]
    start = prompt + sampled + follow
    assert ids[: len(start)] == start
    assert [i for i, m in enumerate(mask) if m] == [
        *range(len(prompt), len(prompt) + len(sampled)),
        *range(len(start), len(ids)),
    ]


def test_store_alone_captures_no_text_completion_and_batches_are_refused(capturing: Tenant) -> None:
    made = capturing.client.completions.create(**SEEDED, extra_body={"store": True})
    with pytest.raises(openai.BadRequestError) as info:
        capturing.client.completions.create(
            **{**SEEDED, "prompt": ["one", "two"]}, extra_headers={"X-Episode-Id": "text-batch"}
        )
    assert info.value.body == {
        "message": "A captured completion takes one prompt (a text or a list of token ids): send the "
        "prompts of a batch as calls of their own.",
        "type": "invalid_request_error",
        "param": "prompt",
        "code": "invalid_value",
    }
    # An episode's text completion is captured (its episode lists it), and the stored chat completions API
    # lists neither it nor the one `store` named.
    episode = "text-list-" + secrets.token_hex(4)
    kept = capturing.client.completions.create(**SEEDED, extra_headers={"X-Episode-Id": episode})
    _export(capturing, episode, 1)
    listed = [c.id for c in capturing.client.chat.completions.list(limit=100)]
    assert made.id not in listed and kept.id not in listed
    for cid in (made.id, kept.id):
        with pytest.raises(openai.NotFoundError):
            capturing.client.chat.completions.retrieve(cid)

"""Captured episodes as training data, through the official `openai` SDK against a gateway whose engine
serves tiny-chat: a scripted multi-turn tool agent's calls stored as deltas on the ids sampled before, with a
segment break where the chat template rewrote the conversation; the export's token ids equal the sampled
ids exactly and its loss mask covers exactly the sampled tokens; Tinker `Datum`s; the trainer's recomputed
log-probabilities of the exported tokens match the sampler's; rewards posted a day later land in the export,
a repeated one counts once; another organisation's episodes are 404."""

from __future__ import annotations

import json
import secrets
from typing import Any

import httpx
import pytest

from tests.support.capture import eventually
from tests.support.data import BASE, TOOLS
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant

gw = gateway_fixture("capture-export")

THINK_OPEN = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
"""The generation prompt of a template that thinks (empty thinking, as a model asked not to think writes
it), which it leaves out of earlier assistant turns when it renders them again."""


def _thinking_template(tokenizer: Any) -> str:
    """tiny-chat's template, with a generation prompt that opens (empty) thinking, which earlier turns lose
    when rendered again, as Qwen3's template strips them."""
    template = str(tokenizer.chat_template)
    plain = "{{- '<|im_start|>assistant\\n' }}"
    assert template.count(plain) == 1, "tiny-chat's template changed: update the thinking one"
    return template.replace(plain, "{{- '" + THINK_OPEN.replace("\n", "\\n") + "' }}")


@pytest.fixture(scope="module")
def capturing(gw_admin: Admin) -> Tenant:
    t = gw_admin.tenant("export-" + secrets.token_hex(3))
    resp = gw_admin.http.post(f"/v1/admin/organizations/{t.org_id}/capture", json={"enabled": True})
    assert resp.status_code == 200, resp.text
    return t


@pytest.fixture(scope="module")
def tokenizer(gw: GatewayServer) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gw.settings.base_model_path(BASE)))


def _get(t: Tenant, path: str, **params: Any) -> httpx.Response:
    return httpx.get(
        f"{t.client.base_url}{path}", params=params, headers={"Authorization": f"Bearer {t.key}"}, timeout=60
    )


def _export(t: Tenant, episode: str, calls: int, **params: Any) -> dict[str, Any]:
    """The episode's export once its `calls` calls are written."""

    def probe() -> dict[str, Any] | None:
        resp = _get(t, f"episodes/{episode}/export", **params)
        if resp.status_code != 200:
            return None
        body = resp.json()
        items = body.get("samples", body.get("datums", []))
        seen = body.get("samples") and sum(len(s["completion_ids"]) for s in body["samples"])
        return body if items and (seen == calls or "datums" in body) else None

    return eventually(probe, f"{calls} calls of {episode} exported")


def _agent(t: Tenant, episode: str, turns: int, **extra: Any) -> list[dict[str, Any]]:
    """A scripted tool agent: each turn sends the conversation so far, as the SDK returned it, plus the tool's
    result when the model called the tool, else the next question. Returns what each turn sampled, as the
    engine told the agent itself (`return_token_ids`)."""
    messages: list[Any] = [
        {"role": "system", "content": "You can add numbers with the add tool."},
        {"role": "user", "content": "What is 2 + 3?"},
    ]
    seen = []
    for turn in range(turns):
        reply = t.client.chat.completions.create(
            model=BASE,
            messages=messages,
            tools=TOOLS,
            max_tokens=8,
            temperature=1.0,
            seed=100 + turn,
            logprobs=True,
            extra_headers={"X-Episode-Id": episode},
            extra_body={"return_token_ids": True, **extra},
        )
        raw = reply.model_dump()
        choice = raw["choices"][0]
        seen.append(
            {
                "id": reply.id,
                "prompt_ids": raw["prompt_token_ids"],
                "ids": choice["token_ids"],
                "logprobs": [c["logprob"] for c in choice["logprobs"]["content"]],
            }
        )
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls or []:
            messages.append({"role": "tool", "tool_call_id": call.id, "content": "5"})
        if not message.tool_calls:
            messages.append({"role": "user", "content": f"And {turn} + 1?"})
    return seen


def test_a_template_that_strips_thinking_breaks_segments_and_the_export_keeps_the_sampled_ids(
    capturing: Tenant, tokenizer: Any
) -> None:
    episode = "think-" + secrets.token_hex(4)
    template = _thinking_template(tokenizer)
    seen = _agent(capturing, episode, 3, chat_template=template)
    for turn in seen:  # every prompt opened the thinking the model then wrote after
        assert tokenizer.decode(turn["prompt_ids"]).endswith(THINK_OPEN)
    exported = _export(capturing, episode, 3)
    samples = exported["samples"]
    # Each later prompt rendered the earlier turns without their thinking: three segments, each exact.
    assert [s["completion_ids"] for s in samples] == [[t["id"]] for t in seen]
    for sample, turn in zip(samples, seen, strict=True):
        assert sample["input_ids"] == turn["prompt_ids"] + turn["ids"]
        assert sample["completion_mask"] == [0] * len(turn["prompt_ids"]) + [1] * len(turn["ids"])
        assert sample["logprobs"][len(turn["prompt_ids"]) :] == turn["logprobs"]
        assert set(sample["logprobs"][: len(turn["prompt_ids"])]) == {None}
    breaks = [s["segment_break"] for s in samples]
    assert breaks[0] is None
    for brk, before in zip(breaks[1:], seen, strict=False):
        sequence = before["prompt_ids"] + before["ids"]
        assert brk["reason"] == "prompt_diverged" and brk["previous_tokens"] == len(sequence)
        # it diverged where the earlier turn's thinking was: right after its generation prompt's start
        start = (
            len(before["prompt_ids"])
            - len(tokenizer.encode(THINK_OPEN))
            + len(tokenizer.encode("<|im_start|>assistant\n"))
        )
        assert brk["at_token"] == start
    # A naive re-render of the whole conversation is not what turn 1 sampled: training on it would train on
    # tokens the model never produced (the break that exporting the sampled ids avoids).
    calls = _get(capturing, f"episodes/{episode}").json()["calls"]
    assert [c["id"] for c in calls] == [t["id"] for t in seen]
    first = seen[0]["prompt_ids"] + seen[0]["ids"]
    messages = capturing.client.chat.completions.messages.list(seen[-1]["id"], limit=100).data
    rendered = tokenizer.apply_chat_template(
        [{"role": m.role, "content": m.content or ""} for m in messages], tokenize=True
    )
    rendered = list(rendered["input_ids"] if hasattr(rendered, "keys") else rendered)
    assert rendered[: len(first)] != first


def test_turns_that_extend_the_sampled_ids_export_as_one_sample_with_every_turn_masked(
    capturing: Tenant, gw: GatewayServer
) -> None:
    episode = "plain-" + secrets.token_hex(4)
    seen = _agent(capturing, episode, 3)
    exported = _export(capturing, episode, 3)
    # Each prompt started with the turn before's prompt and sampled ids: stored as deltas on it.
    calls = _get(capturing, f"episodes/{episode}").json()["calls"]
    assert [(c["previous_id"], c["prompt_prefix_tokens"], c["segment_break"]) for c in calls] == [
        (None, 0, None),
        (seen[0]["id"], len(seen[0]["prompt_ids"]) + len(seen[0]["ids"]), None),
        (seen[1]["id"], len(seen[1]["prompt_ids"]) + len(seen[1]["ids"]), None),
    ]
    # One sample: the last turn's whole sequence, the loss mask on exactly the ids each turn sampled.
    [sample] = exported["samples"]
    last = seen[-1]
    assert sample["completion_ids"] == [t["id"] for t in seen]
    assert sample["input_ids"] == last["prompt_ids"] + last["ids"]
    mask = [0] * len(sample["input_ids"])
    for turn in seen:
        start = len(turn["prompt_ids"])
        assert sample["input_ids"][start : start + len(turn["ids"])] == turn["ids"]
        mask[start : start + len(turn["ids"])] = [1] * len(turn["ids"])
        assert sample["logprobs"][start : start + len(turn["ids"])] == turn["logprobs"]
    assert sample["completion_mask"] == mask
    # What the stored-completions API shows is whole: the last turn's prompt ids and every message.
    stored = _get(capturing, f"chat/completions/{last['id']}").json()["capture"]
    assert stored["prompt_token_ids"] == last["prompt_ids"] and stored["previous_id"] == seen[1]["id"]
    from gateway.usage.pricing import completion_cost

    usage = calls[-1]["usage"]
    price = completion_cost(gw.settings, BASE, usage["prompt_tokens"], usage["completion_tokens"])
    assert stored["cost_usd"] == pytest.approx(price) and price > 0
    messages = capturing.client.chat.completions.messages.list(last["id"], limit=100).data
    assert [m.role for m in messages][:2] == ["system", "user"] and len(messages) >= 6
    # The trainer's log-probabilities of the sampled tokens (fp32, the base model) match the sampler's.
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(gw.settings.base_model_path(BASE)), dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor([sample["input_ids"]])).logits[0]
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    deltas = [
        abs(float(logprobs[i - 1, sample["input_ids"][i]]) - sample["logprobs"][i])
        for i, m in enumerate(sample["completion_mask"])
        if m
    ]
    assert len(deltas) == sum(len(t["ids"]) for t in seen)
    assert sum(deltas) / len(deltas) < 1e-3, deltas
    # The same sample as a Tinker Datum: the model reads all but the last token and predicts all but the
    # first, weighted by the mask.
    from tinker.types._pydantic_types.datum import Datum

    [raw] = _get(capturing, f"episodes/{episode}/export", format="tinker").json()["datums"]
    datum = Datum.model_validate(raw)
    assert datum.model_input.to_ints() == sample["input_ids"][:-1]
    inputs = raw["loss_fn_inputs"]
    assert inputs["target_tokens"] == {
        "data": sample["input_ids"][1:],
        "dtype": "int64",
        "shape": [len(sample["input_ids"]) - 1],
    }
    assert inputs["weights"]["data"] == [float(m) for m in sample["completion_mask"][1:]]
    assert inputs["advantages"]["data"] == [0.0] * (len(sample["input_ids"]) - 1)  # no reward yet


def test_a_reward_posted_a_day_later_lands_in_the_export_once(capturing: Tenant, gw: GatewayServer) -> None:
    episode = "late-" + secrets.token_hex(4)
    seen = _agent(capturing, episode, 1)
    _export(capturing, episode, 1)
    # A day passes: the episode and its call are a day old (the clock moved), and it went idle long ago.
    import asyncio

    import asyncpg

    async def age() -> None:
        conn = await asyncpg.connect(gw.settings.database_url)
        try:
            for table, key in (("episodes", "id"), ("captured_completions", "episode_id")):
                await conn.execute(
                    f"UPDATE {table} SET created_at = created_at - interval '1 day' "
                    f"WHERE organization_id = $1 AND {key} = $2",
                    capturing.org_id,
                    episode,
                )
            await conn.execute(
                "UPDATE episodes SET last_call_at = last_call_at - interval '1 day' "
                "WHERE organization_id = $1 AND id = $2",
                capturing.org_id,
                episode,
            )
        finally:
            await conn.close()

    asyncio.run(age())
    assert _get(capturing, f"episodes/{episode}").json()["state"] == "abandoned"
    for _ in range(2):  # the same reward posted twice (a retry) counts once
        posted = capturing.client.post(
            f"/episodes/{episode}/rewards",
            body={"name": "correct", "value": 1.0, "idempotency_key": "grade-1", "source": "scorer"},
            cast_to=object,
        )
        assert posted["value"] == 1.0
    [sample] = _export(capturing, episode, 1, reward="correct")["samples"]
    assert sample["reward"] == 1.0 and sample["completion_ids"] == [seen[0]["id"]]
    assert [(r["name"], r["value"], r["source"]) for r in sample["rewards"]] == [("correct", 1.0, "scorer")]
    # Bulk export: JSONL lines, advantages relative to the group exported.
    body = {"episode_ids": [episode], "reward": "correct"}
    resp = httpx.post(
        f"{capturing.client.base_url}episodes/export",
        json=body,
        headers={"Authorization": f"Bearer {capturing.key}"},
        timeout=60,
    )
    assert resp.status_code == 200 and resp.headers["content-type"].startswith("application/jsonl")
    lines = [json.loads(line) for line in resp.text.splitlines()]
    assert [(x["episode_id"], x["reward"], x["advantage"]) for x in lines] == [(episode, 1.0, 0.0)]


def test_another_organisation_cannot_export_an_episode(capturing: Tenant, gw_admin: Admin) -> None:
    episode = "mine-" + secrets.token_hex(4)
    _agent(capturing, episode, 1)
    _export(capturing, episode, 1)
    other = gw_admin.tenant("export-other-" + secrets.token_hex(3))
    resp = _get(other, f"episodes/{episode}/export")
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "episode_id"
    resp = httpx.post(
        f"{other.client.base_url}episodes/export",
        json={"episode_ids": [episode]},
        headers={"Authorization": f"Bearer {other.key}"},
        timeout=60,
    )
    assert resp.status_code == 404
    bad = httpx.post(
        f"{capturing.client.base_url}episodes/export",
        json={"format": "tinker", "purpose": "fine-tune"},
        headers={"Authorization": f"Bearer {capturing.key}"},
        timeout=60,
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "format"


@pytest.mark.parametrize(
    ("rows", "says"),
    [
        ([{"input_ids": [1, "2"], "completion_mask": [0, 1]}], "'input_ids' must be a list"),
        ([{"input_ids": [1, -2], "completion_mask": [0, 1]}], "'input_ids' must be a list"),
        ([{"input_ids": [1, 2, 3], "completion_mask": [0, 1]}], "one for each of 'input_ids'"),
        ([{"input_ids": [1, 2], "completion_mask": [1, 0]}], "marks no token to train on"),
        (
            [
                {"input_ids": [1, 2], "completion_mask": [0, 1]},
                {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            ],
            "cannot share a file",
        ),
    ],
)
def test_training_rows_of_token_ids_are_checked(tmp_path: Any, rows: list[Any], says: str) -> None:
    from gateway.jobs.validation import RowError, check_training_file

    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(RowError, match=says):
        check_training_file(path, "supervised", max_line_bytes=1 << 20)
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"input_ids": [5, 6, 7], "completion_mask": [0, 1, 1]}) + "\n")
    assert check_training_file(good, "supervised", max_line_bytes=1 << 20).rows == 1


def test_the_trainer_trains_on_the_ids_the_mask_marks() -> None:
    from trainer.data import convert_rows

    [row] = convert_rows("supervised", [{"input_ids": [5, 6, 7, 8], "completion_mask": [0, 0, 1, 1], "x": 1}])
    assert row == {"input_ids": [5, 6, 7, 8], "labels": [-100, -100, 7, 8]}


def test_a_job_takes_its_data_from_captured_episodes(capturing: Tenant) -> None:
    tag = secrets.token_hex(3)
    for i in range(2):
        episode = capturing.client.post(
            "/episodes", body={"id": f"job-{tag}-{i}", "metadata": {"run": tag}}, cast_to=object
        )
        agent = capturing.client.with_options(api_key=episode["key"])
        agent.chat.completions.create(
            model=BASE, messages=[{"role": "user", "content": "2 + 3?"}], max_tokens=4
        )
        capturing.client.post(
            f"/episodes/{episode['id']}/rewards", body={"name": "ok", "value": float(i)}, cast_to=object
        )
    _export(capturing, f"job-{tag}-1", 1)
    _export(capturing, f"job-{tag}-0", 1)
    selection = {"metadata": {"run": tag}, "reward": "ok", "min_reward": 1.0}
    job: Any = capturing.client.post(
        "/fine_tuning/jobs",
        body={"model": BASE, "method": {"type": "supervised"}, "capture": selection},
        cast_to=object,
    )
    assert job["status"] in ("validating_files", "queued") and job["training_file"].startswith("file-")
    made = capturing.client.files.retrieve(job["training_file"])
    assert made.purpose == "fine-tune" and made.filename == "captured-episodes.jsonl"
    [row] = [json.loads(x) for x in capturing.client.files.content(made.id).text.splitlines()]
    assert row["episode_id"] == f"job-{tag}-1" and row["reward"] == 1.0
    capturing.client.fine_tuning.jobs.cancel(job["id"])
    for body, param in [
        ({"model": BASE}, "training_file"),
        ({"model": BASE, "training_file": made.id, "capture": selection}, "capture"),
        ({"model": BASE, "method": {"type": "dpo"}, "capture": selection}, "capture"),
        ({"model": BASE, "capture": {**selection, "limit": 0}}, "capture.limit"),
        ({"model": BASE, "capture": {"metadata": {"run": "nothing-" + tag}}}, "purpose"),
    ]:
        resp = httpx.post(
            f"{capturing.client.base_url}fine_tuning/jobs",
            json=body,
            headers={"Authorization": f"Bearer {capturing.key}"},
            timeout=60,
        )
        assert resp.status_code == 400 and resp.json()["error"]["param"] == param, resp.text

"""Know the cost before a run, and hold a job to its `max_cost`: through the SDK against a running gateway.

`POST /v1/fine_tuning/jobs/estimate` counts a file's tokens with the base model's tokenizer as the trainer
does (exact for supervised and DPO files; for reinforcement, the completions' length measured by a pilot
sampled through the chat route, or bounded when it cannot run), prices them, and refuses what a create
refuses, in the same envelope. Jobs carry their cost, accrued and projected. A job
whose cost reaches its `max_cost` pauses with a checkpoint and an event that gives the numbers, is billed to
that step only, and goes on when resumed.
"""

from __future__ import annotations

import time
from typing import Any

import httpx
import openai
import pytest

from gateway.jobs.pilot import PILOT_SEED
from gateway.worker.job.metering import MAX_COST_PAUSED
from tests.support.data import BASE, DPO, RFT, SAYS_YES, SFT
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.jobs import all_events, metrics_steps, upload_rows, wait_for, wait_trainer_gone
from tests.support.stack import GatewayServer, Tenant, WorkerProcess, admin_of
from tests.support.vllm import vllm_gateway_fixture

ESTIMATE = "/fine_tuning/jobs/estimate"

cost_worker = worker_fixture(of="stack")
gw = gateway_fixture("estimate-pilot", usage_flush_interval_s=0.3)
"""A gateway whose engine serves `tiny-chat` (the session's `stack` serves no model): the pilot samples."""
vllm_gw = vllm_gateway_fixture("estimate-vllm", usage_flush_interval_s=0.3)
"""The same, with the session's vLLM serving `tiny-chat`."""


def _estimate(t: Tenant, **body: Any) -> dict[str, Any]:
    found = t.client.post(ESTIMATE, body={"model": BASE, **body}, cast_to=object)
    assert isinstance(found, dict) and found["object"] == "fine_tuning.job.estimate", found
    return found


def _refusal(call: Any) -> tuple[int, dict[str, Any]]:
    """The status and OpenAI error object of a call the gateway refuses."""
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value.status_code, caught.value.response.json()["error"]


def _tokens(stack: GatewayServer, messages: list[dict[str, Any]], **kw: Any) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stack.settings.base_model_path(BASE)))
    out: Any = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return len(out["input_ids"])


def _exact(r: dict[str, Any], value: float) -> None:
    assert r == {"low": value, "expected": value, "high": value}, r


def test_supervised_estimate_counts_the_file_with_the_tokenizer(stack: GatewayServer, tenant: Tenant) -> None:
    training = upload_rows(tenant, SFT)
    method = {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}}}
    est = _estimate(tenant, training_file=training, method=method)
    per_epoch = sum(_tokens(stack, row["messages"]) for row in SFT)
    assert est["steps"] == 4 and est["examples"] == 8 and est["method"] == "supervised"
    _exact(est["tokens"]["trained"], 2 * per_epoch)
    for kind in ("evaluated", "sampled", "judged"):
        _exact(est["tokens"][kind], 0)
    price = stack.settings.price_of(BASE)
    assert est["cost"]["expected"] == pytest.approx(2 * per_epoch * price.training_per_million / 1e6)
    assert est["cost"]["low"] <= est["cost"]["expected"] <= est["cost"]["high"]
    assert (
        0
        < est["compute_seconds"]["low"]
        < est["compute_seconds"]["expected"]
        < est["compute_seconds"]["high"]
    )
    assert est["hyperparameters"]["n_epochs"] == 2 and est["hyperparameters"]["learning_rate"] > 0
    assert est["allowed"] is True and est["budget"]["monthly_budget_usd"] is None
    names = {a["name"] for a in est["assumptions"]}
    assert {"token_counts", "examples_trained", "throughput", "prices"} <= names
    # max_steps cuts the second epoch: its examples are the shuffle's, so the range opens around the mean.
    cut = {
        "type": "supervised",
        "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4, "max_steps": 3}},
    }
    est = _estimate(tenant, training_file=training, method=cut)
    trained = est["tokens"]["trained"]
    assert est["steps"] == 3 and trained["expected"] == pytest.approx(per_epoch * 1.5)
    assert per_epoch < trained["low"] <= trained["expected"] <= trained["high"] < 2 * per_epoch


def test_dpo_estimate_counts_both_answers(stack: GatewayServer, tenant: Tenant) -> None:
    method = {"type": "dpo", "dpo": {"hyperparameters": {"n_epochs": 1, "batch_size": 4}}}
    est = _estimate(tenant, training_file=upload_rows(tenant, DPO), method=method)
    expected = sum(
        _tokens(stack, row["input"]["messages"] + row[key])
        for row in DPO
        for key in ("preferred_output", "non_preferred_output")
    )
    assert est["steps"] == 2
    _exact(est["tokens"]["trained"], expected)


def test_reinforcement_estimate_bounds_the_sampled_completions(stack: GatewayServer, tenant: Tenant) -> None:
    hp = {"n_epochs": 1, "batch_size": 2, "num_generations": 4, "max_completion_length": 16}
    method = {"type": "reinforcement", "reinforcement": {"grader": SAYS_YES, "hyperparameters": hp}}
    est = _estimate(tenant, training_file=upload_rows(tenant, RFT), method=method, max_cost=5)
    prompts = sum(_tokens(stack, row["messages"], add_generation_prompt=True) for row in RFT)
    completions = 8 * 4  # every task once, four answers each
    assert est["steps"] == 4 and est["max_cost"] == 5
    assert est["tokens"]["sampled"] == {
        "low": completions,
        "expected": completions * 8,
        "high": completions * 16,
    }
    trained = est["tokens"]["trained"]
    assert trained["expected"] == 4 * prompts + completions * 8
    assert (trained["low"], trained["high"]) == (4 * prompts + completions, 4 * prompts + completions * 16)
    _exact(est["tokens"]["judged"], 0)  # a string check calls no model
    assumed = {a["name"]: a["value"] for a in est["assumptions"]}
    assert assumed["completion_tokens"] == {"low": 1, "expected": 8, "high": 16}
    # No engine serves tiny-chat here: the pilot was refused by the chat route, and says so.
    pilot = assumed["pilot"]
    reason = pilot.pop("reason")
    assert pilot == {
        "ran": False,
        "model": BASE,
        "prompts": 8,
        "completions_per_prompt": 4,
        "temperature": 1.0,
        "max_completion_tokens": 16,
        "seed": PILOT_SEED,
    }
    assert reason.startswith("the chat route answered 503"), reason


TASKS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": f"Say yes{' please' * i} ({i})"}], "answer": "yes"}
    for i in range(12)
]
"""Twelve tasks of growing length: which the pilot picks shows in its prompt tokens."""


def _usage_tokens(gw: GatewayServer, t: Tenant) -> tuple[int, int, int]:
    """Input tokens, output tokens and requests of the organisation's completions (the usage API)."""
    page = httpx.get(
        f"{gw.url}/v1/organization/usage/completions",
        params={"start_time": int(time.time()) - 3600, "bucket_width": "1h"},
        headers={"Authorization": f"Bearer {t.key}"},
    ).json()
    rows = [r for bucket in page["data"] for r in bucket["results"]]
    return (
        sum(r["input_tokens"] for r in rows),
        sum(r["output_tokens"] for r in rows),
        sum(r["num_model_requests"] for r in rows),
    )


def test_reinforcement_estimate_measures_the_completions_with_a_pilot(
    gw: GatewayServer, gw_admin: Any
) -> None:
    _measures_with_a_pilot(gw, gw_admin.tenant("pilot-org"))


@pytest.mark.slow
def test_the_pilot_samples_through_vllm_too(vllm_gw: GatewayServer) -> None:
    """The same pilot where vLLM serves the base model: its usage is vLLM's own count."""
    _measures_with_a_pilot(vllm_gw, admin_of(vllm_gw).tenant("pilot-vllm"))


def test_the_pilot_is_held_to_the_budget(gw: GatewayServer, gw_admin: Any) -> None:
    """An organisation whose budget is spent gets its estimate, with the pilot refused as its own chat would
    be, and no completion sampled for it."""
    t = gw_admin.tenant("pilot-broke")
    resp = gw_admin.http.post(
        f"/v1/admin/organizations/{t.org_id}/billing", json={"monthly_budget_usd": 1e-9}
    )
    assert resp.status_code == 200, resp.text
    method = {"type": "reinforcement", "reinforcement": {"grader": SAYS_YES}}
    est = _estimate(t, training_file=upload_rows(t, TASKS), method=method)
    assert est["allowed"] is False
    pilot = {a["name"]: a for a in est["assumptions"]}["pilot"]
    assert pilot["value"]["ran"] is False
    assert pilot["value"]["reason"].startswith("the chat route answered 429: "), pilot
    assert "budget" in pilot["value"]["reason"], pilot  # the budget's refusal, not a rate limit
    assert pilot["detail"] == f"The pilot that measures completions did not run: {pilot['value']['reason']}"
    time.sleep(1.0)  # the usage buffer's flush (0.3 s): nothing to write
    assert _usage_tokens(gw, t) == (0, 0, 0)


def _measures_with_a_pilot(gw: GatewayServer, t: Tenant) -> None:
    """An estimate of a reinforcement job on `gw`: its pilot ran, priced into the run and metered."""
    hp = {
        "n_epochs": 1,
        "batch_size": 2,
        "num_generations": 4,
        "max_completion_length": 24,
        "temperature": 0.9,
    }
    method = {"type": "reinforcement", "reinforcement": {"grader": SAYS_YES, "hyperparameters": hp}}
    t0 = time.monotonic()
    est = _estimate(t, training_file=upload_rows(t, TASKS), method=method, seed=11)
    took = time.monotonic() - t0
    assumed = {a["name"]: a for a in est["assumptions"]}
    pilot = assumed["pilot"]["value"]
    measured = pilot.pop("completion_tokens")
    usage, cost_usd, seconds = pilot.pop("usage"), pilot.pop("cost_usd"), pilot.pop("seconds")
    assert pilot == {
        "ran": True,
        "model": BASE,
        "prompts": 8,  # of the file's twelve, spread over it
        "completions_per_prompt": 4,  # num_generations
        "temperature": 0.9,
        "max_completion_tokens": 24,
        "seed": 11,  # the create's
        "completions": 32,
        "truncated": pilot["truncated"],
    }
    assert 0 <= pilot["truncated"] <= 32 and 0 < seconds < took < 30
    # The expected length is the engine's own count over the completions; its spread bounds the range.
    mean = usage["completion_tokens"] / 32
    assert measured["mean"] == round(mean, 3)
    assert 1 <= measured["min"] <= measured["median"] <= measured["max"] <= 24
    completion = assumed["completion_tokens"]["value"]
    assert completion["expected"] == round(mean, 3)
    assert (
        measured["min"]
        <= completion["low"]
        <= completion["expected"]
        <= completion["high"]
        <= measured["max"]
    )
    assert "pilot measured" in assumed["completion_tokens"]["detail"]
    # Priced into the run: every task once, four completions each, each trained with its prompt.
    prompts = sum(_tokens(gw, row["messages"], add_generation_prompt=True) for row in TASKS)
    completions = 12 * 4
    sampled = est["tokens"]["sampled"]
    assert sampled == {k: pytest.approx(completions * completion[k]) for k in ("low", "expected", "high")}
    trained = est["tokens"]["trained"]
    assert trained["expected"] == pytest.approx(4 * prompts + completions * completion["expected"])
    price = gw.settings.price_of(BASE)
    expected_usd = round(trained["expected"]) * price.training_per_million / 1e6
    assert est["cost"]["expected"] == pytest.approx(expected_usd, abs=1e-6)
    # The pilot is the organisation's own metered completions: the usage API counts exactly its tokens.
    picked = [row["messages"] for i, row in enumerate(TASKS) if i in (0, 2, 3, 5, 6, 8, 9, 11)]
    prompted = sum(_tokens(gw, m, add_generation_prompt=True) for m in picked)
    assert usage["prompt_tokens"] == prompted, (usage, prompted)
    deadline = time.monotonic() + 15
    while (found := _usage_tokens(gw, t)) != (usage["prompt_tokens"], usage["completion_tokens"], 8):
        assert time.monotonic() < deadline, (found, usage)
        time.sleep(0.3)
    assert cost_usd == pytest.approx(
        (
            usage["prompt_tokens"] * price.input_per_million
            + usage["completion_tokens"] * price.output_per_million
        )
        / 1e6,
        abs=1e-6,
    )


def test_estimate_refuses_what_a_create_refuses(
    stack: GatewayServer, tenant: Tenant, other_tenant: Tenant
) -> None:
    training = upload_rows(tenant, SFT)
    theirs = upload_rows(other_tenant, SFT)
    bad_bodies: list[tuple[dict[str, Any], str]] = [
        ({"training_file": training, "max_cost": -1}, "max_cost"),
        ({"training_file": training, "max_cost": 0}, "max_cost"),
        ({"training_file": training, "max_cost": 1e7}, "max_cost"),
        ({"training_file": training, "max_cost": "5"}, "max_cost"),
        ({"training_file": training, "hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        (
            {
                "training_file": training,
                "method": {"type": "supervised", "supervised": {"hyperparameters": {"x": 1}}},
            },
            "method.supervised.hyperparameters.x",
        ),
        ({"training_file": theirs}, "training_file"),  # another organisation's file is none of this one's
        ({"training_file": training, "model": "no-such-model"}, "model"),
    ]
    for body, param in bad_bodies:
        full = {"model": BASE, **body}
        status, error = _refusal(lambda b=full: tenant.client.post(ESTIMATE, body=b, cast_to=object))
        assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", error
        assert set(error) == {"message", "type", "param", "code"}
        created = _refusal(lambda b=full: tenant.client.post("/fine_tuning/jobs", body=b, cast_to=object))
        assert created == (status, error), body
    # Numbers JSON has no spelling for are refused before any field is read.
    with httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {tenant.key}"}) as http:
        for raw in ("NaN", "Infinity", "-Infinity"):
            content = f'{{"model": "{BASE}", "training_file": "{training}", "max_cost": {raw}}}'
            resp = http.post("/v1" + ESTIMATE, content=content, headers={"content-type": "application/json"})
            assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_cost", resp.text
    assert tenant.client.fine_tuning.jobs.list().data == []  # nothing was made


def test_estimate_reports_the_budget_check(stack: GatewayServer, admin: Any, tenant: Tenant) -> None:
    resp = admin.http.post(
        f"/v1/admin/organizations/{tenant.org_id}/billing", json={"monthly_budget_usd": 1e-9}
    )
    assert resp.status_code == 200, resp.text
    training = upload_rows(tenant, SFT)
    est = _estimate(tenant, training_file=training)
    assert est["allowed"] is False and "budget" in est["refusal"]
    assert est["budget"]["monthly_budget_usd"] == 1e-9 and est["budget"]["left_usd"] is not None
    status, error = _refusal(
        lambda: tenant.client.fine_tuning.jobs.create(model=BASE, training_file=training)
    )
    assert status == 429 and error["message"] == est["refusal"]


def test_a_queued_job_shows_its_projected_cost(tenant: Tenant) -> None:
    job = tenant.client.fine_tuning.jobs.create(
        model=BASE, training_file=upload_rows(tenant, SFT), suffix="cost", extra_body={"max_cost": 2.5}
    )
    seen = tenant.client.fine_tuning.jobs.retrieve(job.id).model_extra or {}
    assert seen["max_cost"] == 2.5 and seen["cost"]["accrued"] == 0
    assert seen["cost"]["projected_total"] > 0  # the estimate made when it was queued, shown as such
    assert seen["estimated_cost"] == seen["cost"]["projected_total"]
    listed = [j for j in tenant.client.fine_tuning.jobs.list() if j.id == job.id]
    assert (listed[0].model_extra or {})["cost"] == seen["cost"]
    assert tenant.client.fine_tuning.jobs.cancel(job.id).status == "cancelled"


@pytest.mark.slow
def test_max_cost_pauses_at_its_step_bills_to_it_and_resumes(
    stack: GatewayServer, cost_worker: WorkerProcess, tenant: Tenant
) -> None:
    jobs = tenant.client.fine_tuning.jobs
    training = upload_rows(tenant, SFT)
    hp = {"n_epochs": 50, "batch_size": 1, "max_steps": 400, "checkpoint_every": 1000}
    method: Any = {"type": "supervised", "supervised": {"hyperparameters": hp}}
    # About four and a half steps' worth, from the file's own estimate (one example a step).
    est = _estimate(tenant, training_file=training, method=method)
    limit = round(est["cost"]["expected"] / est["steps"] * 4.5, 9)
    job = jobs.create(model=BASE, training_file=training, method=method, extra_body={"max_cost": limit})
    paused = wait_for(tenant, job.id, ("paused", "succeeded", "failed", "cancelled"), timeout=90)
    assert paused.status == "paused", paused.error
    # Paused, its cost shows what it spent: the attempt's progress until its usage row is recorded, then that
    assert (paused.model_extra or {})["cost"]["accrued"] >= limit
    wait_trainer_gone(job.id)
    events = [e for e in all_events(tenant, job.id) if e.message.startswith(MAX_COST_PAUSED)]
    assert len(events) == 1 and events[0].level == "warn"
    data = events[0].data or {}
    assert data["reason"] == "max_cost" and data["max_cost"] == limit and data["accrued"] >= limit
    crossed = data["step"]
    assert 3 <= crossed <= 7, data  # the step whose cost reached it, give or take the examples' lengths
    ckpts = jobs.checkpoints.list(job.id).data
    # The trainer is stopped at the step's event and checkpoints at the end of the step it is in.
    assert len(ckpts) == 1 and crossed <= ckpts[0].step_number <= crossed + 3
    # Billed to the crossing step only (written when the worker lets the paused job go).
    deadline = time.monotonic() + 15
    while not ((jobs.retrieve(job.id).model_extra or {}).get("usage") or {}).get("trained_tokens"):
        assert time.monotonic() < deadline, "the paused attempt's usage was not recorded"
        time.sleep(0.2)
    extra = jobs.retrieve(job.id).model_extra or {}
    assert extra["usage"]["cost_usd"] == pytest.approx(data["accrued"], abs=1e-6)
    assert extra["cost"]["accrued"] == pytest.approx(data["accrued"], abs=1e-6)
    assert extra["cost"]["projected_total"] > extra["cost"]["accrued"]  # 400 steps, a few done

    # Resuming is the user's choice: the job goes on past its max_cost from its checkpoint.
    saved = ckpts[0].step_number
    assert jobs.resume(job.id).status == "queued"
    deadline = time.monotonic() + 60
    while max(metrics_steps(tenant, job.id)) <= saved:  # its first step checks max_cost: passed already
        assert time.monotonic() < deadline, "the resumed job did not progress"
        assert jobs.retrieve(job.id).status in ("queued", "running")
        time.sleep(0.3)
    running = jobs.retrieve(job.id).model_extra or {}
    assert running["cost"]["accrued"] > data["accrued"]  # the running attempt's progress counts live
    assert jobs.retrieve(job.id).status == "running"
    assert jobs.cancel(job.id).status == "cancelled"  # the worker's teardown waits for its trainer

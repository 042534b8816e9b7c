"""OpenAI's Evals API through the official SDK: evals, runs executed by a real worker that samples the tiny
model through the gateway (with a key minted for the run), output items, grading that agrees with a direct
`envsdk.graders.grade`, tenancy, usage, rate limits, cancel, the 400s of bad requests, and run creates
and workers that read their items file a line at a time.

The module has a database, a gateway (serving `tiny-chat` from the module's engine) and a worker of its
own, so no other module's worker claims its runs.
"""

from __future__ import annotations

import json
import secrets
import signal
import time
import tracemalloc
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from envsdk.graders import grade, make_sample
from gateway.blobstore import BlobStore
from gateway.db import create_pool
from gateway.evals import store as evals_store
from gateway.evals.datasource import pass_threshold
from gateway.evals.rows import RunRow
from gateway.worker.context import JobContext
from gateway.worker.eval_items import ITEMS_READ_AHEAD, PendingItems
from tests.support.data import BASE
from tests.support.engine import make_lora_adapter, register_model
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.stack import Admin, GatewayServer, Tenant, WorkerProcess
from tunegate.quickstart import QUESTION_ITEMS

QUESTIONS = [{"question": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 5)]
CONFIG: Any = QUESTION_ITEMS  # items of a question and its answer, as the quickstart's held-out eval has
EXACT: Any = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}
CONTAINS: Any = {
    "type": "string_check",
    "name": "has a digit 2",
    "input": "{{ sample.output_text }}",
    "reference": "2",
    "operation": "like",
}
FUZZY: Any = {
    "type": "text_similarity",
    "name": "fuzzy",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "evaluation_metric": "fuzzy_match",
    "pass_threshold": 0.1,
}
LENGTH: Any = {
    "type": "python",
    "name": "short",
    "source": "def grade(sample, item):\n    return 1.0 if len(sample['output_text']) < 40 else 0.25\n",
    "pass_threshold": 0.5,
}
BLEND: Any = {
    "type": "multi",
    "name": "blend",
    "graders": {
        "exact": {**EXACT, "name": "exact"},
        "fuzzy": {k: v for k, v in FUZZY.items() if k != "pass_threshold"},
    },
    "calculate_output": "0.5 * exact + 0.5 * fuzzy",
}
TEMPLATE: Any = {
    "type": "template",
    "template": [
        {"role": "system", "content": "Answer with the number only."},
        {"role": "user", "content": "{{ item.question }}"},
    ],
}
SAMPLING: Any = {"temperature": 0, "max_completion_tokens": 6, "seed": 7}
FINAL = ("completed", "failed", "canceled")


WORKER_ENV = {
    "TUNEGATE_REQUEUE_INTERVAL_S": "2",
    "TUNEGATE_HEARTBEAT_INTERVAL_S": "0.5",
    "TUNEGATE_STALE_AFTER_S": "4",
}


gw = gateway_fixture("evals", own_database=True, usage_flush_interval_s=0.3, auth_cache_ttl_s=1.0)
worker = worker_fixture(autouse=True, **WORKER_ENV)


@pytest.fixture
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("evals-" + secrets.token_hex(3))


@pytest.fixture
def other(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("evals-other-" + secrets.token_hex(3))


def _eval(t: Tenant, criteria: list[Any], **kwargs: Any) -> Any:
    return t.client.evals.create(
        name=kwargs.pop("name", "arithmetic"), data_source_config=CONFIG, testing_criteria=criteria, **kwargs
    )


def _items_file(t: Tenant, rows: list[dict[str, Any]], purpose: Any = "evals") -> str:
    data = "\n".join(json.dumps(r) for r in rows).encode()
    return t.client.files.create(file=("items.jsonl", data), purpose=purpose).id


def _completions(model: str, source: Any, **kwargs: Any) -> Any:
    return {
        "type": "completions",
        "model": model,
        "source": source,
        "input_messages": kwargs.pop("input_messages", TEMPLATE),
        "sampling_params": kwargs.pop("sampling_params", SAMPLING),
        **kwargs,
    }


def _content(items: list[dict[str, Any]]) -> Any:
    return {"type": "file_content", "content": [{"item": i} for i in items]}


def _wait(t: Tenant, eval_id: str, run_id: str, states: tuple[str, ...] = FINAL, timeout: float = 240) -> Any:
    deadline = time.monotonic() + timeout
    while (run := t.client.evals.runs.retrieve(run_id, eval_id=eval_id)).status not in states:
        assert time.monotonic() < deadline, f"run {run_id} stuck in {run.status}"
        time.sleep(0.3)
    return run


def _items(t: Tenant, eval_id: str, run_id: str) -> list[Any]:
    return list(t.client.evals.runs.output_items.list(run_id, eval_id=eval_id, limit=2))  # pages of 2


def _run_key(admin: Admin, t: Tenant, run_id: str) -> dict[str, Any]:
    keys = admin.http.get(f"/v1/admin/organizations/{t.org_id}/api_keys", params={"kind": "eval"}).json()
    (key,) = [k for k in keys["data"] if k["name"] == f"eval run {run_id}"]
    return key


def _wait_key_revoked(admin: Admin, t: Tenant, run_id: str, timeout: float = 60) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while (key := _run_key(admin, t, run_id))["revoked_at"] is None:
        assert time.monotonic() < deadline, "the run's key was not revoked"
        time.sleep(0.2)
    return key


# ------------------------------------------------------------------------------------------------ evals
def test_eval_create_retrieve_list_update_delete(org: Tenant) -> None:
    made = _eval(org, [EXACT, FUZZY, LENGTH], metadata={"suite": "arith"})
    assert made.object == "eval" and made.id.startswith("eval_") and made.name == "arithmetic"
    assert made.metadata == {"suite": "arith"} and isinstance(made.created_at, int)
    assert made.data_source_config.type == "custom"
    schema = made.data_source_config.schema_
    assert schema["properties"]["item"] == CONFIG["item_schema"]  # type: ignore[index]
    assert "output_text" in schema["properties"]["sample"]["properties"]  # type: ignore[index]
    assert [c.name for c in made.testing_criteria] == ["exact", "fuzzy", "short"]
    assert [c.type for c in made.testing_criteria] == ["string_check", "text_similarity", "python"]
    assert made.testing_criteria[1].pass_threshold == 0.1  # type: ignore[union-attr]
    assert org.client.evals.retrieve(made.id).to_dict() == made.to_dict()

    second = _eval(org, [CONTAINS], name="second")
    nameless = {k: v for k, v in CONTAINS.items() if k != "name"}
    unnamed = org.client.evals.create(data_source_config=CONFIG, testing_criteria=[nameless])
    assert unnamed.testing_criteria[0].name == "string_check"
    listed = list(org.client.evals.list(limit=1))  # one per page: the SDK follows `after`
    assert [e.id for e in listed] == [made.id, second.id, unnamed.id]
    newest = org.client.evals.list(order="desc", limit=2)
    assert [e.id for e in newest.data] == [unnamed.id, second.id] and newest.has_more

    updated = org.client.evals.update(made.id, name="renamed", metadata={"suite": "v2"})
    assert updated.name == "renamed" and updated.metadata == {"suite": "v2"}
    assert updated.to_dict()["testing_criteria"] == made.to_dict()["testing_criteria"]
    by_update = org.client.evals.list(order_by="updated_at", order="desc", limit=1).data
    assert [e.id for e in by_update] == [made.id]

    deleted = org.client.evals.delete(second.id)
    assert deleted.deleted is True and deleted.eval_id == second.id and deleted.object == "eval.deleted"
    with pytest.raises(openai.NotFoundError):
        org.client.evals.retrieve(second.id)


# ------------------------------------------------------------------------------------------------- runs
def test_run_samples_through_the_gateway_and_grading_agrees(gw_admin: Admin, org: Tenant) -> None:
    criteria = [EXACT, CONTAINS, FUZZY, LENGTH, BLEND]
    ev = _eval(org, criteria)
    file_id = _items_file(org, [{"item": q} for q in QUESTIONS])
    run = org.client.evals.runs.create(
        ev.id,
        name="base",
        metadata={"try": "1"},
        data_source=_completions(BASE, {"type": "file_id", "id": file_id}),
    )
    assert run.object == "eval.run" and run.id.startswith("evalrun_") and run.eval_id == ev.id
    assert run.status in ("queued", "in_progress") and run.model == BASE and run.name == "base"
    assert run.data_source.type == "completions" and run.metadata == {"try": "1"}
    assert run.result_counts.total == 0 and run.error is None

    done = _wait(org, ev.id, run.id)
    assert done.status == "completed", done.error
    counts = done.result_counts
    assert counts.total == len(QUESTIONS) == counts.passed + counts.failed + counts.errored
    assert counts.errored == 0
    assert done.report_url == f"/v1/evals/{ev.id}/runs/{run.id}/output_items"

    items = _items(org, ev.id, run.id)
    assert [i.datasource_item_id for i in items] == list(range(len(QUESTIONS)))
    regraded: dict[str, list[bool]] = {c["name"]: [] for c in criteria}
    completion_tokens = prompt_tokens = 0
    for item in items:
        assert item.object == "eval.run.output_item" and item.run_id == run.id and item.eval_id == ev.id
        assert item.datasource_item == QUESTIONS[item.datasource_item_id]
        sample = item.sample
        assert sample.error is None and sample.model == BASE and sample.finish_reason in ("stop", "length")
        assert [(m.role, m.content) for m in sample.input] == [
            ("system", "Answer with the number only."),
            ("user", QUESTIONS[item.datasource_item_id]["question"]),
        ]
        assert len(sample.output) == 1 and sample.output[0].role == "assistant"
        assert (
            0 < sample.usage.completion_tokens <= 6 and sample.usage.total_tokens > sample.usage.prompt_tokens
        )
        assert (sample.temperature, sample.max_completion_tokens, sample.seed) == (0, 6, 7)
        completion_tokens += sample.usage.completion_tokens
        prompt_tokens += sample.usage.prompt_tokens
        # The same grading, done here: same scores, same verdicts.
        text = sample.output[0].content or ""
        assert [r.name for r in item.results] == [c["name"] for c in criteria]
        for criterion, result in zip(criteria, item.results, strict=True):
            direct = grade(criterion, make_sample(text), item.datasource_item)
            assert not direct.failed and result.score == pytest.approx(direct.reward)
            assert result.passed == (direct.reward >= pass_threshold(criterion))
            regraded[criterion["name"]].append(result.passed)
        assert item.status == ("pass" if all(r.passed for r in item.results) else "fail")
        one = org.client.evals.runs.output_items.retrieve(item.id, eval_id=ev.id, run_id=run.id)
        assert one.to_dict() == item.to_dict()

    assert counts.passed == sum(all(v[i] for v in regraded.values()) for i in range(len(QUESTIONS)))
    per = {r.testing_criteria: (r.passed, r.failed) for r in done.per_testing_criteria_results}
    assert per == {name: (sum(v), len(v) - sum(v)) for name, v in regraded.items()}
    (usage,) = done.per_model_usage
    assert usage.run_model_name == BASE and usage.invocation_count == len(QUESTIONS)
    assert (usage.completion_tokens, usage.prompt_tokens) == (completion_tokens, prompt_tokens)
    passing = list(org.client.evals.runs.output_items.list(run.id, eval_id=ev.id, status="pass"))
    assert len(passing) == counts.passed and all(i.status == "pass" for i in passing)

    # The worker's key for the run: minted for this organisation, revoked once the run ended.
    key = _wait_key_revoked(gw_admin, org, run.id)
    assert key["kind"] == "eval" and key["organization_id"] == org.org_id


def test_runs_list_delete_and_jsonl_items_with_their_own_samples(org: Tenant) -> None:
    ev = _eval(org, [EXACT, CONTAINS])
    answers = ["2", "42", "6", "eight"]
    content = [{"item": q, "sample": {"output_text": a}} for q, a in zip(QUESTIONS, answers, strict=True)]
    run = org.client.evals.runs.create(
        ev.id, data_source={"type": "jsonl", "source": {"type": "file_content", "content": content}}
    )
    done = _wait(org, ev.id, run.id)
    assert done.status == "completed" and done.per_model_usage == []
    # exact: items 0 and 2 ("2" == "2", "6" == "6"); contains "2": items 0 and 1.
    assert [(r.testing_criteria, r.passed, r.failed) for r in done.per_testing_criteria_results] == [
        ("exact", 2, 2),
        ("has a digit 2", 2, 2),
    ]
    assert (done.result_counts.passed, done.result_counts.failed, done.result_counts.errored) == (1, 3, 0)
    items = _items(org, ev.id, run.id)
    assert [i.status for i in items] == ["pass", "fail", "fail", "fail"]
    assert [i.sample.output[0].content for i in items] == answers

    second = org.client.evals.runs.create(ev.id, name="again", data_source=done.data_source.to_dict())  # type: ignore[arg-type]
    _wait(org, ev.id, second.id)
    assert [r.id for r in org.client.evals.runs.list(ev.id, limit=1)] == [run.id, second.id]
    assert [r.id for r in org.client.evals.runs.list(ev.id, order="desc").data] == [second.id, run.id]
    assert [r.id for r in org.client.evals.runs.list(ev.id, status="completed").data] == [run.id, second.id]
    assert org.client.evals.runs.list(ev.id, status="canceled").data == []
    deleted = org.client.evals.runs.delete(second.id, eval_id=ev.id)
    assert deleted.deleted is True and deleted.run_id == second.id
    assert [r.id for r in org.client.evals.runs.list(ev.id).data] == [run.id]
    with pytest.raises(openai.NotFoundError):
        org.client.evals.runs.retrieve(second.id, eval_id=ev.id)


def test_fine_tuned_models_checkpoints_and_item_references(
    org: Tenant, gw: GatewayServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A fine-tuned model and one of its checkpoints are evaluated like a base model; a fine-tuning file's
    rows (bare items) feed the run, their `messages` referenced as they are."""
    adapter = str(make_lora_adapter(tiny_model_dir, tmp_path / "lora", seed=11))
    ft = f"ft:{BASE}:{org.org_id}:evals:ftjob-{secrets.token_hex(6)}"
    register_model(gw.settings.database_url or "", org.org_id, ft, adapter, checkpoint=f"{ft}:ckpt-step-2")
    rows = [{"messages": [{"role": "user", "content": q["question"]}], **q} for q in QUESTIONS[:2]]
    file_id = _items_file(org, rows, purpose="fine-tune")
    ev = _eval(org, [CONTAINS])
    runs = [
        org.client.evals.runs.create(
            ev.id,
            data_source=_completions(
                model,
                {"type": "file_id", "id": file_id},
                input_messages={"type": "item_reference", "item_reference": "item.messages"},
            ),
        )
        for model in (ft, f"{ft}:ckpt-step-2")
    ]
    for run in runs:
        done = _wait(org, ev.id, run.id)
        assert done.status == "completed", done.error
        assert done.result_counts.total == 2 and done.result_counts.errored == 0
        items = _items(org, ev.id, run.id)
        assert all(i.sample.model == run.model for i in items)
        assert [i.sample.input[0].content for i in items] == [q["question"] for q in QUESTIONS[:2]]


def test_model_graders_call_the_gateway_with_the_run_key(org: Tenant) -> None:
    judge: Any = {
        "type": "score_model",
        "name": "judge",
        "model": BASE,
        "input": [
            {"role": "user", "content": "Score 0 to 1: {{ item.question }} -> {{ sample.output_text }}"}
        ],
        "sampling_params": {"max_completion_tokens": 4, "temperature": 0},
    }
    labeler: Any = {
        "type": "label_model",
        "name": "labeler",
        "model": BASE,
        "input": [{"role": "user", "content": "Is {{ sample.output_text }} right? Say yes or no."}],
        "labels": ["yes", "no"],
        "passing_labels": ["yes"],
    }
    ev = _eval(org, [judge, labeler, CONTAINS])
    run = org.client.evals.runs.create(ev.id, data_source=_completions(BASE, _content(QUESTIONS[:2])))
    done = _wait(org, ev.id, run.id)
    # Whether the tiny model's verdicts parse is up to it; its calls are counted either way.
    assert done.status in ("completed", "failed")
    (usage,) = done.per_model_usage
    assert usage.run_model_name == BASE and usage.invocation_count == 6  # two samples, four verdicts
    for item in _items(org, ev.id, run.id):
        verdicts = item.results[:2]
        assert [v.name for v in verdicts] == ["judge", "labeler"] and item.sample.error is None
        for verdict in verdicts:
            if "error" in verdict.to_dict():  # a reply that names no score or label: the item errored
                assert item.status == "error" and not verdict.passed
                assert verdict.to_dict()["error"]["code"] == "model_grader_parse_error"


# ------------------------------------------------------------------------------------------- tenancy
def test_another_organisation_sees_nothing(org: Tenant, other: Tenant, gw: GatewayServer) -> None:
    ev = _eval(org, [CONTAINS])
    run = org.client.evals.runs.create(ev.id, data_source=_completions(BASE, _content(QUESTIONS[:1])))
    _wait(org, ev.id, run.id)
    (item,) = _items(org, ev.id, run.id)
    theirs = other.client.evals
    calls: list[Any] = [
        lambda: theirs.retrieve(ev.id),
        lambda: theirs.update(ev.id, name="mine now"),
        lambda: theirs.delete(ev.id),
        lambda: theirs.runs.create(ev.id, data_source=_completions(BASE, _content(QUESTIONS[:1]))),
        lambda: theirs.runs.list(ev.id),
        lambda: theirs.runs.retrieve(run.id, eval_id=ev.id),
        lambda: theirs.runs.cancel(run.id, eval_id=ev.id),
        lambda: theirs.runs.delete(run.id, eval_id=ev.id),
        lambda: theirs.runs.output_items.list(run.id, eval_id=ev.id),
        lambda: theirs.runs.output_items.retrieve(item.id, eval_id=ev.id, run_id=run.id),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError):
            call()
    assert theirs.list().data == []
    # The owner's objects are untouched.
    assert org.client.evals.retrieve(ev.id).name == "arithmetic"
    assert org.client.evals.runs.retrieve(run.id, eval_id=ev.id).status == "completed"


def test_a_run_on_another_organisations_model_errors_every_item(
    org: Tenant, other: Tenant, gw: GatewayServer, tiny_model_dir: Path, tmp_path: Path
) -> None:
    adapter = str(make_lora_adapter(tiny_model_dir, tmp_path / "lora", seed=12))
    ft = f"ft:{BASE}:{org.org_id}:private:ftjob-{secrets.token_hex(6)}"
    register_model(gw.settings.database_url or "", org.org_id, ft, adapter)
    ev = _eval(other, [CONTAINS])
    run = other.client.evals.runs.create(ev.id, data_source=_completions(ft, _content(QUESTIONS[:2])))
    done = _wait(other, ev.id, run.id)
    assert done.status == "failed" and done.error is not None
    assert done.error.code == "model_not_found" and ft in done.error.message
    assert done.result_counts.errored == done.result_counts.total == 2 and done.per_model_usage == []
    for item in _items(other, ev.id, run.id):
        assert item.status == "error" and item.results == [] and item.sample.output == []
        assert item.sample.error.code == "model_not_found"
        assert item.sample.error.message == f"No model found with id '{ft}'."
        assert item.sample.usage.total_tokens == 0


# ------------------------------------------------------------------------------------- usage, limits
def test_run_usage_is_metered_under_its_key_and_counts_against_rate_limits(
    gw: GatewayServer, gw_admin: Admin, org: Tenant
) -> None:
    start = int(time.time()) - 5
    ev = _eval(org, [CONTAINS])
    run = org.client.evals.runs.create(ev.id, data_source=_completions(BASE, _content(QUESTIONS[:3])))
    done = _wait(org, ev.id, run.id)
    assert done.status == "completed"
    key = _run_key(gw_admin, org, run.id)
    (usage,) = done.per_model_usage

    def usage_by_key() -> dict[str, Any]:
        page = httpx.get(
            f"{gw.url}/v1/organization/usage/completions",
            params={"start_time": start, "bucket_width": "1d", "group_by": "api_key_id"},
            headers={"Authorization": f"Bearer {org.key}"},
        ).json()
        return {r["api_key_id"]: r for b in page["data"] for r in b["results"]}

    deadline = time.monotonic() + 30
    while key["id"] not in (found := usage_by_key()):
        assert time.monotonic() < deadline, "the run's usage was not recorded"
        time.sleep(0.3)
    metered = found[key["id"]]
    assert metered["num_model_requests"] == 3
    assert (metered["input_tokens"], metered["output_tokens"]) == (
        usage.prompt_tokens,
        usage.completion_tokens,
    )

    # One request a minute for the organisation: the run's first completion takes it, the others are
    # refused by the gateway's limiter (a wait of a minute is longer than a run waits out).
    limited = gw_admin.http.post(
        f"/v1/admin/organizations/{org.org_id}/limits", json={"max_requests_per_1_minute": 1}
    )
    limited.raise_for_status()
    run = org.client.evals.runs.create(ev.id, data_source=_completions(BASE, _content(QUESTIONS[:3])))
    done = _wait(org, ev.id, run.id)
    assert done.status == "completed"
    assert (done.result_counts.total, done.result_counts.errored) == (3, 2)
    errors = [i.sample.error for i in _items(org, ev.id, run.id) if i.status == "error"]
    assert [e.code for e in errors] == ["rate_limit_exceeded"] * 2
    with pytest.raises(openai.RateLimitError):  # the person's own requests share the bucket
        org.client.chat.completions.create(model=BASE, messages=[{"role": "user", "content": "hi"}])


# ----------------------------------------------------------------------------------------------- cancel
def test_cancel_stops_a_run_between_items(gw_admin: Admin, org: Tenant) -> None:
    many = [{"question": f"Count from {i} to {i + 20}.", "answer": "x"} for i in range(200)]
    ev = _eval(org, [CONTAINS])
    run = org.client.evals.runs.create(
        ev.id,
        data_source=_completions(BASE, _content(many), sampling_params={"max_completion_tokens": 24}),
    )
    deadline = time.monotonic() + 120
    while not org.client.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=1).data:
        assert time.monotonic() < deadline, "the run made no item"
        time.sleep(0.2)
    canceled = org.client.evals.runs.cancel(run.id, eval_id=ev.id)
    assert canceled.status == "canceled"
    at_cancel = len(_items(org, ev.id, run.id))
    _wait_key_revoked(gw_admin, org, run.id)  # the worker let the run go
    graded = _items(org, ev.id, run.id)
    assert len(graded) == at_cancel < len(many)  # no item is recorded once the cancel returned
    final = org.client.evals.runs.retrieve(run.id, eval_id=ev.id)
    assert final.status == "canceled" and final.result_counts.total == len(graded)
    with pytest.raises(openai.BadRequestError) as err:
        org.client.evals.runs.cancel(run.id, eval_id=ev.id)
    assert err.value.code == "invalid_state"
    # OpenAI's REST path for cancel answers the same.
    again = httpx.post(
        f"{gw_admin.gateway_url}/v1/evals/{ev.id}/runs/{run.id}",
        headers={"Authorization": f"Bearer {org.key}"},
    )
    assert again.status_code == 400 and again.json()["error"]["code"] == "invalid_state"


# -------------------------------------------------------------------------------------------- workers
def test_a_run_whose_worker_dies_resumes_elsewhere(
    gw: GatewayServer, worker: WorkerProcess, gw_admin: Admin, org: Tenant, tmp_path: Path
) -> None:
    """A second worker takes the run while the module's worker is stopped, and is SIGKILLed mid-run: the
    reaper revokes its key and re-queues the run, which resumes with the items it lacks."""
    many = [{"question": f"What is {i} times 3?", "answer": str(3 * i)} for i in range(60)]
    ev = _eval(org, [CONTAINS])
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        victim = WorkerProcess(gw.settings, tmp_path / "victim.log", **WORKER_ENV)
        run = org.client.evals.runs.create(
            ev.id,
            data_source=_completions(BASE, _content(many), sampling_params={"max_completion_tokens": 8}),
        )
        deadline = time.monotonic() + 120
        while not org.client.evals.runs.output_items.list(run.id, eval_id=ev.id, limit=1).data:
            assert time.monotonic() < deadline, "the run made no item"
            time.sleep(0.1)
        victim.kill()
        victim.stop()
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    first_key = _run_key(gw_admin, org, run.id)
    done = _wait(org, ev.id, run.id)
    assert done.status == "completed" and done.result_counts.total == len(many)
    items = _items(org, ev.id, run.id)
    assert [i.datasource_item_id for i in items] == list(range(len(many)))  # each item once
    keys = gw_admin.http.get(f"/v1/admin/organizations/{org.org_id}/api_keys", params={"kind": "eval"}).json()
    run_keys = [k for k in keys["data"] if k["name"] == f"eval run {run.id}"]
    assert len(run_keys) == 2 and first_key["id"] in [k["id"] for k in run_keys]
    deadline = time.monotonic() + 30
    while any(k["revoked_at"] is None for k in run_keys):  # the dead worker's, and the one that finished
        assert time.monotonic() < deadline, run_keys
        time.sleep(0.2)
        keys = gw_admin.http.get(f"/v1/admin/organizations/{org.org_id}/api_keys", params={"kind": "eval"})
        run_keys = [k for k in keys.json()["data"] if k["name"] == f"eval run {run.id}"]


# ------------------------------------------------------------------------------------------------- 400s
def _bad(call: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as err:
        call()
    body = err.value.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}
    assert err.value.status_code == 400 and body["type"] == "invalid_request_error"
    return err.value


def test_bad_requests_are_400s_naming_the_field(org: Tenant, other: Tenant) -> None:
    evals = org.client.evals
    cases: list[tuple[Any, str]] = [
        (dict(testing_criteria=[{**EXACT, "operation": "zz"}]), "testing_criteria[0].operation"),
        (
            dict(testing_criteria=[CONTAINS, {**FUZZY, "evaluation_metric": "cosine"}]),
            "testing_criteria[1].evaluation_metric",
        ),
        (dict(testing_criteria=[{**FUZZY, "pass_threshold": None}]), "testing_criteria[0].pass_threshold"),
        (dict(testing_criteria=[{**LENGTH, "source": "x = 1"}]), "testing_criteria[0].source"),
        (dict(testing_criteria=[CONTAINS, CONTAINS]), "testing_criteria[1].name"),
        (dict(testing_criteria=[]), "testing_criteria"),
        (dict(testing_criteria=[CONTAINS], data_source_config={"type": "logs"}), "data_source_config.type"),
        (dict(testing_criteria=[CONTAINS], metadata={"k": "v" * 600}), "metadata"),
    ]
    for kwargs, param in cases:
        kwargs.setdefault("data_source_config", CONFIG)
        assert _bad(lambda kwargs=kwargs: evals.create(**kwargs)).param == param

    ev = _eval(org, [CONTAINS])
    wrong_purpose = org.client.files.create(file=("x.txt", b"hello"), purpose="user_data").id
    missing = _items_file(org, [{"item": QUESTIONS[0]}]).replace("file-", "file-missing")
    theirs = _items_file(other, [{"item": QUESTIONS[0]}])
    no_answer = _items_file(org, [{"item": {"question": "What?"}}])
    # A good first item: the items are checked in file order as they are read, and line 2 is not JSON.
    first = json.dumps({"item": QUESTIONS[0]}).encode()
    not_json = org.client.files.create(file=("items.jsonl", first + b"\nnope\n"), purpose="evals").id
    template = {"type": "template", "template": [{"role": "user", "content": "{{ item.missing }}"}]}
    unknown = {"type": "template", "template": [{"role": "user", "content": "{{ sample.output_text }}"}]}
    one = _content(QUESTIONS[:1])
    runs: list[tuple[Any, str, str | None]] = [
        (_completions(BASE, {"type": "file_id", "id": missing}), "data_source.source.id", "invalid_file"),
        (_completions(BASE, {"type": "file_id", "id": theirs}), "data_source.source.id", "invalid_file"),
        (
            _completions(BASE, {"type": "file_id", "id": wrong_purpose}),
            "data_source.source.id",
            "invalid_file_purpose",
        ),
        (_completions(BASE, {"type": "file_id", "id": no_answer}), "data_source.source.id", "invalid_item"),
        (_completions(BASE, {"type": "file_id", "id": not_json}), "data_source.source.id", "invalid_file"),
        (
            _completions(BASE, one, input_messages=template),
            "data_source.input_messages.template[0].content",
            "invalid_template",
        ),
        (
            _completions(BASE, one, input_messages=unknown),
            "data_source.input_messages.template[0].content",
            "invalid_template",
        ),
        (
            _completions(
                BASE, one, input_messages={"type": "item_reference", "item_reference": "item.question"}
            ),
            "data_source.input_messages.item_reference",
            "invalid_template",
        ),
        (
            _completions(BASE, one, sampling_params={"temperature": 9}),
            "data_source.sampling_params.temperature",
            None,
        ),
        (
            _completions(BASE, one, sampling_params={"best_of": 2}),
            "data_source.sampling_params.best_of",
            None,
        ),
        (_completions("", one), "data_source.model", None),
        ({"type": "responses", "source": one}, "data_source.type", "unsupported_data_source"),
        ({"type": "jsonl", "source": one}, "data_source.source.content", "invalid_item"),
    ]
    for data_source, param, code in runs:
        err = _bad(lambda ds=data_source: evals.runs.create(ev.id, data_source=ds))
        assert (err.param, err.code if code else None) == (param, code), err.message
    assert evals.runs.list(ev.id).data == []  # nothing was stored
    with pytest.raises(openai.NotFoundError):
        evals.runs.create("eval_missing", data_source=_completions(BASE, one))


# ------------------------------------------------------------------------------- item schema and files
@pytest.mark.parametrize("required", [5, "question", {"question": True}, ["question", 7], None])
def test_an_item_schema_whose_required_is_not_a_list_of_names_is_refused(org: Tenant, required: Any) -> None:
    config: Any = {**CONFIG, "item_schema": {**CONFIG["item_schema"], "required": required}}
    err = _bad(lambda: org.client.evals.create(data_source_config=config, testing_criteria=[CONTAINS]))
    assert err.body == {
        "message": "data_source_config.item_schema.required must be a list of property names.",
        "type": "invalid_request_error",
        "param": "data_source_config.item_schema.required",
        "code": None,
    }
    assert org.client.evals.list().data == []


async def test_a_run_of_an_eval_stored_with_a_malformed_required_is_created(
    gw: GatewayServer, org: Tenant
) -> None:
    """An eval stored before its `required` was checked (a number there) still takes runs: its items are
    held to no required properties, instead of every run create failing."""
    database_url = gw.settings.database_url
    assert database_url is not None
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        stored = await evals_store.insert_eval(
            pool,
            org_id=org.org_id,
            name="older",
            metadata=None,
            data_source_config={
                "type": "custom",
                "schema": {"type": "object", "properties": {"item": {"type": "object", "required": 5}}},
            },
            testing_criteria=[CONTAINS],
        )
    finally:
        await pool.close()
    content = [{"item": q, "sample": {"output_text": "2"}} for q in QUESTIONS]
    data_source: Any = {"type": "jsonl", "source": {"type": "file_content", "content": content}}
    async with httpx.AsyncClient(
        base_url=gw.url, headers={"Authorization": f"Bearer {org.key}"}, timeout=60
    ) as api:
        made = await api.post(f"/v1/evals/{stored.id}/runs", json={"data_source": data_source})
    assert made.status_code == 200, made.text
    assert made.json()["status"] == "queued"


def test_a_run_create_reads_its_items_file_a_line_at_a_time(gw: GatewayServer, org: Tenant) -> None:
    """The items of a 16 MiB file are checked as the file is read: the gateway (in this process) holds a
    small part of it at a time (2.2 MB traced at the peak), where a file read whole before its items were
    checked was 30 MB of Python objects."""
    line = json.dumps({"item": {**QUESTIONS[0], "note": "x" * 924}, "sample": {"output_text": "2"}})
    assert len(line) == 1023  # with its newline, 1 KiB
    data = "\n".join([line] * 16_384).encode()
    file_id = org.client.files.create(file=("many.jsonl", data), purpose="evals").id
    ev = _eval(org, [CONTAINS])
    body = {"data_source": {"type": "jsonl", "source": {"type": "file_id", "id": file_id}}}
    del data
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {org.key}"}, timeout=120) as api:
        tracemalloc.start()
        try:
            made = api.post(f"/v1/evals/{ev.id}/runs", json=body)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert made.status_code == 200, made.text
        run_id = made.json()["id"]
        assert api.delete(f"/v1/evals/{ev.id}/runs/{run_id}").status_code == 200  # no need to run it
    assert peak < 4 * 2**20, peak  # the reader's 1 MiB chunk and a line, not the file


def _reader(gw: GatewayServer, pool: Any, org: Tenant, file_id: str) -> JobContext[RunRow]:
    """What a worker holding a jsonl run of `file_id` reads its items with: the gateway's database and blob
    store (the row is never queued, so no worker takes it)."""
    run = RunRow(
        id="evalrun_reader",
        eval_id="eval_reader",
        organization_id=org.org_id,
        name="reader",
        model="",
        metadata=None,
        data_source={"type": "jsonl", "source": {"type": "file_id", "id": file_id}},
        testing_criteria=[CONTAINS],
        status="in_progress",
        error=None,
        result_counts={},
        per_testing_criteria_results=[],
        per_model_usage=[],
        created_at=datetime.now(UTC),
        queue_generation=0,
        attempts=1,
    )
    return JobContext(run, "worker-reader", pool, BlobStore(gw.settings.blob_dir), gw.settings)


async def test_a_worker_reads_a_runs_items_file_a_few_items_at_a_time(gw: GatewayServer, org: Tenant) -> None:
    """The worker takes the items of a 16 MiB file as its lanes ask for them, each once and in the file's
    order: it holds a few items at a time (2.2 MB traced at the peak, the reader's 1 MiB chunk included),
    where the file read whole before its first item was 30 MB of Python objects."""
    lines = [
        json.dumps({"item": {**QUESTIONS[0], "n": i, "note": "x" * 900}, "sample": {"output_text": "2"}})
        for i in range(16_384)
    ]
    assert all(1000 < len(line) < 1024 for line in lines)
    data = "\n".join(lines).encode()
    del lines
    file_id = org.client.files.create(file=("many.jsonl", data), purpose="evals").id
    del data
    database_url = gw.settings.database_url
    assert database_url is not None
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        ctx = _reader(gw, pool, org, file_id)
        taken = 0
        tracemalloc.start()
        try:
            items = await PendingItems.open(ctx)
            while (pending := await items.take()) is not None:
                index, row = pending
                assert (index, row.item["n"], row.sample) == (taken, taken, {"output_text": "2"})
                taken += 1
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    finally:
        await pool.close()
    assert taken == 16_384 and items.error is None
    assert peak < 4 * 2**20, peak  # a step of items and the reader's chunk, not the file


async def test_a_worker_takes_the_items_before_a_line_that_breaks_then_reports_it(
    gw: GatewayServer, org: Tenant
) -> None:
    """An items file read by the worker stops at a line that breaks the rules (the run's create would have
    refused it; an `evals` upload is not checked): the items before it, but those the run has already
    recorded, are taken, then none, and `error` names the line. Line 20 falls inside the third step."""
    assert 2 * ITEMS_READ_AHEAD < 20 <= 3 * ITEMS_READ_AHEAD
    lines = [
        json.dumps({"item": {**QUESTIONS[0], "n": i}, "sample": {"output_text": "2"}}) for i in range(19)
    ]
    file_id = org.client.files.create(
        file=("broken.jsonl", "\n".join([*lines, "nope", lines[0]]).encode()), purpose="evals"
    ).id
    database_url = gw.settings.database_url
    assert database_url is not None
    pool = await create_pool(database_url, min_size=1, max_size=1)
    try:
        items = await PendingItems.open(_reader(gw, pool, org, file_id), done={1, 17})
        taken = []
        while (pending := await items.take()) is not None:
            index, row = pending
            assert row.item["n"] == index
            taken.append(index)
        assert await items.take() is None
    finally:
        await pool.close()
    assert taken == [i for i in range(19) if i not in (1, 17)]
    assert items.error == {
        "code": "invalid_file",
        "message": "Line 20 of the file is not valid JSON (Expecting value: line 1 column 1 (char 0)).",
    }

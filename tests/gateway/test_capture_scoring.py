"""Scoring captured episodes on the server (`POST /v1/episodes/score`), through the official `openai` SDK
against a gateway whose engine serves tiny-chat: an agent's arithmetic episodes, captured through the
gateway, scored by a `string_check` and a `python` grader, by the example arithmetic environment's scorer
in its sandbox, and by a group judge (tiny-chat itself) that reads the attempts at one task together. Each
score is a reward: the same scorer run again counts once, a new one adds rewards, the export sees them; the
judge's calls are the organisation's metered chats; bad scorers are refused in OpenAI's envelope with
nothing posted; another organisation's episodes are 404 and never scored."""

from __future__ import annotations

import json
import math
import secrets
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from envsdk.archive import pack
from gateway.capture.scoring_judge import digit_score, parse_scores
from tests.support.capture import capture_on, eventually
from tests.support.data import BASE
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant

gw = gateway_fixture("capture-scoring", usage_flush_interval_s=0.3)

ARITHMETIC = Path(__file__).resolve().parents[2] / "examples" / "envs" / "arithmetic"
TASKS = [json.loads(line) for line in (ARITHMETIC / "tasks.jsonl").read_text().splitlines() if line][:3]
ATTEMPTS = 2
ENVIRONMENT: Any = "environment"
"""A file purpose of tunegate's (the SDK's types list OpenAI's own)."""
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}
LENGTH = {
    "type": "python",
    "name": "length",
    "source": (
        "def grade(sample, item):\n"
        "    bonus = 100.0 if item['task_id'] == '0' else 0.0\n"
        "    return len(sample['output_text']) + bonus + len(item['messages'])\n"
    ),
}


def _arithmetic_reward(task: dict[str, Any], text: str, *, partial_credit: bool = True) -> float:
    sys.path.insert(0, str(ARITHMETIC))
    try:
        from arithmetic_env import ArithmeticEnv  # the example package's own scorer
    finally:
        sys.path.remove(str(ARITHMETIC))
    env = ArithmeticEnv(config={"partial_credit": partial_credit})
    return float(env.reward(task, text))


# ------------------------------------------------------------------------------------------------- helpers


def _post(t: Tenant, path: str, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    return httpx.post(
        f"{t.client.base_url}{path}",
        json=body,
        headers={"Authorization": f"Bearer {key or t.key}"},
        timeout=300,
    )


def _score(t: Tenant, body: dict[str, Any], key: str | None = None) -> httpx.Response:
    return _post(t, "episodes/score", body, key)


def _rewards(t: Tenant, episode_id: str) -> list[dict[str, Any]]:
    page = t.client.get(f"/episodes/{episode_id}/rewards", cast_to=object, options={"params": {"limit": 100}})
    assert isinstance(page, dict)
    return list(page["data"])


def _error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    return dict(error)


class Run:
    """The agent's episodes: one per attempt at each task, grouped by `task_id`."""

    def __init__(self, t: Tenant, label: str) -> None:
        self.t = t
        self.label = label
        self.ids: list[str] = []
        self.texts: dict[str, str] = {}
        self.tasks: dict[str, dict[str, Any]] = {}
        self.task_ids: dict[str, str] = {}
        for i, task in enumerate(TASKS):
            for attempt in range(ATTEMPTS):
                metadata = {"task_id": str(i), "answer": task["answer"], "run": label}
                episode = t.client.post("/episodes", body={"metadata": metadata}, cast_to=object)
                assert isinstance(episode, dict)
                agent = t.client.with_options(api_key=episode["key"])
                reply = agent.chat.completions.create(
                    model=BASE, messages=task["messages"], max_tokens=6, temperature=1.0, seed=attempt
                )
                t.client.post(f"/episodes/{episode['id']}/close", cast_to=object)
                self.ids.append(episode["id"])
                self.texts[episode["id"]] = reply.choices[0].message.content or ""
                self.tasks[episode["id"]] = task
                self.task_ids[episode["id"]] = str(i)
        for episode_id in self.ids:  # captures are written in batches off the request path

            def written(episode_id: str = episode_id) -> bool | None:
                got = t.client.get(f"/episodes/{episode_id}", cast_to=object)
                return True if isinstance(got, dict) and len(got["calls"]) == 1 else None

            eventually(written, f"the call of {episode_id} captured")


@pytest.fixture(scope="module")
def tenant_a(gw_admin: Admin) -> Tenant:
    t = gw_admin.tenant("score-a-" + secrets.token_hex(3))
    capture_on(gw_admin, t)
    return t


@pytest.fixture(scope="module")
def tenant_b(gw_admin: Admin) -> Tenant:
    t = gw_admin.tenant("score-b-" + secrets.token_hex(3))
    capture_on(gw_admin, t)
    return t


@pytest.fixture(scope="module")
def run(tenant_a: Tenant) -> Run:
    return Run(tenant_a, "r-" + secrets.token_hex(3))


@pytest.fixture(scope="module")
def arithmetic_file(tenant_a: Tenant, tmp_path_factory: pytest.TempPathFactory) -> str:
    archive, _ = pack(ARITHMETIC, tmp_path_factory.mktemp("pkg") / "arithmetic.tar.gz")
    made = tenant_a.client.files.create(file=(archive.name, archive.read_bytes()), purpose=ENVIRONMENT)
    return made.id


# ------------------------------------------------------------------------------------------------- graders


def test_a_grader_scores_each_episode_once_and_a_new_grader_adds(run: Run) -> None:
    t = run.t
    first = _score(t, {"name": "exact", "grader": EXACT, "episode_ids": run.ids})
    assert first.status_code == 200, first.text
    body = first.json()
    assert body["object"] == "episode.scoring" and body["scorer"]["type"] == "grader"
    assert body["scorer"]["source"] == "grader:string_check"
    assert body["counts"] == {"selected": 6, "posted": 6, "already_scored": 0, "errored": 0}
    by_id = {d["episode_id"]: d for d in body["data"]}
    for episode_id in run.ids:
        want = 1.0 if run.texts[episode_id] == run.tasks[episode_id]["answer"] else 0.0
        assert by_id[episode_id]["value"] == want and by_id[episode_id]["status"] == "posted"
        rewards = _rewards(t, episode_id)
        assert [(r["name"], r["value"], r["source"]) for r in rewards] == [
            ("exact", want, "grader:string_check")
        ]
        assert rewards[0]["idempotency_key"] == body["scorer"]["idempotency_key"]
        assert rewards[0]["id"] == by_id[episode_id]["reward_id"]

    again = _score(t, {"name": "exact", "grader": EXACT, "episode_ids": run.ids})
    assert again.status_code == 200, again.text
    assert again.json()["counts"] == {"selected": 6, "posted": 0, "already_scored": 6, "errored": 0}
    assert [d["value"] for d in again.json()["data"]] == [by_id[e]["value"] for e in run.ids]
    assert all(len(_rewards(t, e)) == 1 for e in run.ids)  # counted once

    # A new grader (python, in the sandbox) adds rewards of its own; the filters select as export's do.
    selection = {"metadata": {"run": run.label}}
    length = _score(t, {"name": "length", "grader": LENGTH, **selection})
    assert length.status_code == 200, length.text
    assert length.json()["counts"]["posted"] == 6
    for item in length.json()["data"]:
        episode_id = item["episode_id"]
        bonus = 100.0 if run.task_ids[episode_id] == "0" else 0.0
        assert item["value"] == len(run.texts[episode_id]) + bonus + len(run.tasks[episode_id]["messages"])
        assert sorted(r["name"] for r in _rewards(t, episode_id)) == ["exact", "length"]

    # The export sees the new rewards: each sample's reward is the one named.
    export = t.client.post(
        "/episodes/export", body={"episode_ids": run.ids, "reward": "length"}, cast_to=httpx.Response
    )
    samples = [json.loads(line) for line in export.text.splitlines()]
    values = {d["episode_id"]: d["value"] for d in length.json()["data"]}
    assert len(samples) == 6 and all(s["reward"] == values[s["episode_id"]] for s in samples)
    assert all({r["name"] for r in s["rewards"]} == {"exact", "length"} for s in samples)


def test_non_finite_and_failing_graders_post_nothing_unless_asked(run: Run) -> None:
    t = run.t
    before = {e: len(_rewards(t, e)) for e in run.ids}
    infinite = {
        "type": "multi",
        "name": "huge",
        "graders": {"a": EXACT},
        "calculate_output": "(a + 1) * 1e308 * 10",
    }
    error = _error(_score(t, {"name": "huge", "grader": infinite, "episode_ids": run.ids}), 400)
    assert (
        error["code"] == "invalid_score"
        and error["param"] == "grader"
        and "nothing was posted" in error["message"]
    )
    nan = {"type": "python", "name": "nan", "source": "def grade(sample, item):\n    return float('nan')\n"}
    error = _error(_score(t, {"name": "nan", "grader": nan, "episode_ids": run.ids}), 400)
    assert error["code"] == "python_grader_runtime_error" and "nan" in error["message"]
    assert {e: len(_rewards(t, e)) for e in run.ids} == before

    # `skip`: the episodes that score are posted, the others listed with their error.
    picky = {
        "type": "python",
        "name": "picky",
        "source": "def grade(sample, item):\n    return 1.0 if item['task_id'] != '0' else item['missing']\n",
    }
    resp = _score(t, {"name": "picky", "grader": picky, "episode_ids": run.ids, "on_error": "skip"})
    assert resp.status_code == 200, resp.text
    assert resp.json()["counts"] == {"selected": 6, "posted": 4, "already_scored": 0, "errored": 2}
    for item in resp.json()["data"]:
        names = [r["name"] for r in _rewards(t, item["episode_id"])]
        if run.task_ids[item["episode_id"]] == "0":
            assert item["status"] == "error" and item["error"]["code"] == "python_grader_runtime_error"
            assert "KeyError" in item["error"]["message"] and "picky" not in names
        else:
            assert item["status"] == "posted" and item["value"] == 1.0 and names.count("picky") == 1


def test_bad_scorers_are_refused_in_openai_envelope(run: Run, tenant_b: Tenant, arithmetic_file: str) -> None:
    t = run.t
    ids = run.ids[:2]
    before = {e: len(_rewards(t, e)) for e in ids}
    assert _error(_score(t, {"name": "x", "episode_ids": ids}), 400)["code"] == "invalid_scorer"
    two = {"name": "x", "episode_ids": ids, "grader": EXACT, "environment": {"file_id": arithmetic_file}}
    error = _error(_score(t, two), 400)
    assert error["code"] == "invalid_scorer" and error["param"] == "environment"
    error = _error(_score(t, {"name": "x", "episode_ids": ids, "grader": {"type": "nope", "name": "n"}}), 400)
    assert error["param"] == "grader.type"
    error = _error(_score(t, {"name": "x", "episode_ids": ids, "environment": {"file_id": "file-nope"}}), 404)
    assert error["param"] == "environment.file_id"
    jsonl = t.client.files.create(file=("t.jsonl", b'{"a": 1}\n'), purpose="fine-tune").id
    error = _error(_score(t, {"name": "x", "episode_ids": ids, "environment": {"file_id": jsonl}}), 400)
    assert error["code"] == "invalid_file_purpose"
    judge = {"model": "no-such-model", "group_by": "task_id"}
    error = _error(_score(t, {"name": "x", "episode_ids": ids, "group_judge": judge}), 404)
    assert error["code"] == "model_not_found" and error["param"] == "group_judge.model"
    assert _error(_score(t, {"grader": EXACT, "episode_ids": ids}), 400)["param"] == "name"
    error = _error(_score(t, {"name": "x", "episode_ids": ["ep-none"], "grader": EXACT}), 404)
    assert error["param"] == "episode_id"
    # another organisation's environment package is unknown here
    theirs = _score(
        tenant_b, {"name": "x", "metadata": {"run": "none"}, "environment": {"file_id": arithmetic_file}}
    )
    assert _error(theirs, 404)["param"] == "environment.file_id"
    assert {e: len(_rewards(t, e)) for e in ids} == before


# --------------------------------------------------------------------------------------------- environment


def test_the_example_environment_scores_the_captured_answers(
    run: Run, arithmetic_file: str, tmp_path: Path
) -> None:
    t = run.t
    body = {"name": "correct", "environment": {"file_id": arithmetic_file}, "episode_ids": run.ids}
    resp = _score(t, body)
    assert resp.status_code == 200, resp.text
    assert resp.json()["scorer"]["source"] == f"environment:{arithmetic_file}"
    assert resp.json()["counts"]["posted"] == 6
    for item in resp.json()["data"]:
        episode_id = item["episode_id"]
        assert item["value"] == _arithmetic_reward(run.tasks[episode_id], run.texts[episode_id])
    assert _score(t, body).json()["counts"]["already_scored"] == 6

    # Another config is another scorer: rewards of its own (exact answers only).
    strict = {**body, "environment": {"file_id": arithmetic_file, "config": {"partial_credit": False}}}
    resp = _score(t, strict)
    assert resp.status_code == 200 and resp.json()["counts"]["posted"] == 6, resp.text
    for item in resp.json()["data"]:
        episode_id = item["episode_id"]
        want = _arithmetic_reward(run.tasks[episode_id], run.texts[episode_id], partial_credit=False)
        assert item["value"] == want
        assert [r["name"] for r in _rewards(t, episode_id)].count("correct") == 2

    # A multi-turn package has no reward(task, completion) of a captured answer: refused, nothing posted.
    archive, _ = pack(ARITHMETIC.parent / "calculator", tmp_path / "calculator.tar.gz")
    calculator = t.client.files.create(file=(archive.name, archive.read_bytes()), purpose=ENVIRONMENT).id
    error = _error(_score(t, {**body, "name": "calc", "environment": {"file_id": calculator}}), 400)
    assert error["code"] == "unsupported_environment" and error["param"] == "environment.file_id"
    assert all("calc" not in [r["name"] for r in _rewards(t, e)] for e in run.ids)


# ---------------------------------------------------------------------------------------------- group judge


def _requests_since(gw: GatewayServer, t: Tenant, start: int) -> int:
    page = httpx.get(
        f"{gw.url}/v1/organization/usage/completions",
        params={"start_time": start, "bucket_width": "1h"},
        headers={"Authorization": f"Bearer {t.key}"},
    ).json()
    return sum(r["num_model_requests"] for b in page["data"] for r in b["results"])


def test_a_group_judge_reads_each_task_s_attempts_together_and_is_metered(
    gw: GatewayServer, run: Run
) -> None:
    """tiny-chat judges by log-probabilities: one call per episode, all the group's attempts in its prompt,
    the score the probability-weighted digit it would answer."""
    t = run.t
    start = int(time.time()) - 3600
    time.sleep(1.0)  # the agent's chats flushed
    chats_before = _requests_since(gw, t, start)
    judge = {"model": BASE, "group_by": "task_id", "method": "logprobs", "rubric": "The bare correct number."}
    body = {"name": "judged", "group_judge": judge, "episode_ids": run.ids}
    resp = _score(t, body)
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["scorer"]["source"] == f"judge:{BASE}"
    assert out["counts"] == {"selected": 6, "posted": 6, "already_scored": 0, "errored": 0}
    assert out["usage"]["calls"] == 6 and out["usage"]["prompt_tokens"] > 0
    assert all(0.0 <= d["value"] <= 1.0 for d in out["data"])
    assert len({d["value"] for d in out["data"]}) > 1  # the scores tell the episodes apart

    # The judge's calls are the organisation's chats: metered like any other.
    eventually(lambda: True if _requests_since(gw, t, start) == chats_before + 6 else None, "judge metered")

    again = _score(t, body).json()
    assert again["counts"]["already_scored"] == 6 and again["usage"]["calls"] == 0
    assert [d["value"] for d in again["data"]] == [d["value"] for d in out["data"]]


def test_a_judge_answer_that_does_not_parse_is_a_clear_error(run: Run) -> None:
    """tiny-chat asked for its scores as JSON: its answer is read leniently; where it does not parse after the
    retries, the group is an error (`judge_parse_error`), nothing posted for it."""
    t = run.t
    judge = {"model": BASE, "group_by": "task_id", "method": "answer", "max_retries": 1, "max_tokens": 48}
    body = {"name": "answered", "group_judge": judge, "episode_ids": run.ids}
    strict = _score(t, body)
    if strict.status_code == 400:
        error = _error(strict, 400)
        assert error["code"] == "judge_parse_error" and "after 2 tries" in error["message"]
        assert all("answered" not in [r["name"] for r in _rewards(t, e)] for e in run.ids)
    lenient = _score(t, {**body, "on_error": "skip"})
    assert lenient.status_code == 200, lenient.text
    for item in lenient.json()["data"]:
        names = [r["name"] for r in _rewards(t, item["episode_id"])]
        if item["status"] == "error":
            assert item["error"]["code"] == "judge_parse_error" and "answered" not in names
        else:
            assert 0.0 <= item["value"] <= 1.0 and names.count("answered") == 1
    counts, usage = lenient.json()["counts"], lenient.json()["usage"]
    assert counts["errored"] % ATTEMPTS == 0  # a group fails whole
    failed_groups = counts["errored"] // ATTEMPTS
    assert usage["calls"] >= 2 * failed_groups + (len(TASKS) - failed_groups)  # asked again before failing


def test_judge_answers_are_read_leniently() -> None:
    assert parse_scores('{"scores": [0.2, 0.9]}', 2) == ([0.2, 0.9], "")
    assert parse_scores('Sure! ```json\n{"scores": [1, 0]}\n```', 2) == ([1.0, 0.0], "")
    assert parse_scores('{"1": 0.5, "2": "0.25"}', 2) == ([0.5, 0.25], "")
    listed = '[{"trajectory": 2, "score": 0.1}, {"trajectory": 1, "score": 0.7}]'
    assert parse_scores(listed, 2) == ([0.7, 0.1], "")
    assert parse_scores("Trajectory 1: 0.3\nTrajectory 2 - 0.8", 2) == ([0.3, 0.8], "")
    assert parse_scores('{"scores": [0.2]}', 2)[0] is None
    assert parse_scores('{"scores": [0.2, 7]}', 2) == (None, "a score is outside [0, 1]")
    assert parse_scores('{"scores": [0.2, NaN]}', 2)[0] is None
    assert parse_scores("12", 2)[0] is None
    top = [{"token": "9", "logprob": math.log(0.5)}, {"token": " 0", "logprob": math.log(0.5)}]
    assert digit_score(top) == pytest.approx(0.5)
    assert digit_score([{"token": "x", "logprob": 0.0}]) is None


# ------------------------------------------------------------------------------------------------- tenancy


def test_other_organisations_and_episode_keys_score_nothing(run: Run, tenant_b: Tenant) -> None:
    t = run.t
    before = {e: len(_rewards(t, e)) for e in run.ids}
    error = _error(_score(tenant_b, {"name": "x", "grader": EXACT, "episode_ids": run.ids[:1]}), 404)
    assert error["param"] == "episode_id" and run.ids[0] in error["message"]
    run_label = run.label
    theirs = _score(tenant_b, {"name": "x", "grader": EXACT, "metadata": {"run": run_label}})
    assert (
        theirs.status_code == 200 and theirs.json()["counts"]["selected"] == 0 and theirs.json()["data"] == []
    )
    with pytest.raises(openai.NotFoundError):
        tenant_b.client.get(f"/episodes/{run.ids[0]}/rewards", cast_to=object)

    episode = t.client.post("/episodes", body={}, cast_to=object)
    assert isinstance(episode, dict)
    refused = _score(t, {"name": "x", "grader": EXACT, "episode_ids": run.ids}, key=episode["key"])
    assert _error(refused, 403)["code"] == "permission_denied"
    assert {e: len(_rewards(t, e)) for e in run.ids} == before

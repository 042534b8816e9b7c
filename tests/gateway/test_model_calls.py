"""Every model call a tenant causes goes through the gateway's own chat route with a key of the tenant's
organisation: model graders in `graders/run`, a model playing an episode in `environments/run`, and the model
graders of a training job. So another organisation's model is an unknown model there too (the same 404), the
calls are metered as the organisation's tokens, and rate limits and the budget refuse them as they refuse
chats.

The module has a database, a gateway (serving `tiny-chat` from the module's engine, with prices, so a budget
counts) and a worker of its own.
"""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from envsdk.archive import pack
from envsdk.graders import MODEL_GRADER_DEFAULT_MAX_TOKENS
from gateway.settings import ModelPrice
from tests.support.data import BASE
from tests.support.engine import make_lora_adapter, register_model
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.jobs import graded_rl_job, wait_for
from tests.support.stack import Admin, GatewayServer, Tenant

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "envs"
MESSAGES = [{"role": "user", "content": "What is 2 + 2?"}]
ITEM = {"question": "What is 2 + 2?", "answer": "4"}
TASK = {
    "messages": [{"role": "user", "content": "What is 9 + 3? Reply with the number only."}],
    "answer": "12",
}


def score(model: str, **sampling: Any) -> dict[str, Any]:
    return {
        "type": "score_model",
        "name": "judge",
        "model": model,
        "input": [
            {"role": "user", "content": "Score 0 to 1: {{ item.question }} -> {{ sample.output_text }}"}
        ],
        "sampling_params": {"temperature": 0, "max_completion_tokens": 3, **sampling},
    }


def label(model: str) -> dict[str, Any]:
    return {
        "type": "label_model",
        "name": "tone",
        "model": model,
        "input": [{"role": "user", "content": "Is '{{ sample.output_text }}' right? Say yes or no."}],
        "labels": ["yes", "no"],
        "passing_labels": ["yes"],
    }


gw = gateway_fixture(
    "calls",
    own_database=True,
    usage_flush_interval_s=0.3,
    auth_cache_ttl_s=1.0,
    prices={BASE: ModelPrice(input_per_million=1.0, output_per_million=1.0)},
)
worker = worker_fixture(autouse=True, TUNEGATE_HEARTBEAT_INTERVAL_S="0.5")


@pytest.fixture(scope="module")
def owned(
    gw: GatewayServer, gw_admin: Admin, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> tuple[Tenant, str]:
    """An organisation and its fine-tuned model."""
    owner = gw_admin.tenant("owner-" + secrets.token_hex(3))
    adapter = make_lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("calls-lora") / "lora", seed=21)
    ft = f"ft:{BASE}:{owner.org_id}:private:ftjob-{secrets.token_hex(6)}"
    register_model(gw.settings.database_url or "", owner.org_id, ft, str(adapter))
    return owner, ft


@pytest.fixture
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("calls-" + secrets.token_hex(3))


def post(gw: GatewayServer, t: Tenant, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{gw.url}/v1/fine_tuning/alpha/{path}",
        json=body,
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=120,
    )


def grade(gw: GatewayServer, t: Tenant, grader: dict[str, Any]) -> httpx.Response:
    return post(gw, t, "graders/run", {"grader": grader, "model_sample": "4", "item": ITEM})


def upload_arithmetic(t: Tenant, tmp: Path) -> str:
    archive, _ = pack(EXAMPLES / "arithmetic", tmp / "arithmetic.tar.gz")
    return t.client.files.create(file=(archive.name, archive.read_bytes()), purpose="environment").id


def play(gw: GatewayServer, t: Tenant, env_file: str, model: str) -> httpx.Response:
    return post(gw, t, "environments/run", {"file_id": env_file, "task": TASK, "model": model})


def usage_by_key(gw: GatewayServer, t: Tenant, start: int) -> dict[str, dict[str, Any]]:
    page = httpx.get(
        f"{gw.url}/v1/organization/usage/completions",
        params={"start_time": start, "bucket_width": "1d", "group_by": "api_key_id"},
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=30,
    ).json()
    return {r["api_key_id"]: r for b in page["data"] for r in b["results"]}


def wait_usage(gw: GatewayServer, t: Tenant, start: int, key_id: str, requests: int) -> dict[str, Any]:
    """The key's usage row once it counts `requests` model requests (usage is written in batches)."""
    deadline = time.monotonic() + 30
    while (found := usage_by_key(gw, t, start).get(key_id)) is None or found["num_model_requests"] < requests:
        assert time.monotonic() < deadline, f"usage of {key_id} not recorded: {found}"
        time.sleep(0.3)
    return found


# ------------------------------------------------------------------------------------------- ownership
def test_another_organisations_model_is_an_unknown_model_everywhere(
    gw: GatewayServer, owned: tuple[Tenant, str], org: Tenant, tmp_path: Path
) -> None:
    owner, ft = owned
    unknown = f"ft:{BASE}:{owner.org_id}:private:ftjob-{secrets.token_hex(6)}"
    env_file = upload_arithmetic(org, tmp_path)

    with pytest.raises(openai.NotFoundError) as chat:
        org.client.chat.completions.create(model=ft, messages=MESSAGES)
    assert chat.value.code == "model_not_found"
    message = f"No model found with id '{ft}'."
    assert chat.value.body == {
        "message": message,
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }

    multi = {"type": "multi", "name": "m", "graders": {"tone": label(ft)}, "calculate_output": "tone"}
    calls: list[tuple[str, Any]] = [
        ("grader.model", lambda model: grade(gw, org, score(model))),
        ("grader.model", lambda model: grade(gw, org, label(model))),
        (
            "grader.graders.tone.model",
            lambda model: grade(gw, org, json.loads(json.dumps(multi).replace(ft, model))),
        ),
        ("model", lambda model: play(gw, org, env_file, model)),
    ]
    for param, call in calls:
        theirs, nobodys = call(ft), call(unknown)
        assert theirs.status_code == nobodys.status_code == 404, (param, theirs.text)
        expected = {
            "message": message,
            "type": "invalid_request_error",
            "param": param,
            "code": "model_not_found",
        }
        assert theirs.json() == {"error": expected}
        assert nobodys.text == theirs.text.replace(ft, unknown)

    # A training job whose grader calls the model is refused at create, the same way.
    errors = []
    for model in (ft, unknown):
        with pytest.raises(openai.NotFoundError) as job:
            graded_rl_job(org, score(model))
        errors.append(job.value.body)
    assert errors[0] == {**expected, "param": "method.reinforcement.grader.model"}
    assert errors[1] == {**errors[0], "message": f"No model found with id '{unknown}'."}
    assert org.client.fine_tuning.jobs.list().data == []

    # The owner grades and plays with it.
    mine = grade(gw, owner, score(ft))
    assert mine.status_code == 200, mine.text
    assert mine.json()["model_grader_token_usage_per_model"][ft]["total_tokens"] > 0
    played = play(gw, owner, upload_arithmetic(owner, tmp_path), ft)
    assert played.status_code == 200 and played.json()["messages"][-1]["role"] == "assistant", played.text


# ---------------------------------------------------------------------------------------------- usage
def test_grader_and_episode_calls_are_metered_as_the_callers_tokens(
    gw: GatewayServer, org: Tenant, tmp_path: Path
) -> None:
    start = int(time.time()) - 5
    judged = grade(gw, org, score(BASE))
    labelled = grade(gw, org, label(BASE))  # no token cap of its own: the default one
    assert judged.status_code == labelled.status_code == 200, (judged.text, labelled.text)
    tokens = [r.json()["model_grader_token_usage_per_model"][BASE] for r in (judged, labelled)]
    assert tokens[0]["completion_tokens"] <= 3
    assert 0 < tokens[1]["completion_tokens"] <= MODEL_GRADER_DEFAULT_MAX_TOKENS

    metered = wait_usage(gw, org, start, org.key_id, requests=2)
    assert metered["num_model_requests"] == 2
    assert metered["input_tokens"] == sum(t["prompt_tokens"] for t in tokens)
    assert metered["output_tokens"] == sum(t["completion_tokens"] for t in tokens)

    played = play(gw, org, upload_arithmetic(org, tmp_path), BASE)
    assert played.status_code == 200 and played.json()["turns"] == 1, played.text
    assert wait_usage(gw, org, start, org.key_id, requests=3)["num_model_requests"] == 3

    # A token cap beyond what a grader may ask for is refused, naming the field.
    for name in ("max_completion_tokens", "max_completions_tokens", "max_tokens"):
        refused = grade(gw, org, score(BASE, **{name: 10**9}))
        assert refused.status_code == 400
        assert refused.json()["error"]["param"] == f"grader.sampling_params.{name}"


# --------------------------------------------------------------------------------------------- limits
def test_budget_and_rate_limits_refuse_grader_and_episode_calls_as_they_refuse_chats(
    gw: GatewayServer, gw_admin: Admin, tmp_path: Path
) -> None:
    broke = gw_admin.tenant("broke-" + secrets.token_hex(3))
    env_file = upload_arithmetic(broke, tmp_path)
    set_budget = gw_admin.http.post(
        f"/v1/admin/organizations/{broke.org_id}/billing", json={"monthly_budget_usd": 0}
    )
    set_budget.raise_for_status()
    start = int(time.time()) - 5
    with pytest.raises(openai.RateLimitError) as chat:
        broke.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2)
    assert chat.value.code == "insufficient_quota"
    for refused in (
        grade(gw, broke, score(BASE)),
        grade(gw, broke, label(BASE)),
        play(gw, broke, env_file, BASE),
    ):
        assert refused.status_code == 429 and refused.json() == {"error": chat.value.body}, refused.text

    slow = gw_admin.tenant("slow-" + secrets.token_hex(3))
    env_file = upload_arithmetic(slow, tmp_path)
    limited = gw_admin.http.post(
        f"/v1/admin/organizations/{slow.org_id}/limits", json={"max_requests_per_1_minute": 1}
    )
    limited.raise_for_status()
    assert grade(gw, slow, score(BASE)).status_code == 200  # the minute's one request
    with pytest.raises(openai.RateLimitError) as chat:
        slow.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2)
    assert chat.value.code == "rate_limit_exceeded"
    for refused in (grade(gw, slow, label(BASE)), play(gw, slow, env_file, BASE)):
        assert refused.status_code == 429, refused.text
        error = refused.json()["error"]
        assert (error["type"], error["code"]) == ("requests", "rate_limit_exceeded")
        assert error["message"].startswith("Rate limit reached for this organization or API key")
        assert int(refused.headers["retry-after"]) >= 1

    # Nothing was generated for the refused calls: the broke organisation has no tokens, the slow one the
    # grader call that was let through.
    assert usage_by_key(gw, broke, start) == {}
    assert wait_usage(gw, slow, start, slow.key_id, requests=1)["num_model_requests"] == 1


# ------------------------------------------------------------------------------------------- training
def test_a_jobs_model_grader_calls_the_gateway_with_a_key_of_the_job(
    gw: GatewayServer, gw_admin: Admin, org: Tenant
) -> None:
    start = int(time.time()) - 5
    job = graded_rl_job(org, score(BASE))
    done = wait_for(org, job.id, timeout=300)
    assert done.status == "succeeded", done.error

    keys = gw_admin.http.get(f"/v1/admin/organizations/{org.org_id}/api_keys", params={"kind": "job"}).json()
    (key,) = [k for k in keys["data"] if k["name"] == f"job {job.id}"]
    assert key["kind"] == "job" and key["revoked_at"] is not None  # revoked when the trainer ended
    metered = wait_usage(gw, org, start, key["id"], requests=1)
    assert metered["input_tokens"] > 0 and metered["output_tokens"] > 0
    assert set(usage_by_key(gw, org, start)) == {key["id"]}  # no other key made model calls

"""A key's monthly spend limit holds across its jobs: three jobs of one key, trained at once, none of which
reaches the limit alone, pause within a step of the key's spend reaching it, each billed to its pausing step
(one that starts after it pauses before its first step); the key cannot start another
while it is over; a resumed job pauses again before it trains. Every step's metrics event carries the job's
cost so far."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest

from gateway.worker.job.metering import KEY_LIMIT_PAUSED
from tests.support.data import BASE, SFT
from tests.support.fixtures import worker_fixture
from tests.support.jobs import all_events, metrics, upload_rows, wait_for, wait_trainer_gone
from tests.support.stack import Admin, GatewayServer, Tenant

worker = worker_fixture(of="stack", TUNEGATE_TRAINING_SLOTS="3")
"""Three trainers at once."""

pytestmark = pytest.mark.slow


def _row_cost(stack: GatewayServer) -> float:
    """The most one SFT row costs to train (a step at batch size 1), from the base model's tokenizer."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(stack.settings.base_model_path(BASE)))
    counted = [tokenizer.apply_chat_template(row["messages"], tokenize=True, return_dict=True) for row in SFT]
    most = max(len(c["input_ids"]) for c in counted)
    return most * stack.settings.price_of(BASE).training_per_million / 1e6


def jobs_file_bytes(rows: list[dict[str, Any]]) -> int:
    """The bytes of the file `upload_rows` makes of `rows`."""
    return len("\n".join(json.dumps(r) for r in rows).encode())


def _usage(t: Tenant, job_id: str) -> dict[str, Any]:
    found: dict[str, Any] = (t.client.fine_tuning.jobs.retrieve(job_id).model_extra or {}).get("usage") or {}
    return found


def _estimate(t: Tenant, **body: Any) -> dict[str, Any]:
    found = t.client.post("/fine_tuning/jobs/estimate", body={"model": BASE, **body}, cast_to=object)
    assert isinstance(found, dict), found
    return found


def _spend(admin: Admin, key_id: str) -> dict[str, Any]:
    resp = admin.http.get(f"/v1/admin/api_keys/{key_id}/spend_limit")
    assert resp.status_code == 200, resp.text
    found: dict[str, Any] = resp.json()
    return found


def _key_events(t: Tenant, job_id: str) -> list[Any]:
    return [e for e in all_events(t, job_id) if e.message.startswith(KEY_LIMIT_PAUSED)]


def test_a_keys_spend_limit_holds_across_three_concurrent_jobs(
    stack: GatewayServer, worker: Any, admin: Admin, tenant: Tenant
) -> None:
    jobs = tenant.client.fine_tuning.jobs
    training = upload_rows(tenant, SFT)
    hp = {"n_epochs": 2, "batch_size": 1, "checkpoint_every": 1000}
    method: Any = {"type": "supervised", "supervised": {"hyperparameters": hp}}
    step_cost = _row_cost(stack)
    # One job costs two thirds of the key's limit (the estimate is exact for a supervised file): none reaches
    # it alone, three together would spend twice the limit unchecked. Each fits the create's own check (a
    # file's bytes over four a token).
    one_job = _estimate(tenant, training_file=training, method=method)["cost"]["expected"]
    limit = round(1.5 * one_job, 9)
    price = stack.settings.price_of(BASE).training_per_million / 1e6
    assert jobs_file_bytes(SFT) // 4 * hp["n_epochs"] * price <= limit, "the create's check would refuse"
    resp = admin.http.post(
        f"/v1/admin/api_keys/{tenant.key_id}/spend_limit", json={"monthly_spend_limit_usd": limit}
    )
    assert resp.status_code == 200, resp.text
    est = _estimate(tenant, training_file=training, method=method)
    assert est["allowed"] is True and est["budget"]["api_key_monthly_spend_limit_usd"] == limit
    assert est["budget"]["api_key_month_to_date_usd"] == 0 and est["budget"]["api_key_left_usd"] == limit
    created = [jobs.create(model=BASE, training_file=training, method=method) for _ in range(3)]
    ids = [job.id for job in created]
    ended = ("paused", "succeeded", "failed", "cancelled")
    final = {job_id: wait_for(tenant, job_id, ended, timeout=180) for job_id in ids}
    for job_id in ids:
        wait_trainer_gone(job_id)
    paused = [j for j in ids if final[j].status == "paused"]
    assert all(final[j].status in ("paused", "succeeded") for j in ids), [final[j].error for j in ids]
    assert paused, "no job was paused"
    crossings = {}
    for job_id in paused:
        events = _key_events(tenant, job_id)
        assert len(events) == 1 and events[0].level == "warn", events
        data = events[0].data or {}
        assert data["reason"] == "key_spend_limit" and data["api_key_id"] == tenant.key_id, data
        assert data["monthly_spend_limit"] == limit and data["month_to_date"] >= limit, data
        crossings[job_id] = data["step"]
    # Billed to each job's pausing step: the key's month ends within a step of each job past its limit.
    # (Recorded: the key's month, which counts unrecorded progress too, equals the jobs' recorded usage; a
    # job that started after the key was over paused before its first step and recorded nothing.)
    deadline = time.monotonic() + 20
    while (spent := _spend(admin, tenant.key_id))["month_to_date_usd"] != pytest.approx(
        sum(_usage(tenant, j).get("cost_usd", 0.0) for j in ids), abs=1e-6
    ):
        assert time.monotonic() < deadline, "the paused attempts' usage was not recorded"
        time.sleep(0.3)
    assert limit <= spent["month_to_date_usd"] <= limit + 3 * step_cost + 1e-9, (spent, crossings)
    costs = {j: (jobs.retrieve(j).model_extra or {})["cost"] for j in ids}
    assert sum(c["accrued"] for c in costs.values()) == pytest.approx(spent["month_to_date_usd"], abs=1e-6)
    assert max(c["accrued"] for c in costs.values()) < limit  # reached by the jobs together, not by one

    # Each step's metrics event carries the job's cost so far, rising with its tokens.
    first = next(j for j in paused if costs[j]["accrued"] > 0)
    steps = metrics(tenant, first)
    accrued = [m["cost"]["accrued"] for m in steps]
    assert accrued == sorted(accrued) and accrued[0] > 0, steps
    assert all(m["cost"]["projected_total"] >= m["cost"]["accrued"] for m in steps)
    # From its pausing step on (the trainer finishes the step it is in), the events show what is billed.
    after = [m["cost"]["accrued"] for m in steps if m["step"] >= crossings[first]]
    assert after and all(a == pytest.approx(costs[first]["accrued"], abs=1e-6) for a in after), steps

    # Over its limit, the key starts no job; another key of the organisation does.
    refused = admin.http.post(
        "/v1/fine_tuning/jobs",
        json={"model": BASE, "training_file": training},
        headers={"Authorization": f"Bearer {tenant.key}"},
    )
    error = refused.json()["error"]
    assert refused.status_code == 429 and error["code"] == "insufficient_quota", refused.text
    assert "spend limit of this API key" in error["message"]
    est = _estimate(tenant, training_file=training, method=method)
    assert est["allowed"] is False and "spend limit of this API key" in est["refusal"]
    assert est["budget"]["api_key_month_to_date_usd"] == pytest.approx(spent["month_to_date_usd"], abs=1e-6)
    assert est["budget"]["api_key_left_usd"] == 0
    other = admin.http.post(
        f"/v1/admin/organizations/{tenant.org_id}/api_keys", json={"name": "other"}
    ).json()
    accepted = admin.http.post(
        "/v1/fine_tuning/jobs",
        json={"model": BASE, "training_file": training},
        headers={"Authorization": f"Bearer {other['key']}"},
    )
    assert accepted.status_code == 200, accepted.text
    assert jobs.cancel(accepted.json()["id"]).status == "cancelled"

    # Resumed while the key is still over: it pauses again, before it trains a step.
    assert jobs.resume(first).status == "queued"
    again = wait_for(tenant, first, ended, timeout=120)
    assert again.status == "paused" and len(_key_events(tenant, first)) == 2
    wait_trainer_gone(first)
    assert len(metrics(tenant, first)) == len(steps)  # it trained no step
    time.sleep(1)
    after = _spend(admin, tenant.key_id)["month_to_date_usd"]
    assert after == pytest.approx(spent["month_to_date_usd"], abs=1e-9)  # billed nothing

"""Tinker's billing reports through the official `tinker` SDK (`AdminClient`, `tinker billing`) and the
Tinker-loop estimate, against a running stack (gateway, worker, engine) on `tiny-chat`.

A short loop trains, samples and saves checkpoints; the report's events must hold exactly the tokens the
gateway metered (read back from its own `GET /v1/organization/usage/completions`), priced at the
organisation's rates.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import httpx
import pytest
import tinker
from tinker import types

from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.stack import Admin, GatewayServer, Tenant
from tests.support.tinker import datum

PRICES = {"tiny-chat": {"input_per_million": 0.25, "output_per_million": 1.5, "training_per_million": 3.0}}
gw = gateway_fixture("tinker-billing", own_database=True, prices=PRICES)
worker = worker_fixture(autouse=True, TUNEGATE_TINKER_IDLE_TIMEOUT_S="2")

DATA = [
    [5, 17, 42, 9, 33, 7, 61, 12],
    [8, 23, 4, 56, 19, 40, 11, 3],
]
STEPS = 3
PROMPT = DATA[0][:4]
MAX_TOKENS = 3
METADATA = {"experiment": "billing", "owner": "ada"}
TOKEN_TYPES = ("training", "sampling_prefill", "sampling_sample")
RATES = {
    "training": PRICES["tiny-chat"]["input_per_million"],  # Tinker passes are billed as prompt tokens
    "sampling_prefill": PRICES["tiny-chat"]["input_per_million"],
    "sampling_sample": PRICES["tiny-chat"]["output_per_million"],
}


def _hour(at: datetime) -> datetime:
    return at.replace(minute=0, second=0, microsecond=0)


def _window() -> tuple[str, str]:
    """From the hour before this one to two hours on: the loop's usage falls in it even across an hour."""
    now = _hour(datetime.now(UTC))
    return (now - timedelta(hours=1)).isoformat(), (now + timedelta(hours=2)).isoformat()


def _quantity(info: types.BillingEventInfo) -> float:
    if isinstance(info, types.CheckpointBillingEvent):
        return info.count
    if isinstance(info, types.StorageBillingEvent):
        return info.gigabyte_hours
    return info.token_count


def _totals(usage: types.BillingUsageResponse) -> dict[str, float]:
    out: dict[str, float] = dict.fromkeys((*TOKEN_TYPES, "checkpoint"), 0)
    for e in usage.data:
        out[e.event_info.type] += _quantity(e.event_info)
    return out


def _metered(gw: GatewayServer, org: Tenant, start: str) -> dict[str, int]:
    """The tokens the gateway metered for `org` since `start`, by billing event type, from its own usage API
    (Tinker's passes are the models `tinker-forward[_backward]:<model id>`)."""
    page = httpx.get(
        f"{gw.url}/v1/organization/usage/completions",
        params={"start_time": int(datetime.fromisoformat(start).timestamp()), "bucket_width": "1h",
                "group_by": "model", "limit": 3},
        headers={"Authorization": f"Bearer {org.key}"},
    )  # fmt: skip
    page.raise_for_status()
    out = dict.fromkeys(TOKEN_TYPES, 0)
    for bucket in page.json()["data"]:
        for r in bucket["results"]:
            if r["model"].startswith(("tinker-forward:", "tinker-forward_backward:")):
                out["training"] += r["input_tokens"]
            else:
                out["sampling_prefill"] += r["input_tokens"]
                out["sampling_sample"] += r["output_tokens"]
    return out


@pytest.fixture(scope="module")
def loop(gw: GatewayServer, org: Tenant) -> dict[str, Any]:
    """A short Tinker loop of `org`: `STEPS` steps of forward_backward on `DATA`, optim_step and one sample
    request of two samples of `PROMPT` from the base model; then a saved state and sampler weights. What it
    did, and how long its last sample took to show in the report."""
    with tinker.ServiceClient(user_metadata=METADATA, base_url=gw.url, api_key="tml-" + org.key) as service:
        session_id = service.holder.get_session_id()
        tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=0)
        sampler = service.create_sampling_client(base_model="tiny-chat")
        params = types.SamplingParams(max_tokens=MAX_TOKENS)
        out_tokens = 0
        for _ in range(STEPS):
            tc.forward_backward([datum(t) for t in DATA], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
            sampled = sampler.sample(types.ModelInput.from_ints(PROMPT), 2, params).result()
            out_tokens += sum(len(s.tokens) for s in sampled.sequences)
        sampled_at = time.monotonic()
        tc.save_state("billing").result()
        tc.save_weights_for_sampler("billing").result()
        checkpoints = service.create_rest_client().list_checkpoints(tc.model_id).result().checkpoints
    admin = tinker.AdminClient(base_url=gw.url, api_key="tml-" + org.key)
    start, end = _window()
    while True:  # the completion's usage row is written by the gateway's buffer, within its flush interval
        usage = admin.get_billing_usage(start, end).result()
        lag = time.monotonic() - sampled_at
        if _totals(usage)["sampling_sample"] == out_tokens or lag > 60:
            break
        time.sleep(0.1)
    print(f"the last sample showed in the billing report {lag:.2f} s after its result")
    return {
        "session_id": session_id, "model_id": tc.model_id, "out_tokens": out_tokens, "lag_s": lag,
        "checkpoints": checkpoints, "start": start, "end": end,
    }  # fmt: skip


@pytest.mark.timeout(600)
def test_usage_events_hold_the_metered_tokens_priced(
    gw: GatewayServer, org: Tenant, loop: dict[str, Any]
) -> None:
    assert loop["lag_s"] < 60
    admin = tinker.AdminClient(base_url=gw.url, api_key="tml-" + org.key)
    usage = admin.get_billing_usage(loop["start"], loop["end"]).result()
    assert isinstance(usage, types.BillingUsageResponse) and usage.cost_data_through is None

    metered = _metered(gw, org, loop["start"])
    trained = STEPS * sum(len(t) - 1 for t in DATA)
    prefill = STEPS * len(PROMPT)  # a sample request's prompt once, however many samples it asks for
    assert metered == {
        "training": trained,
        "sampling_prefill": prefill,
        "sampling_sample": loop["out_tokens"],
    }
    totals = _totals(usage)
    assert totals == {**metered, "checkpoint": len(loop["checkpoints"])} and totals["checkpoint"] == 2

    for e in usage.data:
        assert e.bucket_end - e.bucket_start == timedelta(hours=1) and e.bucket_start.minute == 0
        assert e.base_model == "tiny-chat" and e.user_id is None and e.project_id is None
        info = e.event_info
        if isinstance(info, types.CheckpointBillingEvent):
            assert e.session_id == loop["session_id"]
            assert e.estimated_cost_usd is None and e.effective_rate_usd_per_million_tokens is None
            continue
        assert e.effective_rate_usd_per_million_tokens == RATES[info.type]
        assert e.estimated_cost_usd == RATES[info.type] * info.token_count / 1e6
        assert e.effective_rate_usd_per_gigabyte_month is None
        if isinstance(info, types.TrainingBillingEvent):
            assert e.session_id == loop["session_id"]  # the session that made the training model
        else:
            assert e.session_id is None  # a completion's usage row does not say which session sent it
        if isinstance(info, types.SamplingPrefillBillingEvent):
            assert info.cached is False
    assert usage.sessions == {loop["session_id"]: types.BillingUsageSession(user_metadata=METADATA)}
    order = [
        (e.bucket_start, -_quantity(e.event_info) * (e.event_info.type in TOKEN_TYPES)) for e in usage.data
    ]
    assert order == sorted(order)

    # the raw answer is exactly the SDK's shape: nothing more, nothing less
    raw = httpx.get(
        f"{gw.url}/api/v1/billing/usage/events",
        params={"starting_on": loop["start"], "ending_before": loop["end"]},
        headers={"X-API-Key": "tml-" + org.key},
    ).json()
    assert raw == usage.model_dump(mode="json")
    assert set(raw) == {"data", "sessions", "cost_data_through"}


def test_another_organisation_sees_none_of_it(
    gw: GatewayServer, gw_admin: Admin, loop: dict[str, Any]
) -> None:
    other = gw_admin.tenant("tinker-billing-other")
    admin = tinker.AdminClient(base_url=gw.url, api_key="tml-" + other.key)
    usage = admin.get_billing_usage(loop["start"], loop["end"]).result()
    assert usage.data == [] and usage.sessions == {} and usage.cost_data_through is None
    storage = admin.get_current_checkpoint_storage_usage().result()
    assert storage.data == [] and storage.effective_rate_usd_per_gigabyte_month is None


def test_checkpoint_storage_now(gw: GatewayServer, org: Tenant, loop: dict[str, Any]) -> None:
    admin = tinker.AdminClient(base_url=gw.url, api_key="tml-" + org.key)
    storage = admin.get_current_checkpoint_storage_usage().result()
    listed = tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key).create_rest_client()
    every = listed.list_user_checkpoints().result().checkpoints
    size = sum(c.size_bytes or 0 for c in every)
    assert size > 0
    assert storage == types.CurrentCheckpointStorageUsageResponse(
        effective_rate_usd_per_gigabyte_month=None,
        data=[
            types.CurrentCheckpointStorageUsageItem(
                checkpoint_count=len(every),
                size_bytes=size,
                size_gigabytes=size / 1e9,
                estimated_monthly_cost_usd=None,
            )
        ],
    )
    with pytest.raises(tinker.BadRequestError, match="no projects"):
        admin.get_current_checkpoint_storage_usage(project_id="p-1").result()


@pytest.mark.parametrize(
    ("hours", "length", "minute", "param", "message"),
    [
        (0, 1, 30, "starting_on", "must be on a UTC hour boundary"),
        (2, 1, 0, "starting_on", "must not be in the future"),
        (-1, 0, 0, "ending_before", "must be after starting_on"),
        (-400, 14 * 24 + 1, 0, "ending_before", "at most 14 days after starting_on"),
    ],
)
def test_bad_windows_are_refused(
    gw: GatewayServer, org: Tenant, hours: int, length: int, minute: int, param: str, message: str
) -> None:
    start = _hour(datetime.now(UTC)) + timedelta(hours=hours, minutes=minute)
    end = start + timedelta(hours=length)
    admin = tinker.AdminClient(base_url=gw.url, api_key="tml-" + org.key)
    with pytest.raises(tinker.BadRequestError, match=message):
        admin.get_billing_usage(start, end).result()
    raw = httpx.get(
        f"{gw.url}/api/v1/billing/usage/events",
        params={"starting_on": start.isoformat(), "ending_before": end.isoformat()},
        headers={"X-API-Key": "tml-" + org.key},
    )
    assert raw.status_code == 400
    body = raw.json()["error"]
    assert (
        body["type"] == "invalid_request_error" and body["param"] == param and body["code"] == "invalid_value"
    )
    assert message in body["message"]
    missing = httpx.get(f"{gw.url}/api/v1/billing/usage/events", headers={"X-API-Key": "tml-" + org.key})
    assert missing.status_code == 400 and missing.json()["error"]["type"] == "invalid_request_error"
    anonymous = httpx.get(
        f"{gw.url}/api/v1/billing/usage/events",
        params={"starting_on": start.isoformat(), "ending_before": end.isoformat()},
    )
    assert anonymous.status_code == 401


def test_the_cli_prints_the_same_report(gw: GatewayServer, org: Tenant, loop: dict[str, Any]) -> None:
    admin = tinker.AdminClient(base_url=gw.url, api_key="tml-" + org.key)
    expected = admin.get_billing_usage(loop["start"], loop["end"]).result()
    start = datetime.fromisoformat(loop["start"]).strftime("%Y-%m-%dT%H:%M:%SZ")
    end = datetime.fromisoformat(loop["end"]).strftime("%Y-%m-%dT%H:%M:%SZ")
    env = {**os.environ, "TINKER_BASE_URL": gw.url, "TINKER_API_KEY": "tml-" + org.key}
    cli = Path(sys.executable).with_name("tinker")
    done = subprocess.run(
        [str(cli), "--format", "json", "billing", "usage", start, end],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    printed = json.loads(done.stdout)
    want = expected.model_dump(mode="json")
    assert printed == {"data": want["data"], "sessions": want["sessions"], "cost_data_through": None}
    assert {row["event_info"]["type"] for row in printed["data"]} == {*TOKEN_TYPES, "checkpoint"}
    refused = subprocess.run(
        [str(cli), "--format", "json", "billing", "usage", start, start],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert (
        refused.returncode != 0
        and "ending_before must be after starting_on" in refused.stdout + refused.stderr
    )


def test_the_estimate_counts_the_loop_as_it_was_metered(
    gw: GatewayServer, gw_admin: Admin, org: Tenant, loop: dict[str, Any]
) -> None:
    """The loop the `loop` fixture ran, described by its shape: the estimate's exact token counts are those
    the report holds, its costs those tokens at the organisation's rates."""
    http = httpx.Client(base_url=f"{gw.url}/v1", headers={"Authorization": f"Bearer {org.key}"})
    shape = {
        "base_model": "tiny-chat",
        "steps": STEPS,
        "forward_backward": {"datums_per_step": len(DATA), "tokens_per_datum": len(DATA[0]) - 1},
        "sampling": {"prompts_per_step": 1, "samples_per_prompt": 2, "prompt_tokens": len(PROMPT),
                     "max_tokens": MAX_TOKENS, "completion_tokens": 2},
    }  # fmt: skip
    got = http.post("/tinker/estimate", json=shape)
    assert got.status_code == 200, got.text
    est = got.json()
    usage = tinker.AdminClient(base_url=gw.url, api_key="tml-" + org.key)
    reported = _totals(usage.get_billing_usage(loop["start"], loop["end"]).result())
    trained, prefill = reported["training"], reported["sampling_prefill"]
    assert est["tokens"]["training"] == {"low": trained, "expected": trained, "high": trained}
    assert est["tokens"]["sampling_prefill"] == {"low": prefill, "expected": prefill, "high": prefill}
    samples = STEPS * 2
    assert est["tokens"]["sampling_sample"] == {
        "low": 0,
        "expected": samples * 2,
        "high": samples * MAX_TOKENS,
    }
    assert 0 < reported["sampling_sample"] <= samples * MAX_TOKENS
    rate_in, rate_out = RATES["training"], RATES["sampling_sample"]
    assert est["rates_usd_per_million_tokens"] == {
        "training": rate_in, "sampling_prefill": rate_in, "sampling_sample": rate_out
    }  # fmt: skip
    exact = (trained + prefill) * rate_in / 1e6
    assert est["cost"] == {
        "low": round(exact, 9),
        "expected": round(exact + samples * 2 * rate_out / 1e6, 9),
        "high": round(exact + samples * MAX_TOKENS * rate_out / 1e6, 9),
    }
    assert est["object"] == "tinker.estimate" and est["currency"] == "usd" and est["steps"] == STEPS
    assert est["budget"]["monthly_budget_usd"] is None and est["allowed"] is True and est["refusal"] is None
    names = {a["name"] for a in est["assumptions"]}
    assert names == {"training_rate", "prompt_per_request", "sampled_tokens", "not_priced"}

    # held against the monthly budget's remainder
    billing = f"/v1/admin/organizations/{org.org_id}/billing"
    assert gw_admin.http.post(billing, json={"monthly_budget_usd": 0.000001}).status_code == 200
    try:
        tight = http.post("/tinker/estimate", json=shape).json()
    finally:
        assert gw_admin.http.post(billing, json={"monthly_budget_usd": None}).status_code == 200
    assert tight["allowed"] is False and tight["budget"]["monthly_budget_usd"] == 0.000001
    assert tight["refusal"].startswith("This loop's estimated cost ($")


@pytest.mark.parametrize(
    ("change", "param", "message"),
    [
        ({"base_model": "no-such-model"}, "base_model", "Unknown base model 'no-such-model'"),
        ({"steps": 0}, "steps", "greater than or equal to 1"),
        (
            {"forward_backwards": {"datums_per_step": 1, "tokens_per_datum": 1}},
            "forward_backwards",
            "Unrecognized parameter",
        ),
        ({"forward_backward": None}, "forward_backward", "Give at least one of"),
        (
            {
                "forward_backward": None,
                "sampling": {
                    "prompts_per_step": 1,
                    "prompt_tokens": 3,
                    "max_tokens": 2,
                    "completion_tokens": 5,
                },
            },
            "sampling.completion_tokens",
            "at most max_tokens",
        ),  # fmt: skip
    ],
)
def test_the_estimate_refuses_bad_shapes(
    gw: GatewayServer, org: Tenant, change: dict[str, Any], param: str, message: str
) -> None:
    body = {
        "base_model": "tiny-chat",
        "steps": 2,
        "forward_backward": {"datums_per_step": 1, "tokens_per_datum": 9},
    }
    got = httpx.post(
        f"{gw.url}/v1/tinker/estimate",
        json={**body, **change},
        headers={"Authorization": f"Bearer {org.key}"},
    )
    assert got.status_code == 400, got.text
    error = got.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert message in error["message"]

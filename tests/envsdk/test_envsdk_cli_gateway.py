"""``envsdk test`` against a running tunegate: an engine serving the tiny model, a gateway in front of it,
and the CLI as a subprocess playing the example packages through the gateway with a tenant's key.

The engine and gateway helpers are the serving tests' own (imported, not copied).
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.support.data import BASE
from tests.support.engine import resources_of
from tests.support.fixtures import gateway_fixture
from tests.support.stack import GatewayServer, Tenant, admin_of

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples" / "envs"


gateway = gateway_fixture("envsdk-gw")


@pytest.fixture
def org(gateway: GatewayServer) -> Tenant:
    return admin_of(gateway).tenant("envsdk-" + secrets.token_hex(3))


def envsdk_test(gateway: GatewayServer, org: Tenant, package: str, *args: str) -> list[dict[str, Any]]:
    """Run ``envsdk test PACKAGE`` through the gateway; every stdout line is one JSON object."""
    cmd = [
        sys.executable,
        "-m",
        "envsdk.cli",
        "test",
        str(EXAMPLES / package),
        "--tasks",
        str(EXAMPLES / package / "tasks.jsonl"),
        "--base-url",
        f"{gateway.url}/v1",
        "--model",
        BASE,
        "--api-key",
        org.key,
        "--max-tokens",
        "12",
        *args,
    ]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def completion_tokens(gateway: GatewayServer, org: Tenant) -> int:
    return sum(
        r.completion_tokens for r in resources_of(gateway).usage.records if r.organization_id == org.org_id
    )


def test_envsdk_test_plays_single_turn_tasks_through_the_gateway(gateway: GatewayServer, org: Tenant) -> None:
    rows = envsdk_test(gateway, org, "arithmetic", "--n", "3", "--samples", "2")
    *episodes, summary = rows
    assert [e["task"] for e in episodes] == [0, 0, 1, 1, 2, 2]
    for episode in episodes:
        assert episode["error"] is None and episode["stop_reason"] == "done" and episode["turns"] == 1
        assert episode["reward"] in (0.0, 0.1, 0.5, 1.0)  # the arithmetic package's reward levels
    rewards = [e["reward"] for e in episodes]
    assert summary == {"episodes": 6, "errors": 0, "mean_reward": pytest.approx(sum(rewards) / 6)}
    # every completion was a metered request of this organisation's key through the gateway
    assert completion_tokens(gateway, org) > 0
    records = [r for r in resources_of(gateway).usage.records if r.organization_id == org.org_id]
    assert len(records) == 6 and {r.api_key_id for r in records} == {org.key_id}


def test_envsdk_test_plays_multi_turn_and_tool_episodes_through_the_gateway(
    gateway: GatewayServer, org: Tenant
) -> None:
    *episodes, summary = envsdk_test(gateway, org, "guess_number", "--n", "2")
    assert len(episodes) == 2 and summary["episodes"] == 2 and summary["errors"] == 0
    for episode in episodes:  # the model guesses until it finds the number or the 6 turns run out
        assert episode["error"] is None and 1 <= episode["turns"] <= 6
        assert episode["stop_reason"] in ("done", "max_turns") and 0.0 <= episode["reward"] <= 1.0
        assert episode["tool_calls"] == 0
    played = sum(e["turns"] for e in episodes)
    assert len([r for r in resources_of(gateway).usage.records if r.organization_id == org.org_id]) == played

    forced = json.dumps({"force_first_tool_call": True})
    *episodes, summary = envsdk_test(gateway, org, "calculator", "--n", "2", "--config", forced, "--verbose")
    assert len(episodes) == 2 and summary["errors"] == 0
    for episode, answer in zip(episodes, ("1517", "6912"), strict=True):
        # turn 1 is the task's calculate call, run in the sandbox; the model wrote the turns after it
        assert episode["tool_calls"] >= 1 and episode["turns"] >= 2 and episode["reward"] >= 0.2
        tool_message = episode["messages"][2]
        assert tool_message["role"] == "tool" and tool_message["content"] == answer
        assert episode["messages"][3]["role"] == "assistant"

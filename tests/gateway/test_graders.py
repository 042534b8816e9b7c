"""`/v1/fine_tuning/alpha/graders/{run,validate}` through the running gateway, in OpenAI's shapes."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from tests.support.stack import GatewayServer, Tenant
from tunegate.quickstart import EXACT

ITEM = {"answer": "Paris", "n": 3}
FUZZY = {
    "type": "text_similarity",
    "name": "fuzzy",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "evaluation_metric": "fuzzy_match",
}
PYTHON = {
    "type": "python",
    "name": "py",
    "source": (
        "import os\n"
        "def grade(sample, item):\n"
        "    # inside the sandbox: an unprivileged uid and a PID namespace of its own\n"
        "    assert os.getuid() != 0 and os.getpid() < 10\n"
        "    return len(sample['output_text']) / (10 * item['n'])\n"
    ),
}


def post(stack: GatewayServer, t: Tenant, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/fine_tuning/alpha/{path}",
        json=body,
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=60,
    )


def run(stack: GatewayServer, t: Tenant, grader: dict[str, Any], sample: str) -> dict[str, Any]:
    resp = post(stack, t, "graders/run", {"grader": grader, "model_sample": sample, "item": ITEM})
    assert resp.status_code == 200, resp.text
    data: dict[str, Any] = resp.json()
    assert set(data) >= {"reward", "sub_rewards", "model_grader_token_usage_per_model", "metadata"}
    assert set(data["metadata"]) >= {"name", "type", "execution_time", "scores", "token_usage", "errors"}
    return data


def test_string_check_and_text_similarity(stack: GatewayServer, tenant: Tenant) -> None:
    assert run(stack, tenant, EXACT, "Paris")["reward"] == 1.0
    wrong = run(stack, tenant, EXACT, "Rome")
    assert wrong["reward"] == 0.0 and wrong["metadata"]["type"] == "string_check"
    assert not any(v for k, v in wrong["metadata"]["errors"].items() if k.endswith("_error"))
    fuzzy = run(stack, tenant, FUZZY, "Pariss")["reward"]
    assert 0.8 < fuzzy < 1.0


def test_multi_and_python_in_the_sandbox(stack: GatewayServer, tenant: Tenant) -> None:
    py = run(stack, tenant, PYTHON, "Paris")
    assert (
        py["reward"] == pytest.approx(5 / 30) and not py["metadata"]["errors"]["python_grader_runtime_error"]
    )
    multi = {
        "type": "multi",
        "name": "both",
        "graders": {"exact": EXACT, "py": PYTHON},
        "calculate_output": "0.5 * exact + 0.5 * py",
    }
    result = run(stack, tenant, multi, "Paris")
    assert result["sub_rewards"] == {"exact": 1.0, "py": pytest.approx(5 / 30)}
    assert result["reward"] == pytest.approx(0.5 + 0.5 * 5 / 30)
    crash = {**PYTHON, "source": "def grade(sample, item):\n    return item['missing']\n"}
    failed = run(stack, tenant, crash, "Paris")
    assert failed["reward"] == 0.0 and failed["metadata"]["errors"]["python_grader_runtime_error"]
    assert "KeyError" in failed["metadata"]["errors"]["python_grader_runtime_error_details"]


def test_validate_and_errors_name_the_field(stack: GatewayServer, tenant: Tenant) -> None:
    ok = post(stack, tenant, "graders/validate", {"grader": EXACT})
    assert ok.status_code == 200 and ok.json() == {"grader": EXACT}
    cases = [
        ({**EXACT, "operation": "startswith"}, "grader.operation"),
        ({**FUZZY, "evaluation_metric": "cosine"}, "grader.evaluation_metric"),
        ({**PYTHON, "source": "def grade(:"}, "grader.source"),
        ({"type": "multi", "graders": {"a": EXACT}, "calculate_output": "a + b"}, "grader.calculate_output"),
        ({"type": "nope"}, "grader.type"),
    ]
    for grader, param in cases:
        for path in ("graders/validate", "graders/run"):
            resp = post(stack, tenant, path, {"grader": grader, "model_sample": "x"})
            assert resp.status_code == 400, (path, resp.text)
            error = resp.json()["error"]
            assert error["param"] == param and error["type"] == "invalid_request_error", error
    anonymous = httpx.post(f"{stack.url}/v1/fine_tuning/alpha/graders/validate", json={"grader": EXACT})
    assert anonymous.status_code == 401

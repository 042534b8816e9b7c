"""Graders: every type, templates, formulas (and the unsafe ones refused), model graders over HTTP."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from envsdk.graders import (
    MODEL_GRADER_DEFAULT_MAX_TOKENS,
    MODEL_GRADER_MAX_TOKENS,
    GraderError,
    grade,
    make_sample,
    model_fields,
    render_template,
    validate_grader,
)
from envsdk.inference_client import InferenceClient, InferenceError
from envsdk.python_grader import PythonGraders

ITEM = {"answer": "Paris", "nested": {"list": [1, "two"]}, "n": 3}


def sc(input_: str, reference: str, operation: str, name: str = "check") -> dict[str, Any]:
    return {
        "type": "string_check",
        "name": name,
        "input": input_,
        "reference": reference,
        "operation": operation,
    }


def sim(metric: str, reference: str = "the cat sat on the mat", name: str = "sim") -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "name": name,
        "input": "{{ sample.output_text }}",
        "reference": reference,
        "evaluation_metric": metric,
    }


def test_graders_import_without_torch() -> None:
    code = (
        "import sys, envsdk, envsdk.graders, trainer.rewards\n"
        "for mod in ('torch', 'rapidfuzz', 'sacrebleu', 'rouge_score', 'simpleeval', 'httpx'):\n"
        "    assert mod not in sys.modules, mod + ' imported'"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


def test_templates() -> None:
    sample = make_sample('{"x": [1, 2]}')
    assert (
        render_template("{{ item.answer }}/{{item.nested.list[1]}}/{{ item.n }}", sample, ITEM)
        == "Paris/two/3"
    )
    assert render_template("{{ sample.output_json.x[1] }}", sample, ITEM) == "2"
    assert render_template("{{ sample.output_text }}", sample, ITEM) == '{"x": [1, 2]}'
    assert render_template("{{ item.nested }}", sample, ITEM) == '{"list": [1, "two"]}'
    tools = make_sample('<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>')["output_tools"]
    assert tools == [{"type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]
    result = grade(sc("{{ item.missing }}", "x", "eq"), "x", ITEM)
    assert result.reward == 0.0 and result.errors["invalid_variable_error"] and result.failed


@pytest.mark.parametrize(
    ("operation", "output", "expected"),
    [
        ("eq", "Paris", 1.0),
        ("eq", "paris", 0.0),
        ("ne", "Rome", 1.0),
        ("ne", "Paris", 0.0),
        ("like", "I think Paris.", 1.0),
        ("like", "i think paris.", 0.0),
        ("ilike", "i think PARIS.", 1.0),
        ("ilike", "Rome", 0.0),
    ],
)
def test_string_check(operation: str, output: str, expected: float) -> None:
    grader = sc("{{ sample.output_text }}", "{{ item.answer }}", operation)
    validate_grader(grader)
    result = grade(grader, output, ITEM)
    assert result.reward == expected
    assert not result.failed and result.name == "check" and result.type == "string_check"


def test_text_similarity_metrics() -> None:
    ref = "the cat sat on the mat"
    exact = {
        m: grade(sim(m), ref).reward for m in ["fuzzy_match", "bleu", "gleu", "rouge_1", "rouge_2", "rouge_l"]
    }
    assert all(v == pytest.approx(1.0) for v in exact.values()), exact
    near = "the cat sat on a mat"
    assert grade(sim("fuzzy_match"), near).reward == pytest.approx(0.9047619, abs=1e-4)
    assert grade(sim("rouge_1"), near).reward == pytest.approx(5 / 6, abs=1e-6)
    assert 0.0 < grade(sim("bleu"), near).reward < 1.0
    assert 0.0 < grade(sim("gleu"), near).reward < 1.0
    assert grade(sim("rouge_l"), "dogs run fast").reward == 0.0


@pytest.mark.parametrize(
    ("metric", "code"), [("cosine", "unsupported_metric"), ("meteor", "unsupported_metric")]
)
def test_refused_metrics(metric: str, code: str) -> None:
    with pytest.raises(GraderError) as err:
        validate_grader(sim(metric))
    assert err.value.code == code and err.value.param == "grader.evaluation_metric"


def python_grader(source: str) -> dict[str, Any]:
    return {"type": "python", "name": "p", "source": source}


def test_python_grader_runs_in_the_sandbox() -> None:
    source = (
        "import os\n"
        "def grade(sample, item):\n"
        "    assert os.getuid() != 0 and os.getpid() < 10, 'not sandboxed'\n"
        "    return 1.0 if sample['output_text'] == item['answer'] else 0.25\n"
    )
    validate_grader(python_grader(source))
    with PythonGraders() as sandboxes:
        assert grade(python_grader(source), "Paris", ITEM, python=sandboxes).reward == 1.0
        assert grade(python_grader(source), "Rome", ITEM, python=sandboxes).reward == 0.25
        inside = grade(python_grader("import os\ndef grade(s, i):\n    return os.getuid()\n"), "x", ITEM)
    assert inside.reward not in (0, os.getuid()) and not inside.failed  # the sandbox's own uid


def test_python_grader_failures_are_data() -> None:
    raising = grade(python_grader("def grade(sample, item):\n    raise KeyError('answer')\n"), "x", ITEM)
    assert raising.reward == 0.0 and raising.errors["python_grader_runtime_error"]
    assert "KeyError" in raising.errors["python_grader_runtime_error_details"]
    with PythonGraders(timeout_s=1.0) as sandboxes:
        loop = grade(
            python_grader("def grade(s, i):\n    while True:\n        pass\n"), "x", ITEM, python=sandboxes
        )
    assert loop.reward == 0.0 and loop.errors["python_grader_runtime_error"]
    assert "timeout" in loop.errors["python_grader_runtime_error_details"]
    for source, message in [("def grade(:", "not valid Python"), ("x = 1", "grade(sample, item)")]:
        with pytest.raises(GraderError) as err:
            validate_grader(python_grader(source))
        assert err.value.param == "grader.source" and message in err.value.message


def test_multi_with_formula() -> None:
    grader: dict[str, Any] = {
        "type": "multi",
        "name": "combo",
        "graders": {
            "exact": sc("{{ sample.output_text }}", "{{ item.answer }}", "ilike"),
            "close": sim("fuzzy_match", "{{ item.answer }}"),
        },
        "calculate_output": "0.5 * exact + 0.5 * sqrt(close) - 0 * max(exact, close)",
    }
    validate_grader(grader)
    result = grade(grader, "paris!", ITEM)
    assert result.sub_rewards["exact"] == 1.0
    assert result.sub_rewards["close"] == pytest.approx(grade(sim("fuzzy_match", "Paris"), "paris!").reward)
    assert result.reward == pytest.approx(0.5 + 0.5 * result.sub_rewards["close"] ** 0.5)
    response = result.to_response()
    assert response["metadata"]["type"] == "multi" and response["metadata"]["scores"] == result.sub_rewards
    # A list of named graders is accepted too; a runtime failure of the formula is an error flag, not a crash.
    as_list = {**grader, "graders": [{**g, "name": n} for n, g in grader["graders"].items()]}
    validate_grader(as_list)
    failing = {**grader, "calculate_output": "exact / (close - close)"}
    bad = grade(failing, "paris", ITEM)
    assert bad.reward == 0.0 and bad.errors["formula_parse_error"]


@pytest.mark.parametrize(
    "formula",
    [
        "__import__('os').system('true')",
        "exact.__class__",
        "exact.real",
        "'a' * 10",
        "[exact][0]",
        "(lambda: 1)()",
        "open('/etc/passwd')",
        "unknown + 1",
        "exact +",
    ],
)
def test_unsafe_or_bad_formula_refused(formula: str) -> None:
    grader = {"type": "multi", "graders": {"exact": sc("a", "a", "eq")}, "calculate_output": formula}
    with pytest.raises(GraderError) as err:
        validate_grader(grader)
    assert err.value.param == "grader.calculate_output"


@pytest.mark.parametrize(
    ("grader", "param"),
    [
        ({"type": "nope"}, "grader.type"),
        (
            {"type": "string_check", "input": "a", "reference": "b", "operation": "contains"},
            "grader.operation",
        ),
        ({"type": "string_check", "input": 1, "reference": "b", "operation": "eq"}, "grader.input"),
        ({"type": "score_model", "model": "m", "input": [], "range": [0, 1]}, "grader.input"),
        (
            {
                "type": "score_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "range": [1, 0],
            },
            "grader.range",
        ),
        (
            {"type": "multi", "graders": {"a": {"type": "python", "source": ""}}, "calculate_output": "a"},
            "grader.graders.a.source",
        ),
        (
            {
                "type": "label_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "labels": ["a"],
                "passing_labels": ["a"],
                "sampling_params": {"max_completions_tokens": MODEL_GRADER_MAX_TOKENS + 1},
            },
            "grader.sampling_params.max_completions_tokens",
        ),
        (
            {
                "type": "score_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "sampling_params": {"max_tokens": 0},
            },
            "grader.sampling_params.max_tokens",
        ),
        (
            {
                "type": "score_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "sampling_params": [],
            },
            "grader.sampling_params",
        ),
        (
            {
                "type": "label_model",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "labels": ["a"],
                "passing_labels": [["a"]],
            },
            "grader.passing_labels",
        ),
    ],
)
def test_validation_names_the_field(grader: dict[str, Any], param: str) -> None:
    with pytest.raises(GraderError) as err:
        validate_grader(grader)
    assert err.value.param == param


class _ModelServer:
    """A stand-in chat-completions endpoint answering with queued replies (or queued error answers:
    `(status, code, retry_after)`), recording requests."""

    def __init__(self) -> None:
        self.replies: list[str] = []
        self.errors: list[tuple[int, str, str | None]] = []
        self.requests: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.requests.append({"path": self.path, "auth": self.headers.get("Authorization"), **body})
                if server.errors:
                    status, code, retry_after = server.errors.pop(0)
                    error = {"message": f"refused: {code}", "type": "requests", "param": None, "code": code}
                    data = json.dumps({"error": error}).encode()
                    self.send_response(status)
                    if retry_after is not None:
                        self.send_header("retry-after", retry_after)
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                    return
                reply = {
                    "id": "c1",
                    "object": "chat.completion",
                    "choices": [
                        {"index": 0, "message": {"role": "assistant", "content": server.replies.pop(0)}}
                    ],
                    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
                }
                data = json.dumps(reply).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture
def model_server() -> Iterator[_ModelServer]:
    server = _ModelServer()
    yield server
    server.httpd.shutdown()


def test_score_model_and_label_model(model_server: _ModelServer) -> None:
    score = {
        "type": "score_model",
        "name": "judge",
        "model": "tiny-chat",
        "input": [
            {"role": "system", "content": "Score the answer from 0 to 10."},
            {
                "role": "user",
                "content": "Q: capital of France. Reference {{ item.answer }}. A: {{ sample.output_text }}",
            },
        ],
        "range": [0, 10],
        "sampling_params": {"temperature": 0.0},
    }
    label = {
        "type": "label_model",
        "name": "tone",
        "model": "tiny-chat",
        "input": [{"role": "user", "content": "Is '{{ sample.output_text }}' polite?"}],
        "labels": ["polite", "rude"],
        "passing_labels": ["polite"],
    }
    multi = {"type": "multi", "name": "m", "graders": {"tone": label}, "calculate_output": "tone"}
    for g in (score, multi):
        validate_grader(g)
    with InferenceClient(model_server.url, "sk-test") as client:
        model_server.replies = ["Score: 8", '{"result": 42}', "garbage", "Polite.", "rude"]
        assert grade(score, "Paris", ITEM, inference=client).reward == 8.0
        clamped = grade(score, "Paris", ITEM, inference=client)
        assert clamped.reward == 10.0 and clamped.token_usage == {
            "tiny-chat": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}
        }
        unparsable = grade(score, "Paris", ITEM, inference=client)
        assert unparsable.reward == 0.0 and unparsable.errors["model_grader_parse_error"]
        assert grade(multi, "Thanks!", ITEM, inference=client).reward == 1.0
        assert grade(multi, "Go away", ITEM, inference=client).reward == 0.0
    first = model_server.requests[0]
    assert first["path"] == "/v1/chat/completions" and first["auth"] == "Bearer sk-test"
    assert first["model"] == "tiny-chat" and first["temperature"] == 0.0
    assert first["messages"][1]["content"] == "Q: capital of France. Reference Paris. A: Paris"
    # No cap of their own: the default one (a reply of a score or a label is short).
    assert {r["max_completion_tokens"] for r in model_server.requests} == {MODEL_GRADER_DEFAULT_MAX_TOKENS}


def test_model_grader_token_caps_and_models(model_server: _ModelServer) -> None:
    judge = {
        "type": "score_model",
        "name": "judge",
        "model": "tiny-chat",
        "input": [{"role": "user", "content": "{{ sample.output_text }}"}],
        "sampling_params": {"max_completions_tokens": 5, "seed": 1},  # OpenAI's spelling
    }
    tone = {**judge, "name": "tone", "model": "other", "sampling_params": {"max_tokens": 7}}
    multi = {"type": "multi", "graders": {"judge": judge, "tone": tone}, "calculate_output": "judge + tone"}
    validate_grader(multi)
    assert model_fields(multi) == [
        ("tiny-chat", "grader.graders.judge.model"),
        ("other", "grader.graders.tone.model"),
    ]
    assert model_fields(judge, param="method.reinforcement.grader") == [
        ("tiny-chat", "method.reinforcement.grader.model")
    ]
    with InferenceClient(model_server.url) as client:
        model_server.replies = ["1", "0"]
        assert grade(multi, "x", ITEM, inference=client).reward == 1.0
    sent = [
        {k: r.get(k) for k in ("max_completion_tokens", "max_completions_tokens", "max_tokens", "seed")}
        for r in model_server.requests
    ]
    assert sent == [
        {"max_completion_tokens": 5, "max_completions_tokens": None, "max_tokens": None, "seed": 1},
        {"max_completion_tokens": 7, "max_completions_tokens": None, "max_tokens": None, "seed": None},
    ]


def test_model_grader_unreachable_is_a_server_error() -> None:
    grader = {"type": "score_model", "name": "j", "model": "m", "input": [{"role": "user", "content": "x"}]}
    with InferenceClient("http://127.0.0.1:9/v1", max_retries=0, timeout=2) as client:
        result = grade(grader, "x", {}, inference=client)
    assert result.reward == 0.0 and result.errors["model_grader_server_error"]
    assert result.errors["model_grader_server_error_details"]
    no_client = grade(grader, "x", {})
    assert no_client.errors["model_grader_server_error"]


def test_refusals_keep_the_servers_error_and_short_rate_limits_are_waited_out(
    model_server: _ModelServer,
) -> None:
    with InferenceClient(model_server.url, max_retries=1, max_wait_s=1.0) as client:
        model_server.errors = [(429, "rate_limit_exceeded", "0")]
        model_server.replies = ["fine"]
        assert client.chat("m", [{"role": "user", "content": "x"}]).text == "fine"  # waited, then retried
        model_server.errors = [(429, "insufficient_quota", "0"), (429, "rate_limit_exceeded", "60")]
        for code in ("insufficient_quota", "rate_limit_exceeded"):  # the budget, or a wait too long
            with pytest.raises(InferenceError) as refused:
                client.chat("m", [{"role": "user", "content": "x"}])
            assert refused.value.status == 429 and refused.value.error is not None
            assert refused.value.error["code"] == code and f"({code})" in str(refused.value)
        assert refused.value.retry_after == "60"
        model_server.errors = [(404, "model_not_found", None)]
        with pytest.raises(InferenceError) as missing:
            client.chat("m", [{"role": "user", "content": "x"}])
        assert missing.value.status == 404 and missing.value.error == {
            "message": "refused: model_not_found",
            "type": "requests",
            "param": None,
            "code": "model_not_found",
        }
    assert len(model_server.requests) == 5  # nothing else was retried

"""One tenant's worst inputs never freeze another's requests.

Organisation A sends what stalled a shared gateway before: multi-megabyte python grader sources, megabyte
`text_similarity` strings, a 10 MB prompt, and dozens of sandboxed calls that sleep. Each gets a clear 4xx
in OpenAI's envelope where it should (nothing over a cap is parsed, scored or tokenized), and while A's
requests are in flight organisation B's chat completion, file upload and model list all succeed. No timing
is asserted: `bench/stalls.py` measures B's latency under the same inputs.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from envsdk.archive import pack
from gateway.offload import Offload
from tests.support.engine import EngineServer
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant

MB = 1024 * 1024
MESSAGES: Any = [{"role": "user", "content": "What is 2 + 2?"}]
GRADE = "def grade(sample, item):\n    return 1.0\n"
SLEEPY = """import time

from envsdk import SingleTurnEnv


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        time.sleep(8)
        return 1.0
"""
QUICK = """from envsdk import SingleTurnEnv


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        return 1.0 if completion == "4" else 0.0
"""


def _sandbox_works() -> bool:
    from envsdk.sandbox import probe_backend

    return probe_backend("bwrap") or probe_backend("unshare")


gw = gateway_fixture("stalls")


@pytest.fixture
def a(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("a-" + secrets.token_hex(3))


@pytest.fixture
def b(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("b-" + secrets.token_hex(3))


def offload(gw: GatewayServer) -> Offload:
    app: Any = gw.server.config.app
    state = app.state.resources.offload
    assert isinstance(state, Offload)
    return state


def api(gw: GatewayServer, t: Tenant) -> httpx.Client:
    return httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {t.key}"}, timeout=120)


def refused(resp: httpx.Response, status: int, param: str | None, code: str) -> dict[str, Any]:
    """The error of a refused request: its status, OpenAI's envelope, the field and the code."""
    assert resp.status_code == status, resp.text[:2000]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param and error["code"] == code, error
    return dict(error)


def b_is_served(b: Tenant) -> None:
    """B's chat completion, file upload and model list all succeed."""
    chat = b.client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=4)
    assert chat.choices[0].message is not None and chat.usage is not None
    row = {"messages": [*MESSAGES, {"role": "assistant", "content": "4"}]}
    upload = b.client.files.create(file=("b.jsonl", json.dumps(row).encode()), purpose="fine-tune")
    assert upload.status == "processed" or upload.id.startswith("file-")
    assert "tiny-chat" in {m.id for m in b.client.models.list()}


def while_a_sends(
    sends: list[Callable[[], httpx.Response]], b: Tenant, copies: int = 3
) -> list[httpx.Response]:
    """Each of A's requests `copies` times at once; B is served while they are in flight. A's answers."""
    with ThreadPoolExecutor(max_workers=len(sends) * copies) as pool:
        futures: list[Future[httpx.Response]] = [pool.submit(send) for send in sends for _ in range(copies)]
        b_is_served(b)
        return [f.result() for f in futures]


# ------------------------------------------------------------------------------------ grader sources
def test_multi_megabyte_python_sources_are_refused_before_any_parse(
    gw: GatewayServer, a: Tenant, b: Tenant
) -> None:
    cap = gw.settings.grader_max_source_bytes
    big = GRADE + "x = 1\n" * (MB // 6)  # 1 MB: under the body cap, over the source cap
    grader = {"type": "python", "name": "big", "source": big}
    huge = {"grader": {"type": "python", "source": GRADE + "x = 1\n" * (4 * MB // 6)}}  # over the body cap
    job = {
        "model": "tiny-chat",
        "training_file": "file-unused",
        "method": {"type": "reinforcement", "reinforcement": {"grader": grader}},
    }
    evaluation = {
        "data_source_config": {"type": "custom", "item_schema": {"type": "object"}},
        "testing_criteria": [grader],
    }
    run = {"grader": grader, "model_sample": "4"}
    with api(gw, a) as http:
        answers = while_a_sends(
            [
                lambda: http.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": grader}),
                lambda: http.post("/v1/fine_tuning/alpha/graders/run", json=run),
                lambda: http.post("/v1/fine_tuning/jobs", json=job),
                lambda: http.post("/v1/evals", json=evaluation),
                lambda: http.post("/v1/fine_tuning/alpha/graders/validate", json=huge),
            ],
            b,
        )
    params = [
        "grader.source",
        "grader.source",
        "method.reinforcement.grader.source",
        "testing_criteria[0].source",
    ]
    for answer, param in zip(answers[:12], [p for p in params for _ in range(3)], strict=True):
        error = refused(answer, 400, param, "string_above_max_length")
        assert str(cap) in error["message"]
    for answer in answers[12:]:
        refused(answer, 413, None, "request_too_large")


def test_large_sources_under_the_cap_are_parsed_off_the_loop(gw: GatewayServer, a: Tenant, b: Tenant) -> None:
    # 200 KiB: parsed in the CPU pool (a quarter of a second of the interpreter's lock each), not in place
    body = "x = 1\n" * (200 * 1024 // 6)
    good = {"type": "python", "source": body + GRADE}
    broken = {"type": "python", "source": body + "def grade(sample, item):\n    return (\n"}
    nameless = {"type": "python", "source": body}
    with api(gw, a) as http:

        def validate(grader: dict[str, Any]) -> Callable[[], httpx.Response]:
            return lambda: http.post("/v1/fine_tuning/alpha/graders/validate", json={"grader": grader})

        answers = while_a_sends([validate(good), validate(broken), validate(nameless)], b, copies=1)
        ran = http.post("/v1/fine_tuning/alpha/graders/run", json={"grader": good, "model_sample": "4"})
    assert answers[0].status_code == 200, answers[0].text
    assert "not valid Python" in refused(answers[1], 400, "grader.source", "invalid_grader")["message"]
    assert "grade(sample, item)" in refused(answers[2], 400, "grader.source", "invalid_grader")["message"]
    if _sandbox_works():
        assert ran.status_code == 200 and ran.json()["reward"] == 1.0, ran.text


# --------------------------------------------------------------------------------- text_similarity
def test_megabyte_text_similarity_strings_are_refused_before_scoring(
    gw: GatewayServer, a: Tenant, b: Tenant
) -> None:
    cap = gw.settings.grader_max_text_chars
    text = "lorem ipsum " * (MB // 12)

    def similarity(reference: str, metric: str = "rouge_l") -> dict[str, Any]:
        return {
            "type": "text_similarity",
            "name": "sim",
            "input": "{{ sample.output_text }}",
            "reference": reference,
            "evaluation_metric": metric,
        }

    with api(gw, a) as http:

        def run(grader: dict[str, Any], sample: str, item: dict[str, Any] | None = None) -> Callable[[], Any]:
            body = {"grader": grader, "model_sample": sample, "item": item or {}}
            return lambda: http.post("/v1/fine_tuning/alpha/graders/run", json=body)

        answers = while_a_sends(
            [
                run(similarity("lorem"), text),  # the sample
                run(similarity(text, "fuzzy_match"), "lorem"),  # a literal reference
                run(similarity("{{ item.ref }}"), "lorem", {"ref": text}),  # a reference from the item
                run(
                    {
                        "type": "multi",
                        "graders": {"s": similarity("{{ item.ref }}")},
                        "calculate_output": "s",
                    },
                    "lorem",
                    {"ref": text},
                ),
            ],
            b,
            copies=1,  # two of them take a share of A's (their texts are measured in the CPU pool)
        )
        within = http.post(
            "/v1/fine_tuning/alpha/graders/run",
            json={
                "grader": similarity("{{ item.ref }}"),
                "model_sample": "lorem ipsum",
                "item": {"ref": "lorem"},
            },
        )
    expected = ["model_sample", "grader.reference", "grader.reference", "grader.graders.s.reference"]
    for answer, param in zip(answers, expected, strict=True):
        assert str(cap) in refused(answer, 400, param, "string_above_max_length")["message"]
    assert within.status_code == 200 and 0.0 < within.json()["reward"] < 1.0, within.text


# ------------------------------------------------------------------------------------------- prompts
def test_a_ten_megabyte_prompt_is_refused_and_a_long_one_never_tokenized(
    gw: GatewayServer, engine: EngineServer, a: Tenant, b: Tenant
) -> None:
    cap = gw.settings.max_request_body_bytes
    huge = "lorem ipsum " * (10 * MB // 12)  # 10 MB: over the body cap
    long = "lorem ipsum " * (MB // 12)  # 1 MB: under it, far over the tiny model's context
    chat = "/v1/chat/completions"

    def chunks(data: bytes) -> Iterator[bytes]:
        for i in range(0, len(data), 64 * 1024):
            yield data[i : i + 64 * 1024]

    with api(gw, a) as http:
        big_body = json.dumps(
            {"model": "tiny-chat", "messages": [{"role": "user", "content": huge}]}
        ).encode()
        answers = while_a_sends(
            [
                lambda: http.post(
                    chat, json={"model": "tiny-chat", "messages": [{"role": "user", "content": huge}]}
                ),
                lambda: http.post("/v1/completions", json={"model": "tiny-chat", "prompt": huge}),
                # no Content-Length: refused once the streamed body passes the cap
                lambda: http.post(
                    chat, content=chunks(big_body), headers={"content-type": "application/json"}
                ),
                lambda: http.post(
                    chat, json={"model": "tiny-chat", "messages": [{"role": "user", "content": long}]}
                ),
                lambda: http.post("/v1/completions", json={"model": "tiny-chat", "prompt": long}),
                # a routed JSON body over the cap is refused the same way
                lambda: http.post("/v1/fine_tuning/alpha/graders/validate", content=big_body),
            ],
            b,
        )
    for answer in answers[:9] + answers[15:]:
        error = refused(answer, 413, None, "request_too_large")
        assert str(cap) in error["message"] and error["type"] == "invalid_request_error"
    for answer in answers[9:12]:
        assert "context" in refused(answer, 400, "messages", "context_length_exceeded")["message"]
    for answer in answers[12:15]:
        refused(answer, 400, "prompt", "context_length_exceeded")
    direct = httpx.post(
        f"{engine.url}/v1/chat/completions",
        json={"model": "tiny-chat", "messages": [{"role": "user", "content": long}]},
        timeout=60,
    )
    assert direct.status_code == 400 and direct.json()["error"]["code"] == "context_length_exceeded"


# -------------------------------------------------------------------------------------- sandboxes
def _upload_package(t: Tenant, code: str, tmp_path: Path) -> str:
    src = tmp_path / f"pkg-{secrets.token_hex(3)}"
    src.mkdir()
    (src / "environment.toml").write_text(
        'name = "pkg"\nversion = "0.1.0"\nentrypoint = "env:Env"\n\n[limits]\ntimeout_s = 30\n'
    )
    (src / "env.py").write_text(code)
    archive, _ = pack(src, tmp_path / f"{src.name}.tar.gz")
    return t.client.files.create(file=(archive.name, archive.read_bytes()), purpose="environment").id


@pytest.mark.skipif(not _sandbox_works(), reason="no sandbox backend here: install bubblewrap")
def test_sleeping_environment_runs_take_only_their_tenants_share(
    gw: GatewayServer, a: Tenant, b: Tenant, tmp_path: Path
) -> None:
    share = gw.settings.sandbox_slots_per_organization
    assert share < gw.settings.sandbox_slots
    sleepy = _upload_package(a, SLEEPY, tmp_path)
    quick = _upload_package(b, QUICK, tmp_path)
    task = {"messages": MESSAGES}
    calls = 44  # more than anyio's default thread pool holds (40): once they took it all
    with api(gw, a) as http_a, api(gw, b) as http_b, ThreadPoolExecutor(max_workers=calls) as pool:
        run = {"file_id": sleepy, "task": task, "completion": "4"}
        futures = [
            pool.submit(http_a.post, "/v1/fine_tuning/alpha/environments/run", json=run) for _ in range(calls)
        ]
        work = offload(gw)
        while work.running(a.org_id) < share and not all(f.done() for f in futures):
            time.sleep(0.05)  # until A holds its whole share (its runs sleep for seconds)
        assert work.running(a.org_id) <= share
        # A at its share: one more of A's sandboxed calls, an upload check included, is refused at once
        with pytest.raises(openai.RateLimitError) as err:
            _upload_package(a, QUICK, tmp_path)
        assert err.value.code == "concurrency_limit_exceeded"
        # B is served, its own sandboxed call included
        b_is_served(b)
        mine = http_b.post(
            "/v1/fine_tuning/alpha/environments/run", json={"file_id": quick, "task": task, "completion": "4"}
        )
        assert mine.status_code == 200 and mine.json()["reward"] == 1.0, mine.text
        assert work.running(a.org_id) <= share
        answers = [f.result() for f in futures]
    ran = [r for r in answers if r.status_code == 200]
    turned_away = [r for r in answers if r.status_code != 200]
    assert ran and turned_away
    assert all(r.json()["reward"] == 1.0 for r in ran)
    for answer in turned_away:
        error = refused(answer, 429, None, "concurrency_limit_exceeded")
        assert error["type"] == "requests" and answer.headers["retry-after"]
    assert work.running(a.org_id) == 0 and work.running(b.org_id) == 0

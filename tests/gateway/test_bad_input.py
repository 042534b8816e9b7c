"""Bad input is never a 5xx: each is a 4xx in OpenAI's error envelope, its `param` naming the field.

NUL bytes, integers beyond 64 bits, NaN and Infinity, unpaired surrogates, deep nesting, out-of-range times,
malformed environment tasks and answers, absurd budgets and token counts, uploads over the cap, archive
header bombs, empty idempotency keys, hyperparameters out of range once resolved; and error bodies stay
small whatever the input, their `message` one sentence.
"""

from __future__ import annotations

import asyncio
import gzip
import io
import json
import socket
import tarfile
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest

from envsdk.archive import pack
from tests.support.data import BASE, HELLO_SFT, RFT, SAYS_YES
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Services, Tenant, admin_of, start_gateway
from trainer.contract import base_learning_rate, model_defaults

MESSAGES: Any = [{"role": "user", "content": "Say hi."}]
JOB = {"model": "tiny-chat", "training_file": "file-x"}
JOBS = "/v1/fine_tuning/jobs"
CHAT = "/v1/chat/completions"
ENV_RUN = "/v1/fine_tuning/alpha/environments/run"
USAGE = "/v1/organization/usage/completions"
MULTI_TURN = """from envsdk import MultiTurnEnv, StepResult


class Env(MultiTurnEnv):
    def step(self, assistant_message):
        return StepResult(reward="lots", done=True)
"""


def refused(resp: httpx.Response, param: str | None, status: int = 400) -> dict[str, Any]:
    """The error of a refused request: the status, OpenAI's envelope, the field it names."""
    assert resp.status_code == status, resp.text[:2000]
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    if param is not None:
        assert error["param"] == param, error
    return dict(error)


def http(stack: GatewayServer, key: str) -> httpx.Client:
    return httpx.Client(base_url=stack.url, headers={"Authorization": f"Bearer {key}"}, timeout=60)


def post_raw(client: httpx.Client, path: str, body: bytes) -> httpx.Response:
    return client.post(path, content=body, headers={"content-type": "application/json"})


def multipart(fields: dict[str, bytes], filename: bytes, data: bytes) -> tuple[bytes, str]:
    """A multipart body written byte for byte (httpx would escape a NUL in the filename)."""
    boundary = b"tunegate-test-boundary"
    out = b""
    for name, value in fields.items():
        out += b"--" + boundary + b'\r\nContent-Disposition: form-data; name="' + name.encode() + b'"\r\n\r\n'
        out += value + b"\r\n"
    out += b"--" + boundary + b'\r\nContent-Disposition: form-data; name="file"; filename="'
    out += filename + b'"\r\n'
    out += b"Content-Type: application/octet-stream\r\n\r\n" + data + b"\r\n--" + boundary + b"--\r\n"
    return out, f"multipart/form-data; boundary={boundary.decode()}"


# ----------------------------------------------------------------------------------------------- text
def test_nul_bytes_are_refused_naming_the_field(stack: GatewayServer, tenant: Tenant, admin: Admin) -> None:
    with http(stack, tenant.key) as api:
        refused(api.get("/v1/files/file-%00x"), "file_id")
        refused(api.get("/v1/files", params={"after": "file-\x00"}), "after")
        refused(api.get("/v1/fine_tuning/jobs", params={"metadata[team]": "a\x00"}), "metadata[team]")
        refused(api.get(USAGE, params={"start_time": 0, "models[]": "\x00"}), "models[]")
        body, ctype = multipart({"purpose": b"fine-tune"}, b"a\x00.jsonl", b'{"a": 1}\n')
        refused(api.post("/v1/files", content=body, headers={"content-type": ctype}), "file")
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.fine_tuning.jobs.create(**JOB, metadata={"team": "a\x00b"})
    assert err.value.param == "metadata.team"
    refused(admin.http.post("/v1/admin/organizations", json={"name": "acme\x00"}), "name")
    refused(admin.http.get("/v1/admin/organizations/org-%00"), "org_id")


def test_unpaired_surrogates_nan_and_infinity_are_refused(stack: GatewayServer, tenant: Tenant) -> None:
    with http(stack, tenant.key) as api:
        for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e400"):
            refused(post_raw(api, JOBS, b'{"model": "tiny-chat", "seed": ' + literal + b"}"), "seed")
            chat = b'{"model": "tiny-chat", "messages": [], "temperature": ' + literal + b"}"
            refused(post_raw(api, CHAT, chat), "temperature")
        refused(post_raw(api, JOBS, b'{"model": "tiny-chat", "suffix": "a\\ud800"}'), "suffix")
        chat = b'{"model": "tiny-chat", "messages": [{"role": "user", "content": "\\udc00"}]}'
        refused(post_raw(api, CHAT, chat), "messages[0].content")


def test_deep_nesting_is_refused_in_bodies_and_uploads(stack: GatewayServer, tenant: Tenant) -> None:
    deep = b'{"a": ' * 100 + b"1" + b"}" * 100
    deeper = b"[" * 5000 + b"]" * 5000
    with http(stack, tenant.key) as api:
        error = refused(post_raw(api, JOBS, b'{"model": "m", "metadata": ' + deep + b"}"), None)
        assert error["param"].startswith("metadata.a.a") and "nest" in error["message"]
        refused(post_raw(api, JOBS, b'{"model": "m", "metadata": ' + deeper + b"}"), None)
        refused(post_raw(api, CHAT, b'{"model": "tiny-chat", "messages": ' + deeper + b"}"), None)
        refused(post_raw(api, "/v1/fine_tuning/alpha/graders/validate", b'{"grader": ' + deep + b"}"), None)
    lines = {
        b'{"messages": ' + b"[" * 100 + b"]" * 100 + b"}": "nest",
        b'{"messages": [], "x": NaN}': "NaN",
        b'{"messages": [], "x": 123456789012345678901234567890}': "64 bits",
        b'{"messages": [], "x": "a\\u0000"}': "NUL",
        b'{"messages": [], "x": "\\ud800"}': "surrogates",
    }
    for line, problem in lines.items():
        with pytest.raises(openai.BadRequestError) as err:
            tenant.client.files.create(
                file=("t.jsonl", b'{"messages": []}\n' + line + b"\n"), purpose="fine-tune"
            )
        assert err.value.param == "file" and "Line 2" in err.value.message and problem in err.value.message


def test_eval_run_files_are_held_to_the_same_json_rules(tenant: Tenant) -> None:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
    criterion: Any = {
        "type": "string_check",
        "name": "exact",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.q }}",
        "operation": "eq",
    }
    ev = tenant.client.evals.create(
        data_source_config={"type": "custom", "item_schema": schema}, testing_criteria=[criterion]
    )
    for line, problem in ((b'{"item": ' * 100 + b"{}" + b"}" * 100, "nest"), (b'{"q": NaN}', "NaN")):
        data = b'{"item": {"q": "a"}}\n' + line + b"\n"
        file_id = tenant.client.files.create(file=("items.jsonl", data), purpose="evals").id
        source = {"type": "file_id", "id": file_id}
        with pytest.raises(openai.BadRequestError) as err:
            tenant.client.evals.runs.create(
                ev.id,
                data_source={  # type: ignore[arg-type]
                    "type": "completions",
                    "model": "tiny-chat",
                    "source": source,
                    "input_messages": {"type": "template", "template": [{"role": "user", "content": "hi"}]},
                },
            )
        assert err.value.param == "data_source.source.id" and "Line 2" in err.value.message
        assert problem in err.value.message


# ------------------------------------------------------------------------------------------- numbers
def test_integers_beyond_64_bits_are_refused(stack: GatewayServer, tenant: Tenant, admin: Admin) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.fine_tuning.jobs.create(**JOB, seed=2**64)
    assert err.value.param == "seed"
    with pytest.raises(openai.BadRequestError) as err:
        integrations: Any = [{"type": "wandb", "wandb": {"project": "p", "entity": 2**70}}]
        tenant.client.fine_tuning.jobs.create(**JOB, integrations=integrations)
    assert err.value.param == "integrations[0].wandb.entity"
    with http(stack, tenant.key) as api:
        run = {"file_id": "file-x", "task": {"prompt": "2+2"}, "completion": "4", "config": {"n": -(2**65)}}
        refused(api.post("/v1/fine_tuning/alpha/environments/run", json=run), "config.n")
    limits = f"/v1/admin/organizations/{tenant.org_id}/limits"
    refused(admin.http.post(limits, json={"max_requests_per_1_minute": 2**70}), "max_requests_per_1_minute")
    # within 64 bits but beyond the column's 32: refused by the model, not by the database
    refused(admin.http.post(limits, json={"max_tokens_per_1_minute": 2**40}), "max_tokens_per_1_minute")
    refused(admin.http.get("/v1/admin/billing/outbox", params={"after": "9" * 30}), "after")


@pytest.mark.parametrize("path", ["/v1/organization/usage/completions", "/v1/organization/costs"])
def test_out_of_range_times_are_refused_never_a_503(stack: GatewayServer, tenant: Tenant, path: str) -> None:
    year_9999 = 253_402_300_799
    with http(stack, tenant.key) as api:
        for value in (10**12, -(10**12), 10**20, -35184372088833):
            refused(api.get(path, params={"start_time": value}), "start_time")
            refused(api.get(path, params={"start_time": 0, "end_time": value}), "end_time")
        refused(api.get(path, params={"start_time": 0, "page": str(10**20)}), "page")
        refused(api.get(path, params={"start_time": 0, "page": "-86400"}), "page")
        last_day = api.get(path, params={"start_time": year_9999 - 1000, "end_time": year_9999})
        assert last_day.status_code == 200, last_day.text
        assert last_day.json()["data"][-1]["end_time"] == year_9999


# ---------------------------------------------------------------------------------------- completions
def test_completions_refuse_bad_counts_before_any_engine(stack: GatewayServer, tenant: Tenant) -> None:
    """The fast proxy path checks what it relies on; `max_tokens` beyond the model's context (2048 for the
    tiny model, from its config.json) is refused, not clamped."""
    chat = tenant.client.chat.completions
    with pytest.raises(openai.BadRequestError) as err:
        chat.create(model="tiny-chat", messages=MESSAGES, max_tokens=10**9)
    assert err.value.param == "max_tokens" and "2048" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        chat.create(model="tiny-chat", messages=MESSAGES, max_completion_tokens=2049)
    assert err.value.param == "max_completion_tokens"
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.completions.create(model="tiny-chat", prompt="hi", max_tokens=10**9)
    assert err.value.param == "max_tokens"
    for field, value in (("n", 1000), ("seed", 2**70), ("max_tokens", 0), ("max_tokens", 1e9)):
        with pytest.raises(openai.BadRequestError) as err:
            chat.create(model="tiny-chat", messages=MESSAGES, extra_body={field: value})
        assert err.value.param == field
    with pytest.raises(openai.BadRequestError) as err:
        chat.create(model="ft:tiny-chat:\x00", messages=MESSAGES)
    assert err.value.param == "model"


# --------------------------------------------------------------------------------------------- budgets
served = gateway_fixture("bad-input", scope="function")


async def _store_budget(database: str, org_id: str, value: float) -> None:
    conn = await asyncpg.connect(database)
    try:
        await conn.execute(
            "INSERT INTO organization_billing (organization_id, monthly_budget_usd) VALUES ($1, $2)"
            " ON CONFLICT (organization_id) DO UPDATE SET monthly_budget_usd = EXCLUDED.monthly_budget_usd",
            org_id,
            value,
        )
    finally:
        await conn.close()


def test_absurd_budgets_are_refused_and_never_break_completions(served: GatewayServer, database: str) -> None:
    admin = admin_of(served)
    for value in ("Infinity", "1e303"):
        org = admin.tenant("budget")
        billing = f"/v1/admin/organizations/{org.org_id}/billing"
        refused(
            post_raw(admin.http, billing, f'{{"monthly_budget_usd": {value}}}'.encode()), "monthly_budget_usd"
        )
        # A budget stored before budgets were capped still lets every completion through.
        asyncio.run(_store_budget(database, org.org_id, float(value)))
        for _ in range(2):
            reply = org.client.chat.completions.create(model="tiny-chat", messages=MESSAGES, max_tokens=2)
            assert reply.choices[0].message.content is not None


# ---------------------------------------------------------------------------------------------- uploads
def test_an_upload_over_the_cap_is_refused_before_its_body_is_read(
    stack: GatewayServer,
    tenant: Tenant,
    services: Services,
    database: str,
    tiny_model_dir: Path,
    tmp_path: Path,
) -> None:
    cap = stack.settings.max_upload_bytes
    # Declares a terabyte and sends a few bytes: the answer comes at once, without waiting for the rest.
    with socket.create_connection(("127.0.0.1", stack.port), timeout=20) as sock:
        sock.sendall(
            b"POST /v1/files HTTP/1.1\r\nHost: gateway\r\nAuthorization: Bearer "
            + tenant.key.encode()
            + b"\r\n"
            b"Content-Type: multipart/form-data; boundary=x\r\nContent-Length: 1000000000000\r\n\r\n--x\r\n"
        )
        head, _, body = sock.recv(65536).partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), head
    assert str(cap).encode() in body and b'"param":"file"' in body
    # Through the SDK, against a gateway with a small cap.
    small = start_gateway(services, database, tiny_model_dir, tmp_path / "small", max_upload_bytes=64 * 1024)
    try:
        org = admin_of(small).tenant("uploads")
        with pytest.raises(openai.APIStatusError) as err:
            org.client.files.create(file=("big.jsonl", b'{"a": 1}\n' * 200_000), purpose="fine-tune")
        assert err.value.status_code == 413 and "65536" in err.value.message
    finally:
        small.stop()


def test_error_bodies_stay_small(stack: GatewayServer, tenant: Tenant) -> None:
    with http(stack, tenant.key) as api:
        body, ctype = multipart({"purpose": b"p" * 60_000}, b"t.jsonl", b"{}\n")
        error = refused(api.post("/v1/files", content=body, headers={"content-type": ctype}), "purpose")
        assert len(error["message"]) <= 2000
        error = refused(
            api.post("/v1/fine_tuning/jobs", json={**JOB, "metadata": {"k" * 50_000: "\x00"}}), None
        )
        assert len(error["param"]) <= 200 and len(error["message"]) <= 2000


def _long_name_bomb(path: Path, name_bytes: int) -> Path:
    """A package archive whose one member has a GNU long name of `name_bytes` (it compresses to almost
    nothing; read whole, it would be an error message of that size)."""
    raw = io.BytesIO()
    with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
        info = tarfile.TarInfo("a" * name_bytes)
        info.size = 1
        tar.addfile(info, io.BytesIO(b"x"))
    path.write_bytes(gzip.compress(raw.getvalue()))
    return path


def _sandbox_works() -> bool:
    from envsdk.sandbox import probe_backend

    return probe_backend("bwrap") or probe_backend("unshare")


def test_archive_header_bombs_are_refused_with_a_small_error(tenant: Tenant, tmp_path: Path) -> None:
    bomb = _long_name_bomb(tmp_path / "bomb.tar.gz", 4 * 1024 * 1024)
    assert bomb.stat().st_size < 64 * 1024
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.files.create(file=(bomb.name, bomb.read_bytes()), purpose="environment")
    assert err.value.code == "invalid_environment" and "header" in err.value.message
    assert len(err.value.response.content) < 4096


# ----------------------------------------------------------------------------------------- environments
@pytest.mark.skipif(not _sandbox_works(), reason="no sandbox backend here: install bubblewrap")
def test_environment_runs_refuse_malformed_tasks_and_survive_non_numeric_rewards(
    stack: GatewayServer, tenant: Tenant, tmp_path: Path
) -> None:
    src = tmp_path / "lots"
    src.mkdir()
    (src / "environment.toml").write_text('name = "lots"\nversion = "0.1.0"\nentrypoint = "env:Env"\n')
    (src / "env.py").write_text(MULTI_TURN)
    archive, _ = pack(src, tmp_path / "lots.tar.gz")
    file_id = tenant.client.files.create(file=(archive.name, archive.read_bytes()), purpose="environment").id
    with http(stack, tenant.key) as api:
        for task in (
            {},
            {"messages": []},
            {"messages": "hi"},
            {"messages": [{"content": "hi"}]},
            {"prompt": 7},
        ):
            run = {"file_id": file_id, "task": task, "completion": "1"}
            refused(api.post("/v1/fine_tuning/alpha/environments/run", json=run), "task")
        run = {"file_id": file_id, "task": {"messages": MESSAGES}, "completion": "hi"}
        answer = api.post("/v1/fine_tuning/alpha/environments/run", json=run)
    assert answer.status_code == 200, answer.text
    assert answer.json()["reward"] is None and "number" in answer.json()["error"]


# ------------------------------------------------------------------------------------------------- jobs
def _training_file(t: Tenant, rows: list[dict[str, Any]]) -> str:
    data = "\n".join(json.dumps(r) for r in rows).encode()
    return t.client.files.create(file=("train.jsonl", data), purpose="fine-tune").id


def test_an_empty_idempotency_key_is_no_key(stack: GatewayServer, tenant: Tenant) -> None:
    """An empty `Idempotency-Key` names nothing to replay: each create makes its own job, the first as
    well as the second (which once failed on the first's stored empty key), and real keys still replay."""
    body = {"model": "tiny-chat", "training_file": _training_file(tenant, HELLO_SFT)}
    with http(stack, tenant.key) as api:
        made = [api.post(JOBS, json=body, headers={"Idempotency-Key": ""}) for _ in range(3)]
        assert [m.status_code for m in made] == [200] * 3, [m.text[:300] for m in made]
        assert len({m.json()["id"] for m in made}) == 3
        keyed = [api.post(JOBS, json=body, headers={"Idempotency-Key": "k-1"}) for _ in range(2)]
        assert [k.status_code for k in keyed] == [200, 200]
        assert keyed[0].json()["id"] == keyed[1].json()["id"] not in {m.json()["id"] for m in made}


@pytest.mark.parametrize(
    ("where", "param"),
    [
        ("method", "method.supervised.hyperparameters.learning_rate_multiplier"),
        ("legacy", "hyperparameters.learning_rate_multiplier"),
    ],
)
def test_a_refused_learning_rate_multiplier_names_its_field_in_one_sentence(
    stack: GatewayServer, tenant: Tenant, where: str, param: str
) -> None:
    """A multiplier within its own range whose learning rate for the model passes 1: a 400 naming the
    multiplier, the field the client wrote, with one sentence that says why."""
    hp = {"learning_rate_multiplier": 10_000}
    fields: dict[str, Any] = (
        {"method": {"type": "supervised", "supervised": {"hyperparameters": hp}}}
        if where == "method"
        else {"hyperparameters": hp}
    )
    body = {"model": "tiny-chat", "training_file": _training_file(tenant, HELLO_SFT), **fields}
    rate = 10_000 * base_learning_rate("supervised", model_defaults(stack.settings.base_model_path(BASE)))
    with http(stack, tenant.key) as api:
        error = refused(api.post(JOBS, json=body), param)
    assert error == {
        "message": f"A learning_rate_multiplier of 10000 gives this model a learning_rate of {rate:g}, "
        "which should be less than or equal to 1.",
        "type": "invalid_request_error",
        "param": param,
        "code": "invalid_value",
    }
    assert tenant.client.fine_tuning.jobs.list().data == []


def test_hyperparameters_only_the_file_makes_impossible_fail_the_job(
    stack: GatewayServer, tenant: Tenant
) -> None:
    """A reinforcement batch larger than the training file fails the job with the reason, as a row that
    does not fit does; the job is never left validating."""
    method: Any = {
        "type": "reinforcement",
        "reinforcement": {"grader": SAYS_YES, "hyperparameters": {"batch_size": 5}},
    }
    job = tenant.client.fine_tuning.jobs.create(
        model=BASE, training_file=_training_file(tenant, RFT[:2]), method=method
    )
    assert job.status == "failed" and job.error is not None
    assert (job.error.code, job.error.param) == ("invalid_training_file", "training_file")
    assert job.error.message == (
        f"Training file {job.training_file}: batch_size: 5 prompts a step, but the file has 2."
    )
    assert [j.status for j in tenant.client.fine_tuning.jobs.list().data] == ["failed"]


def test_request_validation_errors_name_the_field_in_one_sentence(
    stack: GatewayServer, tenant: Tenant
) -> None:
    with http(stack, tenant.key) as api:
        error = refused(api.get("/v1/files", params={"limit": "many"}), "limit")
        assert error["message"] == (
            "Invalid value for 'limit': input should be a valid integer, unable to parse string as an "
            "integer."
        )
        error = refused(api.post("/v1/evals", json={"testing_criteria": []}), "data_source_config")
        assert error["message"] == "Missing required parameter: 'data_source_config'."
        error = refused(post_raw(api, "/v1/evals", b'{"name": "x",'), None)
        assert (error["param"], error["code"]) == (None, "invalid_json")
        assert error["message"].startswith("The request body is not valid JSON (")


def test_a_lora_rank_the_engines_cannot_serve_is_refused_at_create(
    stack: GatewayServer, tenant: Tenant
) -> None:
    """A lora_r above `engine_max_lora_rank` would train an adapter that serving refuses: a 400 naming the
    field before anything is queued; the largest servable rank is taken."""
    limit = stack.settings.engine_max_lora_rank
    training_file = _training_file(tenant, HELLO_SFT)

    def create(rank: int) -> Any:
        hp = {"lora_r": rank, "n_epochs": 1}
        method = {"type": "supervised", "supervised": {"hyperparameters": hp}}
        return api.post(JOBS, json={"model": BASE, "training_file": training_file, "method": method})

    param = "method.supervised.hyperparameters.lora_r"
    with http(stack, tenant.key) as api:
        error = refused(create(limit + 1), param)
        assert error == {
            "message": f"A lora_r of {limit + 1} is above the largest adapter rank this server serves "
            f"({limit}): the fine-tuned model could not be used. Choose a lora_r of at most that.",
            "type": "invalid_request_error",
            "param": param,
            "code": "invalid_value",
        }
        assert tenant.client.fine_tuning.jobs.list().data == []
        taken = create(limit)
        assert taken.status_code == 200, taken.text
        tenant.client.fine_tuning.jobs.cancel(taken.json()["id"])

"""Fuzzing: no request gets a 5xx, and no error answer costs the client its kept-alive connection.

- schemathesis over the gateway's own `/openapi.json`: the tenant API, the Tinker API (`/api/v1`, with an SDK
  key `tml-...` in `X-API-Key`, as the `tinker` SDK sends it) and the admin API. Every operation gets
  generated requests (valid, invalid and boundary values: NUL bytes, huge integers, odd unicode, missing and
  extra fields), bounded in examples and in time.
- What the schema does not describe, generated with hypothesis: `forward_backward`'s protocol-buffer body
  (random bytes, mangled messages of the SDK's own schema, near-valid requests with one thing wrong), and
  the ids of every Tinker route (traversal, absolute paths, another organisation's ids, squatted suffixes).
  Each answer is under 500, an error is OpenAI's envelope, and after each error the same connection serves
  a valid request.
- A kept-alive client meets an error on each API in turn, each followed by a valid request on the same
  connection.

The gateways have databases of their own, so what the fuzz creates, revokes or limits touches no other test.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import quote

import httpx
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tinker.proto import tinker_public_pb2 as pb

from tests.support.fixtures import gateway_fixture
from tests.support.stack import GatewayServer, Tenant, admin_of

MAX_EXAMPLES = 15
"""Generated requests per operation and phase (schemathesis)."""
MAX_TIME_S = 40
"""Time budget of each schemathesis run, and of each hypothesis fuzz."""
BODY_EXAMPLES = 300
"""`forward_backward` bodies per run (or fewer, when `MAX_TIME_S` runs out first)."""
ID_EXAMPLES = 300
"""Id requests per run (each route's turn comes round in the draw)."""

CONFIG = """\
headers = {{ {header} = "{scheme}${{TUNEGATE_FUZZ_KEY}}" }}
"""


gateway = gateway_fixture("fuzz", scope="function", engine=False, own_database=True)
tinker_gw = gateway_fixture("fuzz-tinker", engine=False, own_database=True)


def _fuzz(
    gateway: GatewayServer,
    workdir: Path,
    key: str,
    *,
    include: str,
    exclude: str | None,
    header: str = "Authorization",
    scheme: str = "Bearer ",
) -> str:
    """One schemathesis run over the operations whose path matches `include` (and not `exclude`), with the
    key sent as `<header>: <scheme><key>`."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG.format(header=header, scheme=scheme))
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        f"{gateway.url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--include-path-regex",
        include,
        "--max-examples",
        str(MAX_EXAMPLES),
        "--max-time",
        str(MAX_TIME_S),
        "--workers",
        "1",
        "--seed",
        "18",
        "--generation-database",
        "none",
        "--no-color",
        "--request-timeout",
        "30",
    ]
    if exclude:
        command += ["--exclude-path-regex", exclude]
    env = {**os.environ, "TUNEGATE_FUZZ_KEY": key, "NO_COLOR": "1"}
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=MAX_TIME_S + 120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    summary = re.search(r"\d+ generated, \d+ passed.*", output)
    assert summary is not None, output[-3000:]
    return summary.group(0)


def test_no_5xx_on_the_tenant_tinker_and_admin_apis(gateway: GatewayServer, tmp_path: Path) -> None:
    admin = admin_of(gateway)
    tenant = admin.tenant("fuzz")
    admin_key = gateway.settings.admin_key
    assert admin_key is not None
    # The tenant's APIs first: the admin run may revoke the tenant's key (it lists every organisation's keys).
    tenant_run = _fuzz(
        gateway, tmp_path / "tenant", tenant.key, include="^/", exclude="^/v1/admin/|^/api/v1/"
    )
    tinker_run = _fuzz(
        gateway,
        tmp_path / "tinker",
        tenant.key,
        include="^/api/v1/",
        exclude=None,
        header="X-API-Key",
        scheme="tml-",
    )
    admin_run = _fuzz(
        gateway, tmp_path / "admin", admin_key.get_secret_value(), include="^/v1/admin/", exclude=None
    )
    print(f"tenant API: {tenant_run}; Tinker API: {tinker_run}; admin API: {admin_run}")


# ---- what the schema does not describe: the Tinker wire body and ids ----------------------------------


def _local_port(resp: httpx.Response) -> int | None:
    """The client's port of the connection a response came on (the same port, the same connection); None
    when the client has closed that connection already, as it does after an answer that ends it."""
    try:
        port: int = resp.extensions["network_stream"].get_extra_info("client_addr")[1]
    except OSError:
        return None
    return port


@dataclass
class Prober:
    """Sends fuzzed requests on one kept-alive connection and records what went wrong: a 5xx, an error
    that is not OpenAI's envelope, a transport error, or a valid request after an error that failed or came
    on another connection."""

    http: httpx.Client
    valid: Callable[[httpx.Client], httpx.Response]
    """A request that must succeed (the check after each error)."""
    deadline: float
    findings: list[str] = field(default_factory=list)
    answers: Counter[int] = field(default_factory=Counter)
    """Answers by status."""

    def send(self, route: str, method: str, url: str, **kwargs: Any) -> None:
        if time.monotonic() > self.deadline:
            return  # the budget is spent: the rest of the draw is skipped
        what = f"{method} {url[:160]} {_shown(kwargs)}"
        try:
            answer = self.http.request(method, url, **kwargs)
        except httpx.TransportError as exc:
            self.findings.append(f"{route}: transport error {exc!r} <- {what}")
            return
        port = _local_port(answer)  # now: the client closes a connection the answer ended
        status = answer.status_code
        self.answers[status] += 1
        if status >= 500:
            self.findings.append(f"{route}: {status} {answer.text[:200]} <- {what}")
        if status < 400:
            return
        try:
            error = answer.json()["error"]
            envelope = set(error) == {"message", "type", "param", "code"}
        except (ValueError, KeyError, TypeError):
            envelope = False
        if not envelope:
            self.findings.append(f"{route}: {status} not an error envelope: {answer.text[:200]} <- {what}")
        try:
            after = self.valid(self.http)
        except httpx.TransportError as exc:
            self.findings.append(f"{route}: {status}, then the next request: {exc!r} <- {what}")
            return
        if after.status_code != 200:
            self.findings.append(f"{route}: {status}, then the next request: {after.status_code} <- {what}")
        elif port is None or _local_port(after) != port:
            self.findings.append(f"{route}: {status}, and the connection was closed <- {what}")


def _shown(kwargs: dict[str, Any]) -> str:
    if "content" in kwargs:
        return f"({len(kwargs['content'])} bytes) {kwargs['content'][:200]!r}"
    return repr(kwargs.get("json", ""))[:300]


@dataclass(frozen=True)
class TinkerIds:
    """Ids of one organisation's Tinker objects (no worker runs: the models are never held)."""

    session: str
    model: str
    sampler: str
    request: str


def _tinker_client(gateway: GatewayServer, tenant: Tenant) -> httpx.Client:
    return httpx.Client(base_url=gateway.url, headers={"X-API-Key": "tml-" + tenant.key}, timeout=60)


def _ids(http: httpx.Client) -> TinkerIds:
    def post(path: str, body: dict[str, Any]) -> dict[str, Any]:
        answer = http.post(path, json=body)
        assert answer.status_code == 200, answer.text
        result: dict[str, Any] = answer.json()
        return result

    session = post("/api/v1/create_session", {"tags": [], "sdk_version": "fuzz"})["session_id"]
    made = post("/api/v1/create_model", {"session_id": session, "model_seq_id": 0, "base_model": "tiny-chat"})
    sampler = post(
        "/api/v1/create_sampling_session",
        {"session_id": session, "sampling_session_seq_id": 0, "base_model": "tiny-chat"},
    )
    return TinkerIds(session, made["model_id"], sampler["sampling_session_id"], made["request_id"])


def _capabilities(http: httpx.Client) -> httpx.Response:
    return http.get("/api/v1/get_server_capabilities")


# The SDK's own schema (`tinker.proto`) builds the messages, so the server's decoder is not its own judge.
INT32 = st.one_of(st.integers(-2, 300), st.sampled_from([-(2**31), 2**31 - 1, 151_936, 10**9]))
INT64 = st.one_of(st.integers(-2, 40), st.sampled_from([-(2**63), 2**63 - 1, 2**32, 10**12]))
FLOAT = st.one_of(st.floats(-4, 4, width=32), st.sampled_from([math.nan, math.inf, -math.inf, 3e38, -0.0]))
RAW = st.binary(max_size=48)
PACKED = st.one_of(
    RAW,
    st.lists(INT32, max_size=12).map(lambda v: np.asarray(v, np.int32).tobytes()),
    st.lists(INT64, max_size=12).map(lambda v: np.asarray(v, np.int64).tobytes()),
    st.lists(FLOAT, max_size=12).map(lambda v: np.asarray(v, np.float32).tobytes()),
)
DTYPES = st.sampled_from([0, 1, 2, 3, 4, 5, -1, 127])
INPUT_NAMES = st.one_of(
    st.sampled_from(["target_tokens", "weights", "logprobs", "advantages", "mask", ""]), st.text(max_size=8)
)
LOSSES = st.one_of(
    st.sampled_from(["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "nope", ""]),
    st.text(max_size=12),
)


@st.composite
def _tensors(draw: st.DrawFn) -> pb.Tensor:
    tensor = pb.Tensor(dtype=draw(DTYPES), shape=draw(st.lists(INT64, max_size=3)))
    kind = draw(st.sampled_from(["dense", "sparse", "none"]))
    if kind == "dense":
        tensor.dense = draw(PACKED)
    elif kind == "sparse":
        tensor.sparse_csr.values = draw(PACKED)
        tensor.sparse_csr.crow_indices = draw(PACKED)
        tensor.sparse_csr.col_indices = draw(PACKED)
    return tensor


@st.composite
def _datums(draw: st.DrawFn) -> pb.Datum:
    datum = pb.Datum()
    for kind in draw(st.lists(st.sampled_from(["text", "text", "image", "dmel", "empty"]), max_size=3)):
        chunk = datum.model_input.add()
        if kind == "text":
            chunk.encoded_text.tokens = draw(PACKED)
        elif kind == "image":
            chunk.image.data = draw(RAW)
            chunk.image.format = draw(st.sampled_from(["png", "jpeg", ""]))
        elif kind == "dmel":
            chunk.dmel.dmel = draw(RAW)
    for name in draw(st.lists(INPUT_NAMES, max_size=4, unique=True)):
        datum.loss_fn_inputs[name].CopyFrom(draw(_tensors()))
    if draw(st.booleans()):
        span = datum.model_input_spans.add().prompt_tokens
        span.sequence_id, span.offset, span.length = draw(st.text(max_size=8)), draw(INT64), draw(INT64)
    return datum


@st.composite
def _mangled(draw: st.DrawFn, model_ids: st.SearchStrategy[str]) -> bytes:
    """A message of the schema with any values in any of its fields."""
    msg = pb.ForwardBackwardRequest(model_id=draw(model_ids), seq_id=draw(INT32), loss_fn=draw(LOSSES))
    for datum in draw(st.lists(_datums(), max_size=3)):
        msg.data.add().CopyFrom(datum)
    for key, value in draw(st.dictionaries(st.text(max_size=8), FLOAT, max_size=2)).items():
        msg.loss_fn_config[key] = value
        msg.loss_fn_config_v2[key].number = value
    for key, text in draw(st.dictionaries(st.text(max_size=8), st.text(max_size=8), max_size=1)).items():
        msg.loss_fn_config_v2[key].text = text
    msg.forward_only = draw(st.booleans())
    return msg.SerializeToString()


LOSS_INPUTS = {
    "cross_entropy": ("target_tokens", "weights"),
    "importance_sampling": ("target_tokens", "logprobs", "advantages"),
    "ppo": ("target_tokens", "logprobs", "advantages"),
}
FAULTS = [
    None,
    None,
    "token out of the vocabulary",
    "negative token",
    "target out of the vocabulary",
    "negative target",
    "input one short",
    "input one long",
    "shape disagrees",
    "huge shape",
    "negative shape",
    "2-D shape",
    "NaN",
    "infinity",
    "input missing",
    "extra input",
    "bytes not a multiple of the dtype",
    "token bytes not a multiple of 4",
    "odd dtype",
    "CSR",
    "CSR with a 1-D shape",
    "CSR with huge shape",
    "CSR with negative shape",
    "CSR row pointers past the values",
    "CSR row pointers falling",
    "CSR columns out of range",
    "CSR negative columns",
    "unknown loss",
    "NaN in the loss config",
]


def _csr(fault: str, values: np.ndarray) -> pb.Tensor:
    """`values` as one CSR row (`[1, n]`), broken as `fault` says."""
    n = len(values)
    shape = {"CSR with a 1-D shape": [n], "CSR with huge shape": [2**40, 2**40]}.get(fault, [1, n])
    crow = {"CSR row pointers past the values": [0, n + 3], "CSR row pointers falling": [n, 0]}.get(
        fault, [0, n]
    )
    cols = list(range(n))
    if fault == "CSR columns out of range":
        cols = [n + 5] * n
    elif fault == "CSR negative columns":
        cols = [-1] * n
    if fault == "CSR with negative shape":
        shape = [-1, n]
    tensor = pb.Tensor(dtype=pb.DTYPE_INT64 if values.dtype == np.int64 else pb.DTYPE_FLOAT32, shape=shape)
    tensor.sparse_csr.values = values.tobytes()
    tensor.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.asarray(cols, np.int64).tobytes()
    return tensor


@st.composite
def _near_valid(draw: st.DrawFn, model_id: str) -> bytes:
    """A request the SDK could send, valid but for at most one fault (`FAULTS`) in one datum: reaches the
    checks past the first, and the model lookup and queue when it has none."""
    fault = draw(st.sampled_from(FAULTS))
    loss = draw(st.sampled_from(sorted(LOSS_INPUTS)))
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=draw(st.integers(1, 50)), loss_fn=loss)
    if fault == "unknown loss":
        msg.loss_fn = "nope"
    if fault == "NaN in the loss config":
        msg.loss_fn_config["clip_low_threshold"] = math.nan
        msg.loss_fn_config_v2["clip_low_threshold"].number = math.nan
    n_data = draw(st.integers(1, 2))
    faulty = draw(st.integers(0, n_data - 1))
    for index in range(n_data):
        here = fault if index == faulty else None
        n = draw(st.integers(1, 6))
        tokens = np.asarray(draw(st.lists(st.integers(0, 500), min_size=n, max_size=n)), np.int32)
        if here in ("token out of the vocabulary", "negative token"):
            tokens[draw(st.integers(0, n - 1))] = 10**6 if here.startswith("token") else -1
        datum = msg.data.add()
        token_bytes = tokens.tobytes() + (b"\0" if here == "token bytes not a multiple of 4" else b"")
        datum.model_input.add().encoded_text.tokens = token_bytes
        names = list(LOSS_INPUTS[loss]) + (["mask"] if here == "extra input" else [])
        if here == "input missing":
            names.remove(draw(st.sampled_from(names)))
        target = draw(st.sampled_from(names)) if names else ""
        for name in names:
            length = n + {"input one short": -1, "input one long": 1}.get(here or "", 0) * (name == target)
            if name == "target_tokens":
                values = np.asarray(draw(st.lists(st.integers(0, 500), min_size=length, max_size=length)))
                values = values.astype(np.int64)
                if name == target and here in ("target out of the vocabulary", "negative target") and length:
                    values[0] = 10**6 if here.startswith("target out") else -1
            else:
                values = np.asarray(draw(st.lists(st.floats(-2, 2), min_size=length, max_size=length)))
                values = values.astype(np.float32)
                if name == target and here in ("NaN", "infinity") and length:
                    values[-1] = math.nan if here == "NaN" else math.inf
            if name == target and here is not None and here.startswith("CSR"):
                datum.loss_fn_inputs[name].CopyFrom(_csr(here, values))
                continue
            tensor = datum.loss_fn_inputs[name]
            tensor.dtype = pb.DTYPE_INT64 if values.dtype == np.int64 else pb.DTYPE_FLOAT32
            tensor.dense = values.tobytes()
            tensor.shape.append(length)
            if name != target:
                continue
            if here == "bytes not a multiple of the dtype":
                tensor.dense += b"\0\0"
            elif here == "odd dtype":
                tensor.dtype = draw(st.sampled_from([0, 3, 4, 99]))
            elif here in ("shape disagrees", "huge shape", "negative shape", "2-D shape"):
                shapes = {"shape disagrees": [length + 1], "huge shape": [2**40], "negative shape": [-length]}
                tensor.shape[:] = shapes.get(here, [length, 1])
    return msg.SerializeToString()


@st.composite
def _cut(draw: st.DrawFn, bodies: st.SearchStrategy[bytes]) -> bytes:
    """A body truncated, or with a byte changed."""
    body = draw(bodies)
    if not body:
        return body
    at = draw(st.integers(0, len(body) - 1))
    if draw(st.booleans()):
        return body[:at]
    return body[:at] + bytes([draw(st.integers(0, 255))]) + body[at + 1 :]


def _budgeted(examples: int) -> Callable[[Any], Any]:
    return settings(
        max_examples=examples,
        deadline=None,
        database=None,
        derandomize=True,
        suppress_health_check=list(HealthCheck),
    )


def _report(prober: Prober) -> str:
    """The findings grouped by outcome, with the count and the first request of each."""
    groups: dict[str, list[str]] = {}
    for finding in prober.findings:
        outcome, _, request = finding.partition(" <- ")
        groups.setdefault(outcome, []).append(request)
    lines = [f"{len(requests)} x {outcome}\n    first: {requests[0]}" for outcome, requests in groups.items()]
    return f"{len(prober.findings)} findings in {sum(prober.answers.values())} requests:\n" + "\n".join(lines)


def test_forward_backward_bodies_get_no_5xx_and_keep_the_connection(tinker_gw: GatewayServer) -> None:
    """Whatever bytes `forward_backward` gets, the answer is a 200 or an error in OpenAI's envelope, and the
    connection serves the next request."""
    tenant = admin_of(tinker_gw).tenant("fuzz-wire")
    with _tinker_client(tinker_gw, tenant) as http:
        ids = _ids(http)
        prober = Prober(http, _capabilities, time.monotonic() + MAX_TIME_S)
        model_ids = st.one_of(st.just(ids.model), _fuzzed_ids(ids, TinkerIds("ts-b", "ts-b:train:0", "", "")))
        bodies = st.one_of(
            RAW,
            _mangled(model_ids),
            _near_valid(ids.model),
            _near_valid(ids.model),
            _cut(_near_valid(ids.model)),
        )
        headers = st.sampled_from(
            [{"content-type": "application/x-protobuf"}, {}, {"content-type": "application/json"}]
        )

        @_budgeted(BODY_EXAMPLES)
        @given(body=bodies, extra=headers)
        def send(body: bytes, extra: dict[str, str]) -> None:
            prober.send("forward_backward", "POST", "/api/v1/forward_backward", content=body, headers=extra)

        send()
    print(f"answers by status: {dict(prober.answers)}")
    assert prober.findings == [], _report(prober)


# Ids: literal oddities, and real ids twisted (traversal, absolute, other organisation's, squatted suffixes).
LITERAL_IDS = [
    "",
    ".",
    "..",
    "/",
    "/etc/passwd",
    "..\\..\\x",
    "tinker://",
    "tinker://../../x",
    "tinker:///tmp/x/weights/y",
    "a" * 5000,
    "\u202e\u0000",
    ":",
    ":train:",
    "ts-x:train:-1",
    "ts-x:train:99999999999999999999999",
    "%2e%2e%2f",
    "NUL",
]
TWISTS: list[Callable[[str], str]] = [
    lambda i: i,
    lambda i: "../" + i,
    lambda i: i + "/../../etc",
    lambda i: "/" + i,
    lambda i: i + "\x00",
    lambda i: i.upper(),
    lambda i: i + ":train:7",
    lambda i: i + ":sample:7",
    lambda i: i.replace(":", "/"),
    lambda i: f"tinker://{i}/weights/../../../x",
    lambda i: f"tinker://{i}/sampler_weights/x",
    lambda i: i * 30,
    lambda i: i[:-1],
]


def _fuzzed_ids(own: TinkerIds, other: TinkerIds) -> st.SearchStrategy[str]:
    real = [i for i in (*vars(own).values(), *vars(other).values()) if i]
    return st.one_of(
        st.sampled_from(LITERAL_IDS),
        st.builds(lambda twist, i: twist(i), st.sampled_from(TWISTS), st.sampled_from(real)),
        st.text(max_size=40),
    )


def _one_datum(model_id: str) -> bytes:
    """A valid `forward_backward` request of one datum, for model `model_id`."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1, 2], np.int32).tobytes()
    target = datum.loss_fn_inputs["target_tokens"]
    target.dtype, target.dense = pb.DTYPE_INT64, np.asarray([2, 3], np.int64).tobytes()
    target.shape.append(2)
    weights = datum.loss_fn_inputs["weights"]
    weights.dtype, weights.dense = pb.DTYPE_FLOAT32, np.asarray([1, 1], np.float32).tobytes()
    weights.shape.append(2)
    return msg.SerializeToString()


def _id_routes(own: TinkerIds) -> dict[str, Callable[[str], tuple[str, str, dict[str, Any]]]]:
    """Each Tinker route's way of taking a fuzzed id: (method, url, request keywords)."""
    prompt = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}
    sample = {"prompt": prompt, "sampling_params": {"max_tokens": 1}, "num_samples": 1}

    def seg(i: str) -> str:
        return quote(i, safe="")

    return {
        "session_heartbeat": lambda i: ("POST", "/api/v1/session_heartbeat", {"json": {"session_id": i}}),
        "finish_session": lambda i: (
            "POST",
            f"/api/v1/sessions/{seg(i)}/finish",
            {"json": {"reason": {"type": "success"}}},
        ),
        "create_model": lambda i: (
            "POST",
            "/api/v1/create_model",
            {"json": {"session_id": i, "model_seq_id": 1, "base_model": "tiny-chat"}},
        ),
        "get_info": lambda i: ("POST", "/api/v1/get_info", {"json": {"model_id": i}}),
        "forward_backward": lambda i: ("POST", "/api/v1/forward_backward", {"content": _one_datum(i)}),
        "optim_step": lambda i: ("POST", "/api/v1/optim_step", {"json": {"model_id": i}}),
        "save_weights(model_id)": lambda i: ("POST", "/api/v1/save_weights", {"json": {"model_id": i}}),
        "save_weights(path)": lambda i: (
            "POST",
            "/api/v1/save_weights",
            {"json": {"model_id": own.model, "path": i}},
        ),
        "save_weights_for_sampler": lambda i: (
            "POST",
            "/api/v1/save_weights_for_sampler",
            {"json": {"model_id": i, "path": i}},
        ),
        "load_weights(path)": lambda i: (
            "POST",
            "/api/v1/load_weights",
            {"json": {"model_id": own.model, "path": i, "optimizer": True}},
        ),
        "load_weights(session)": lambda i: (
            "POST",
            "/api/v1/load_weights",
            {"json": {"session_id": i, "model_seq_id": 2, "path": f"tinker://{own.model}/weights/x"}},
        ),
        "create_sampling_session": lambda i: (
            "POST",
            "/api/v1/create_sampling_session",
            {"json": {"session_id": i, "sampling_session_seq_id": 1, "base_model": "tiny-chat"}},
        ),
        "create_sampling_session(model_path)": lambda i: (
            "POST",
            "/api/v1/create_sampling_session",
            {"json": {"session_id": own.session, "sampling_session_seq_id": 2, "model_path": i}},
        ),
        "get_sampler": lambda i: ("GET", f"/api/v1/samplers/{seg(i)}", {}),
        "asample(sampling_session_id)": lambda i: (
            "POST",
            "/api/v1/asample",
            {"json": {**sample, "sampling_session_id": i}},
        ),
        "asample(model_path)": lambda i: ("POST", "/api/v1/asample", {"json": {**sample, "model_path": i}}),
        "retrieve_future": lambda i: ("POST", "/api/v1/retrieve_future", {"json": {"request_id": i}}),
        "cancel_future": lambda i: ("POST", "/api/v1/cancel_future", {"json": {"request_id": i}}),
        "training_run": lambda i: ("GET", f"/api/v1/training_runs/{seg(i)}", {}),
        "training_run_checkpoints": lambda i: ("GET", f"/api/v1/training_runs/{seg(i)}/checkpoints", {}),
        "weights_info": lambda i: ("POST", "/api/v1/weights_info", {"json": {"tinker_path": i}}),
    }


def test_fuzzed_ids_in_every_tinker_route_get_no_5xx_and_keep_the_connection(
    tinker_gw: GatewayServer,
) -> None:
    """Every id a Tinker route takes, fuzzed: traversal, absolute paths, another organisation's ids,
    suffixes in another session's id space. No 5xx, errors in the envelope, the connection kept."""
    admin = admin_of(tinker_gw)
    a, b = admin.tenant("fuzz-ids-a"), admin.tenant("fuzz-ids-b")
    with _tinker_client(tinker_gw, b) as other:
        b_ids = _ids(other)
    with _tinker_client(tinker_gw, a) as http:
        own = _ids(http)
        routes = _id_routes(own)
        prober = Prober(http, _capabilities, time.monotonic() + MAX_TIME_S)

        @_budgeted(ID_EXAMPLES)
        @given(route=st.sampled_from(sorted(routes)), ident=_fuzzed_ids(own, b_ids))
        def send(route: str, ident: str) -> None:
            if route.startswith("asample") and ident in (own.sampler, own.model):
                return  # a real sampler of A's samples through the engines, which this gateway has none of
            method, url, kwargs = routes[route](ident)
            prober.send(route, method, url, **kwargs)

        send()
    print(f"answers by status: {dict(prober.answers)}")
    assert prober.findings == [], _report(prober)


# ---- keep-alive after errors, on every API -------------------------------------------------------------


def test_a_kept_alive_connection_serves_the_next_request_after_errors_on_every_api(
    tinker_gw: GatewayServer,
) -> None:
    """On one kept-alive connection: an error of each API (OpenAI-shaped, Tinker, admin), each followed by
    a valid request, which the same connection answers."""
    admin = admin_of(tinker_gw)
    tenant = admin.tenant("fuzz-keepalive")
    admin_key = tinker_gw.settings.admin_key
    assert admin_key is not None
    bearer = {"Authorization": f"Bearer {tenant.key}"}
    sdk = {"X-API-Key": "tml-" + tenant.key}
    as_admin = {"Authorization": f"Bearer {admin_key.get_secret_value()}"}
    errors: list[tuple[str, str, str, dict[str, Any], int]] = [
        ("files: unknown id", "GET", "/v1/files/file-nothing", {"headers": bearer}, 404),
        ("files: wrong key", "GET", "/v1/files", {"headers": {"Authorization": "Bearer sk-no"}}, 401),
        (
            "chat: JSON that is not JSON",
            "POST",
            "/v1/chat/completions",
            {"headers": {**bearer, "content-type": "application/json"}, "content": b"{nope"},
            400,
        ),
        ("jobs: a missing field", "POST", "/v1/fine_tuning/jobs", {"headers": bearer, "json": {}}, 400),
        ("unknown URL", "GET", "/v1/nothing-here", {"headers": bearer}, 404),
        ("tinker: no key", "GET", "/api/v1/get_server_capabilities", {}, 401),
        (
            "tinker: a body that is not a protocol buffer",
            "POST",
            "/api/v1/forward_backward",
            {"headers": {**sdk, "content-type": "application/x-protobuf"}, "content": b"\xff\xff\xff"},
            400,
        ),
        (
            "tinker: unknown model",
            "POST",
            "/api/v1/get_info",
            {"headers": sdk, "json": {"model_id": "x"}},
            404,
        ),
        ("tinker: invalid body", "POST", "/api/v1/create_model", {"headers": sdk, "json": {"x": 1}}, 400),
        (
            "tinker: a NUL in a model id, in a protocol buffer (no JSON validation sees it)",
            "POST",
            "/api/v1/forward_backward",
            {"headers": sdk, "content": _one_datum("m\x00")},
            404,
        ),
        (
            "admin: unknown organisation",
            "GET",
            "/v1/admin/organizations/org-nothing",
            {"headers": as_admin},
            404,
        ),
    ]
    with httpx.Client(base_url=tinker_gw.url, timeout=60) as http:
        first = http.get("/v1/files", headers=bearer)
        assert first.status_code == 200, first.text
        port = _local_port(first)
        for name, method, url, kwargs, status in errors:
            failed = http.request(method, url, **kwargs)
            kept = _local_port(failed)  # None once the client closed the connection the answer ended
            served = http.get("/v1/files", headers=bearer)
            assert served.status_code == 200, (name, served.text[:500])
            assert kept == _local_port(served) == port is not None, name
            assert failed.status_code == status, (name, failed.text[:500])
            assert set(failed.json()["error"]) == {"message", "type", "param", "code"}, (name, failed.text)
            assert failed.headers.get("connection") != "close", name

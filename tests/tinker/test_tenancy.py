"""One organisation's Tinker ids and checkpoints are out of another's reach, on a running stack (gateway,
worker) with `tiny-chat`.

Organisation A trains a model through the official SDK, saves a training and a sampler checkpoint, and lets
the model go (its resumable state saved); organisation B has a model and a checkpoint of its own. Then B
tries what the Tinker API used to let it do: ids that are paths (traversal) in every field that names one,
ids in A's session (squatting), and reading, overwriting or resuming A's checkpoints. Each is a 404 or a 400
in OpenAI's envelope, and A's files are byte-identical afterwards. Last, the sweep: every route of the Tinker
API that takes an id, called with A's ids and B's key, answers 404 and changes no row and no file.

Raw `httpx` (`X-API-Key: tml-<key>`) sends what the SDK cannot express; the SDK makes the legitimate calls.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import secrets
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest
import tinker
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from gateway.tinker.router import router as tinker_router
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.stack import Admin, GatewayServer, Tenant

gw = gateway_fixture("tinker-tenancy", own_database=True, engine=False)
worker = worker_fixture(
    autouse=True,
    TUNEGATE_TRAINING_SLOTS="2",
    TUNEGATE_TINKER_IDLE_TIMEOUT_S="2",  # a model with no request is saved and let go at once
)

TOKENS = [5, 17, 42, 9, 33, 7]
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [5, 17]}]}
SAMPLING = {"max_tokens": 2}


def datum() -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS[:-1]),
        loss_fn_inputs={"target_tokens": TOKENS[1:], "weights": [1.0] * (len(TOKENS) - 1)},
    )


def forward_backward_body(model_id: str) -> bytes:
    """A `forward_backward` body for `model_id`, exactly as the SDK encodes it."""
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=1,
        forward_backward_input=types.ForwardBackwardInput(data=[datum()], loss_fn="cross_entropy"),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


@dataclass(frozen=True)
class World:
    """What A and B made through the SDK (and A's raw session, which no client beats or finishes)."""

    a: Tenant
    b: Tenant
    a_session: str
    a_raw_session: str
    a_model: str
    a_state: str
    a_loss: float
    """The loss of A's model on `datum()` at `a_state`."""
    a_sampler_path: str
    a_sampler: str
    a_request: str
    b_session: str
    b_model: str
    b_state: str


def api(gw: GatewayServer, who: Tenant) -> httpx.Client:
    return httpx.Client(base_url=f"{gw.url}/api/v1", headers={"X-API-Key": "tml-" + who.key}, timeout=120)


def query(gw: GatewayServer, sql: str, *args: Any) -> list[dict[str, Any]]:
    async def run() -> list[dict[str, Any]]:
        assert gw.settings.database_url is not None
        conn = await asyncpg.connect(gw.settings.database_url)
        try:
            return [dict(r) for r in await conn.fetch(sql, *args)]
        finally:
            await conn.close()

    return asyncio.run(run())


def wait_until_let_go(gw: GatewayServer) -> None:
    """Until no worker holds a model (each saved its state and let its slot go)."""
    deadline = time.monotonic() + 240
    while query(gw, "SELECT id FROM tinker_models WHERE worker_id IS NOT NULL"):
        assert time.monotonic() < deadline, "a model is still held"
        time.sleep(0.5)


TABLES = {
    "tinker_sessions": "id",
    "tinker_models": "id",
    "tinker_requests": "id",
    "tinker_checkpoints": "model_id, kind, name",
    "tinker_samplers": "id",
    "models": "id",
}


def tinker_rows(gw: GatewayServer, *, sessions: bool = True) -> dict[str, list[dict[str, Any]]]:
    """Every row of the Tinker tables and of the served models, in a stable order (`sessions`: with
    the sessions, which every client opening makes one of)."""
    tables = {t: order for t, order in TABLES.items() if sessions or t != "tinker_sessions"}
    return {table: query(gw, f"SELECT * FROM {table} ORDER BY {order}") for table, order in tables.items()}


def files_of(gw: GatewayServer, org_id: str) -> dict[str, str]:
    """sha256 of every file of an organisation's Tinker checkpoints (its resumable state included)."""
    root = gw.settings.blob_dir / "tinker" / org_id
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.rglob("*"))
        if p.is_file()
    }


def host_files(gw: GatewayServer) -> set[str]:
    """Every path under the data directory (the blob store, the training processes' working directories)."""
    return {str(p) for p in gw.settings.data_dir.rglob("*")}


def not_found(kind: str, ident: str, param: str | None) -> dict[str, Any]:
    message = f"No {kind} found with id '{ident}'."
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": "not_found"}
    }


@pytest.fixture(scope="module")
def world(gw: GatewayServer, gw_admin: Admin) -> World:
    a, b = gw_admin.tenant("tinker-tenancy-a"), gw_admin.tenant("tinker-tenancy-b")
    with tinker.ServiceClient(base_url=gw.url, api_key="tml-" + a.key) as service:
        tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=0)
        tc.forward_backward([datum()], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.02)).result()
        a_state = tc.save_state("a-state").result().path
        a_loss = tc.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
        a_sampler_path = tc.save_weights_for_sampler("a-sampler").result().path
        a_session, a_model = service.holder.get_session_id(), tc.model_id
    with tinker.ServiceClient(base_url=gw.url, api_key="tml-" + b.key) as service:
        tcb = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=1)
        b_state = tcb.save_state("b-state").result().path
        b_model = tcb.model_id
    with api(gw, a) as http:
        a_raw = http.post("/create_session", json={}).json()["session_id"]
        made = http.post(
            "/create_sampling_session",
            json={"session_id": a_raw, "sampling_session_seq_id": 0, "model_path": a_sampler_path},
        )
        assert made.status_code == 200, made.text
        # a request (future) of A's: creating a model in its raw session, which nothing trains
        future = http.post(
            "/create_model", json={"session_id": a_raw, "model_seq_id": 0, "base_model": "tiny-chat"}
        )
        assert future.status_code == 200, future.text
    with api(gw, b) as http:
        b_session = http.post("/create_session", json={}).json()["session_id"]
    wait_until_let_go(gw)
    return World(
        a=a, b=b, a_session=a_session, a_raw_session=a_raw, a_model=a_model, a_state=a_state, a_loss=a_loss,
        a_sampler_path=a_sampler_path, a_sampler=made.json()["sampling_session_id"],
        a_request=future.json()["request_id"], b_session=b_session, b_model=b_model, b_state=b_state,
    )  # fmt: skip


def test_the_world_is_what_the_attacks_aim_at(gw: GatewayServer, world: World) -> None:
    """A's checkpoints and its resumable state are files of its own (what the other tests keep whole)."""
    files = files_of(gw, world.a.org_id)
    segments = {Path(name).parts[1] for name in files}
    assert segments == {"weights", "sampler_weights", "idle"}, files
    (model,) = query(gw, "SELECT * FROM tinker_models WHERE id = $1", world.a_model)
    assert model["resume_path"] is not None and model["worker_id"] is None
    # its training process worked in a directory named by the row's number
    assert (gw.settings.blob_dir / "work" / "tinker" / str(model["seq"]) / "session.log").is_file()


@pytest.mark.timeout(300)
def test_traversal_in_every_id_is_refused(gw: GatewayServer, world: World) -> None:
    a_files, before = files_of(gw, world.a.org_id), tinker_rows(gw)
    escape = f"tg-escape-{secrets.token_hex(4)}"
    sessions = [
        f"../{world.a.org_id}/{world.a_session}",  # B's saves would land in A's checkpoints
        f"../../../../../../../tmp/{escape}",  # the training process's directory anywhere on the host
        f"/tmp/{escape}",
        f"{world.b_session}/../{world.b_session}",
        "",
    ]
    with api(gw, world.b) as http:
        for session in sessions:
            for route, body in (
                ("/create_model", {"model_seq_id": 0, "base_model": "tiny-chat"}),
                ("/create_sampling_session", {"sampling_session_seq_id": 0, "base_model": "tiny-chat"}),
                ("/load_weights", {"model_seq_id": 0, "path": world.b_state}),
            ):
                got = http.post(route, json={"session_id": session, **body})
                assert (got.status_code, got.json()) == (404, not_found("session", session, "session_id"))
            beat = http.post("/session_heartbeat", json={"session_id": session})
            assert (beat.status_code, beat.json()) == (404, not_found("session", session, None))
        # a NUL (which no id holds) is refused with every request that carries one, naming its field
        for route, field in (("/create_model", "session_id"), ("/retrieve_future", "request_id")):
            got = http.post(
                route, json={field: f"{world.b_session}\x00", "model_seq_id": 0, "base_model": "tiny-chat"}
            )
            assert got.status_code == 400 and got.json()["error"]["param"] == field, got.text

        models = [f"../{world.a.org_id}/{world.a_model}", "/etc:train:0", f"{world.b_session}:train:0/.."]
        for model in models:
            for route, body in (
                ("/get_info", {}),
                ("/optim_step", {}),
                ("/save_weights", {"path": "b-state-2"}),
                ("/save_weights_for_sampler", {"path": "b-sampler"}),
                ("/load_weights", {"path": world.b_state}),
            ):
                got = http.post(route, json={"model_id": model, **body})
                assert (got.status_code, got.json()) == (404, not_found("model", model, "model_id"))
            fb = http.post("/forward_backward", content=forward_backward_body(model))
            assert (fb.status_code, fb.json()) == (404, not_found("model", model, "model_id"))

        # checkpoint names and tinker:// paths that climb out of their model
        for name in ("..", "../../a-state", f"../../../{world.a.org_id}/x", "/abs"):
            got = http.post("/save_weights", json={"model_id": world.b_model, "path": name})
            assert got.status_code == 400 and got.json()["error"]["param"] == "path", got.text
        b_model_dir = world.b_model.replace(":", "_")
        paths = [
            f"tinker://../{world.a.org_id}/{world.a_model}/weights/a-state",
            f"tinker://{world.b_model}/weights/../../../{world.a.org_id}/{b_model_dir}/weights/a-state",
            f"tinker://{world.b_model}/weights/..",
            "tinker:///etc/passwd",
        ]
        for path in paths:
            for route, body, param in (
                ("/load_weights", {"model_id": world.b_model, "path": path}, "path"),
                ("/weights_info", {"tinker_path": path}, "tinker_path"),
                (
                    "/create_sampling_session",
                    {"session_id": world.b_session, "model_path": path},
                    "model_path",
                ),
                (
                    "/asample",
                    {"model_path": path, "prompt": PROMPT, "sampling_params": SAMPLING},
                    "model_path",
                ),
            ):
                got = http.post(route, json={"sampling_session_seq_id": 5, **body})
                invalid = {
                    "message": f"Invalid tinker path {path!r}.",
                    "type": "invalid_request_error",
                    "param": param,
                    "code": None,
                }
                assert (got.status_code, got.json()) == (400, {"error": invalid}), route

        # sampler and request (future) ids
        for sampler in (f"../{world.a_sampler}", f"{world.a_raw_session}:sample:0/..", "/etc"):
            got = http.post(
                "/asample",
                json={"sampling_session_id": sampler, "prompt": PROMPT, "sampling_params": SAMPLING},
            )
            assert (got.status_code, got.json()) == (
                404,
                not_found("sampler", sampler, "sampling_session_id"),
            )
        for request_id in (f"../{world.a_request}", "/etc/passwd"):
            for route in ("/retrieve_future", "/cancel_future"):
                got = http.post(route, json={"request_id": request_id})
                assert (got.status_code, got.json()) == (404, not_found("future", request_id, "request_id"))

    assert files_of(gw, world.a.org_id) == a_files
    assert tinker_rows(gw) == before  # no model, sampler or request made for any of them
    assert not list(Path("/tmp").glob(f"{escape}*"))
    assert not [p for p in gw.settings.data_dir.rglob("*") if escape in p.name]


@pytest.mark.timeout(300)
def test_no_squatting_in_another_sessions_ids(gw: GatewayServer, world: World) -> None:
    a_files = files_of(gw, world.a.org_id)
    session = world.a_raw_session  # A's session id is in every tinker:// path A shares
    model = {"session_id": session, "model_seq_id": 1, "base_model": "tiny-chat"}
    sampler = {"session_id": session, "sampling_session_seq_id": 1, "base_model": "tiny-chat"}
    with api(gw, world.b) as b_http:
        # B takes A's next ids ...
        for route, body in (
            ("/create_model", model),
            ("/create_sampling_session", sampler),
            ("/load_weights", {"session_id": session, "model_seq_id": 1, "path": world.b_state}),
        ):
            got = b_http.post(route, json=body)
            assert (got.status_code, got.json()) == (404, not_found("session", session, "session_id"))
        # ... or ids in a session nobody has
        for route, body in (("/create_model", model), ("/create_sampling_session", sampler)):
            got = b_http.post(route, json={**body, "session_id": "ts-nobodys"})
            assert (got.status_code, got.json()) == (404, not_found("session", "ts-nobodys", "session_id"))
    assert not query(gw, "SELECT id FROM tinker_models WHERE organization_id = $1 AND id <> $2",
                     world.b.org_id, world.b_model)  # fmt: skip
    assert not query(gw, "SELECT id FROM tinker_samplers WHERE organization_id = $1", world.b.org_id)

    with api(gw, world.a) as a_http:
        # A's next ids are A's
        made = a_http.post("/create_model", json=model)
        assert made.status_code == 200 and made.json()["model_id"] == f"{session}:train:1", made.text
        made = a_http.post("/create_sampling_session", json=sampler)
        assert made.json() == {
            "type": "create_sampling_session",
            "sampling_session_id": f"{session}:sample:1",
        }
        # an id A uses already is A's own mistake: a 400 naming the field (which the SDK does not retry)
        again = a_http.post("/create_model", json=model)
        assert (again.status_code, again.json()) == (
            400,
            duplicate("model", f"{session}:train:1", "model_seq_id"),
        )
        again = a_http.post("/create_sampling_session", json=sampler)
        expected = duplicate("sampling session", f"{session}:sample:1", "sampling_session_seq_id")
        assert (again.status_code, again.json()) == (400, expected)
        # the sampler of a sampler checkpoint saved for a sampling client lives in its model's session
        ephemeral = {**sampler, "session_id": world.a_session, "sampling_session_seq_id": 9}
        assert a_http.post("/create_sampling_session", json=ephemeral).status_code == 200
        again = a_http.post(
            "/save_weights_for_sampler", json={"model_id": world.a_model, "sampling_session_seq_id": 9}
        )
        expected = duplicate("sampling session", f"{world.a_session}:sample:9", "sampling_session_seq_id")
        assert (again.status_code, again.json()) == (400, expected)
        # and so are sequence numbers out of range
        for seq in (-1, 2**31, 10**30):
            got = a_http.post("/create_model", json={**model, "model_seq_id": seq})
            assert got.status_code == 400 and got.json()["error"]["param"] == "model_seq_id", got.text
    assert files_of(gw, world.a.org_id) == a_files


def duplicate(what: str, ident: str, param: str) -> dict[str, Any]:
    message = f"The {what} id '{ident}' is already in use in this session; give another '{param}'."
    return {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": "duplicate_id"}
    }


@pytest.mark.timeout(300)
def test_another_organisations_checkpoints_are_not_read_written_or_resumed(
    gw: GatewayServer, world: World
) -> None:
    a_files, before = files_of(gw, world.a.org_id), tinker_rows(gw, sessions=False)
    # what did work: a model of B's named into A's directory (with A's model's own seq id), whose saves and
    # idle state replaced A's checkpoints and the state A's model resumes from
    seq = int(world.a_model.rsplit(":", 1)[1])
    forged_session = f"../{world.a.org_id}/{world.a_session}"
    forged = f"{forged_session}:train:{seq}"
    with api(gw, world.b) as http:
        made = http.post(
            "/create_model",
            json={"session_id": forged_session, "model_seq_id": seq, "base_model": "tiny-chat"},
        )
        assert (made.status_code, made.json()) == (404, not_found("session", forged_session, "session_id"))
        for route, body in (
            ("/save_weights", {"path": "a-state"}),
            ("/save_weights_for_sampler", {"path": "a-sampler"}),
            ("/optim_step", {}),
        ):
            got = http.post(route, json={"model_id": forged, **body})
            assert (got.status_code, got.json()) == (404, not_found("model", forged, "model_id"))
    with tinker.ServiceClient(base_url=gw.url, api_key="tml-" + world.b.key) as b:
        with pytest.raises(tinker.NotFoundError):  # resume A's state as a model of B's
            b.create_training_client_from_state_with_optimizer(world.a_state).result()
        with pytest.raises(tinker.NotFoundError):
            b.create_training_client_from_state(world.a_state).result()
        with pytest.raises(tinker.NotFoundError):  # sample from A's adapter
            b.create_sampling_client(model_path=world.a_sampler_path).result()
        rest = b.create_rest_client()
        with pytest.raises(tinker.NotFoundError):
            rest.get_weights_info_by_tinker_path(world.a_state).result()
        with pytest.raises(tinker.NotFoundError):
            rest.list_checkpoints(world.a_model).result()
        with pytest.raises(tinker.NotFoundError):
            rest.get_sampler(world.a_sampler).result()
        assert world.a_state not in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]
    with api(gw, world.b) as http:
        # A's state into B's model; B's state into A's model; B saving under A's model's names
        into_b = http.post(
            "/load_weights", json={"model_id": world.b_model, "path": world.a_state, "optimizer": True}
        )
        assert (into_b.status_code, into_b.json()) == (404, not_found("checkpoint", world.a_state, "path"))
        for route, body in (
            ("/load_weights", {"path": world.b_state}),
            ("/save_weights", {"path": "a-state"}),
            ("/save_weights_for_sampler", {"path": "a-sampler"}),
        ):
            got = http.post(route, json={"model_id": world.a_model, **body})
            assert (got.status_code, got.json()) == (404, not_found("model", world.a_model, "model_id"))
    assert files_of(gw, world.a.org_id) == a_files
    assert tinker_rows(gw, sessions=False) == before

    # A's state loads as A saved it
    with tinker.ServiceClient(base_url=gw.url, api_key="tml-" + world.a.key) as a:
        resumed = a.create_training_client_from_state(world.a_state).result()
        loss = resumed.forward([datum()], "cross_entropy").result().metrics["loss:sum"]
    assert math.isclose(loss, world.a_loss, rel_tol=1e-5), (loss, world.a_loss)
    wait_until_let_go(gw)


def sweep(world: World) -> list[tuple[str, str, dict[str, Any] | bytes, tuple[str, str, str | None]]]:
    """`(method, route, body, (kind, id, param) of the 404)`: each Tinker route that takes an id, with A's."""
    a_model, a_state, a_sampler_path = world.a_model, world.a_state, world.a_sampler_path
    return [
        (
            "POST",
            "/session_heartbeat",
            {"session_id": world.a_raw_session},
            ("session", world.a_raw_session, None),
        ),
        (
            "POST",
            f"/sessions/{world.a_raw_session}/finish",
            {"reason": {"type": "errored"}, "detail": "b was here"},
            ("session", world.a_raw_session, None),
        ),
        (
            "POST",
            "/create_model",
            {"session_id": world.a_session, "model_seq_id": 50, "base_model": "tiny-chat"},
            ("session", world.a_session, "session_id"),
        ),
        ("POST", "/get_info", {"model_id": a_model}, ("model", a_model, "model_id")),
        ("POST", "/forward_backward", forward_backward_body(a_model), ("model", a_model, "model_id")),
        ("POST", "/optim_step", {"model_id": a_model}, ("model", a_model, "model_id")),
        ("POST", "/save_weights", {"model_id": a_model, "path": "a-state"}, ("model", a_model, "model_id")),
        (
            "POST",
            "/save_weights_for_sampler",
            {"model_id": a_model, "path": "a-sampler"},
            ("model", a_model, "model_id"),
        ),
        (
            "POST",
            "/save_weights_for_sampler",
            {"model_id": a_model, "sampling_session_seq_id": 50},
            ("model", a_model, "model_id"),
        ),
        (
            "POST",
            "/load_weights",
            {"model_id": a_model, "path": world.b_state},
            ("model", a_model, "model_id"),
        ),
        (
            "POST",
            "/load_weights",
            {"model_id": world.b_model, "path": a_state},
            ("checkpoint", a_state, "path"),
        ),
        (
            "POST",
            "/load_weights",
            {"session_id": world.b_session, "model_seq_id": 50, "path": a_state},
            ("checkpoint", a_state, "path"),
        ),
        (
            "POST",
            "/load_weights",
            {"session_id": world.a_session, "model_seq_id": 50, "path": world.b_state},
            ("session", world.a_session, "session_id"),
        ),
        (
            "POST",
            "/create_sampling_session",
            {"session_id": world.a_session, "sampling_session_seq_id": 50, "base_model": "tiny-chat"},
            ("session", world.a_session, "session_id"),
        ),
        (
            "POST",
            "/create_sampling_session",
            {"session_id": world.b_session, "sampling_session_seq_id": 50, "model_path": a_sampler_path},
            ("checkpoint", a_sampler_path, "model_path"),
        ),
        ("GET", f"/samplers/{world.a_sampler}", {}, ("sampler", world.a_sampler, None)),
        (
            "POST",
            "/asample",
            {"sampling_session_id": world.a_sampler, "prompt": PROMPT, "sampling_params": SAMPLING},
            ("sampler", world.a_sampler, "sampling_session_id"),
        ),
        (
            "POST",
            "/asample",
            {"model_path": a_sampler_path, "prompt": PROMPT, "sampling_params": SAMPLING},
            ("checkpoint", a_sampler_path, "model_path"),
        ),
        (
            "POST",
            "/retrieve_future",
            {"request_id": world.a_request},
            ("future", world.a_request, "request_id"),
        ),
        (
            "POST",
            "/cancel_future",
            {"request_id": world.a_request},
            ("future", world.a_request, "request_id"),
        ),
        ("GET", f"/training_runs/{a_model}", {}, ("model", a_model, "model_id")),
        ("GET", f"/training_runs/{a_model}/checkpoints", {}, ("model", a_model, "model_id")),
        ("POST", "/weights_info", {"tinker_path": a_state}, ("checkpoint", a_state, "tinker_path")),
        (
            "POST",
            "/weights_info",
            {"tinker_path": a_sampler_path},
            ("checkpoint", a_sampler_path, "tinker_path"),
        ),
    ]


TAKES_NO_ID = {
    ("GET", "/api/v1/healthz"),
    ("POST", "/api/v1/client/config"),
    ("POST", "/api/v1/client/dynamic_config"),
    ("POST", "/api/v1/telemetry"),
    ("GET", "/api/v1/get_server_capabilities"),
    ("POST", "/api/v1/create_session"),
    ("GET", "/api/v1/training_runs"),  # lists: checked below to hold none of A's
    ("GET", "/api/v1/checkpoints"),
    # the organisation's billing reports: tests/tinker/test_billing.py shows another's usage is not in them
    ("GET", "/api/v1/billing/usage/events"),
    ("GET", "/api/v1/billing/usage/checkpoints/current"),
}


@pytest.mark.timeout(300)
def test_sweep_every_route_with_another_organisations_ids(gw: GatewayServer, world: World) -> None:
    calls = sweep(world)

    def template(route: str) -> str:
        for ident, name in ((world.a_sampler, "sampler_id"), (world.a_model, "model_id")):
            route = route.replace(ident, "{" + name + "}")
        return "/api/v1" + route.replace(world.a_raw_session, "{session_id}")

    swept = {(method, template(route)) for method, route, _, _ in calls}
    routes = {(method, r.path) for r in tinker_router.routes for method in r.methods}  # type: ignore[attr-defined]
    assert routes - TAKES_NO_ID == swept  # a new route that takes an id belongs in the sweep

    a_files, before = files_of(gw, world.a.org_id), tinker_rows(gw)
    with api(gw, world.b) as http:
        for method, route, body, (kind, ident, param) in calls:
            if isinstance(body, bytes):
                got = http.request(method, route, content=body)
            else:
                got = http.request(method, route, json=body if method == "POST" else None)
            assert (got.status_code, got.json()) == (404, not_found(kind, ident, param)), (method, route)
        runs = http.get("/training_runs").json()
        assert [r["training_run_id"] for r in runs["training_runs"]] == [world.b_model]
        listed = [c["tinker_path"] for c in http.get("/checkpoints").json()["checkpoints"]]
        assert listed == [world.b_state]
    assert files_of(gw, world.a.org_id) == a_files
    assert tinker_rows(gw) == before


def test_a_training_runs_offset_past_any_is_refused_naming_it(gw: GatewayServer, world: World) -> None:
    with api(gw, world.a) as http:
        got = http.get("/training_runs", params={"offset": 10**20})
    assert got.status_code == 400
    error = got.json()["error"]
    assert (error["param"], error["code"], error["type"]) == (
        "offset",
        "invalid_value",
        "invalid_request_error",
    )

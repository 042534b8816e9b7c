"""Large `forward_backward` batches and bodies.

A batch larger than one request may be is split by the SDK into requests within the server's bounds (the
body cap, the decoder's bound on protocol buffer fields), as the server's client config tells it, and a
batch so split trains exactly as the same data in one request of the training process does: the same
per-datum log-probabilities, the same summed loss, the same gradient (its norm at `optim_step`) and the
same adapter after the step. The gateway here takes bodies of at most 512 KiB, so a batch of long data goes
over its body cap in a few megabytes less than at the default cap, while the fields still bound the chunks
as they do by default.

A large body is decoded off the gateway's event loop, in its CPU pool, with the same answers.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types
from tinker.proto.request_conv import forward_backward_request_to_proto

from gateway.offload import Offload
from gateway.tinker.training import INLINE_BODY_BYTES
from gateway.tinker.wire import WireError
from gateway.tinker.wire_fields import MAX_FIELDS, fields_left
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.stack import GatewayServer, Tenant, admin_of
from tests.support.tinker import ADAPTER, assert_saved_adapter, datum

CAP = 512 * 1024
gw = gateway_fixture("tinker-batches", own_database=True, engine=False, max_request_body_bytes=CAP)
worker = worker_fixture(
    autouse=True, TUNEGATE_TRAINING_SLOTS="2", TUNEGATE_TINKER_IDLE_TIMEOUT_S="2"
)  # a finished test's model lets its slot go

ADAM = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0}
SEED = 11


def batch(count: int, tokens: int) -> list[list[int]]:
    """`count` sequences of `tokens + 1` token ids of `tiny-chat`'s vocabulary (next-token prediction)."""
    rng = random.Random(count * 7919 + tokens)
    return [[rng.randrange(1, 990) for _ in range(tokens + 1)] for _ in range(count)]


def one_body(rows: list[list[int]], model_id: str = "ts-0:train:0", *, nan_last: bool = False) -> bytes:
    """The whole batch as the SDK encodes one `forward_backward` request (`nan_last`: the last weight NaN)."""
    data = [datum(r) for r in rows]
    if nan_last:
        weights = [1.0] * (len(rows[-1]) - 2) + [math.nan]
        data[-1] = types.Datum(
            model_input=data[-1].model_input,
            loss_fn_inputs={"target_tokens": rows[-1][1:], "weights": weights},
        )
    request = types.ForwardBackwardRequest(
        model_id=model_id,
        seq_id=1,
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn="cross_entropy"),
    )
    return bytes(forward_backward_request_to_proto(request).SerializeToString())


def in_one_request(gw: GatewayServer, rows: list[list[int]], out: Path) -> dict[str, Any]:
    """The same step in the training process's own code, the whole batch in one `forward_backward`: its
    outputs and metrics, the gradient norm at `optim_step`, and the adapter after it (saved to `out`)."""
    from trainer.tinker_session import Session

    session = Session(
        {"base_path": str(gw.settings.base_model_path("tiny-chat")), "rank": 4, "seed": SEED,
         "train_attn": True, "train_mlp": True}
    )  # fmt: skip
    data = [
        {"tokens": r[:-1], "inputs": {"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)}} for r in rows
    ]
    fb = session.forward_backward({"loss_fn": "cross_entropy", "loss_fn_config": None, "data": data})
    step = session.optim_step(ADAM)
    session.save_state({"dir": str(out), "optimizer": False})
    return {**fb, "grad_norm": step["metrics"]["grad_norm:mean"], "adapter": load_file(out / ADAPTER)}


async def forward_backward_requests(gw: GatewayServer, model_id: str) -> int:
    assert gw.settings.database_url is not None
    conn = await asyncpg.connect(gw.settings.database_url)
    try:
        count = await conn.fetchval(
            "SELECT count(*) FROM tinker_requests WHERE model_id = $1 AND kind = 'forward_backward'", model_id
        )
        return int(count)
    finally:
        await conn.close()


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("case", "count", "tokens"),
    [
        ("over the body cap", 20, 2000),  # 16 bytes a token as the SDK sends them: 640 KB
        ("over the bound on fields", 560, 2),  # 15 fields a datum: 8,400 (and 50 KB)
    ],
)
def test_a_batch_over_one_requests_bounds_trains_as_one_request(
    gw: GatewayServer,
    org: Tenant,
    service: tinker.ServiceClient,
    tmp_path: Path,
    case: str,
    count: int,
    tokens: int,
) -> None:
    rows = batch(count, tokens)
    body = one_body(rows)
    if case == "over the body cap":
        assert len(body) > CAP
    else:
        assert len(body) < CAP
        with pytest.raises(WireError, match="protocol buffer fields"):
            fields_left(body, MAX_FIELDS)

    tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=SEED)
    fb = tc.forward_backward([datum(r) for r in rows], "cross_entropy")
    step = tc.optim_step(types.AdamParams(**ADAM))
    out, stepped = fb.result(), step.result()
    saved = tc.save_state("after").result()
    assert asyncio.run(forward_backward_requests(gw, tc.model_id)) > 1  # the SDK sent it in several requests

    want = in_one_request(gw, rows, tmp_path / "reference")
    assert len(out.loss_fn_outputs) == count
    for got, expected in zip(out.loss_fn_outputs, want["outputs"], strict=True):
        np.testing.assert_allclose(got["logprobs"].to_numpy(), expected["logprobs"], rtol=1e-5, atol=1e-5)
    assert out.metrics["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], rel=1e-5)
    assert stepped.metrics is not None
    assert stepped.metrics["grad_norm:mean"] == pytest.approx(want["grad_norm"], rel=1e-4)

    assert_saved_adapter(gw.settings.blob_dir, org.org_id, saved.path, want["adapter"])


# ---------------------------------------------------------------------------------------------- off the loop
fresh = gateway_fixture("tinker-offload", scope="function", engine=False, own_database=True)
"""A gateway of this test's own: nothing else has started its CPU pool."""
PROTOBUF = {"Content-Type": "application/x-protobuf"}


def offload(gateway: GatewayServer) -> Offload:
    app: Any = gateway.server.config.app
    work = app.state.resources.offload
    assert isinstance(work, Offload)
    return work


async def queued_payload(gw: GatewayServer, request_id: str) -> Any:
    assert gw.settings.database_url is not None
    conn = await asyncpg.connect(gw.settings.database_url)
    try:
        return json.loads(
            await conn.fetchval("SELECT payload FROM tinker_requests WHERE id = $1", request_id)
        )
    finally:
        await conn.close()


def test_a_large_body_is_decoded_off_the_event_loop(fresh: GatewayServer) -> None:
    """A small body is decoded on the event loop (the CPU pool is never started); a large one in the CPU
    pool: refused there with the field named as on the loop, or accepted and queued with all its data."""
    tenant = admin_of(fresh).tenant("offload")
    headers = {"X-API-Key": "tml-" + tenant.key}
    with httpx.Client(base_url=f"{fresh.url}/api/v1", headers=headers, timeout=120) as api:
        session = api.post("/create_session", json={"tags": [], "sdk_version": "test"}).json()["session_id"]
        made = api.post(
            "/create_model",
            json={
                "session_id": session,
                "model_seq_id": 0,
                "base_model": "tiny-chat",
                "lora_config": {"rank": 4},
            },
        )
        model_id = made.json()["model_id"]

        def post(body: bytes) -> httpx.Response:
            return api.post(
                "/forward_backward", content=body, headers={"Content-Type": "application/x-protobuf"}
            )

        def refused_at(body: bytes) -> str:
            answer = post(body)
            assert answer.status_code == 400, answer.text
            error = answer.json()["error"]
            assert error["message"] == "The tensor holds NaN or infinity; give finite numbers."
            return str(error["param"])

        small, large = batch(4, 2), batch(200, 2)
        assert len(one_body(small, model_id)) <= INLINE_BODY_BYTES < len(one_body(large, model_id))
        assert refused_at(one_body(small, model_id, nan_last=True)) == "data[3].loss_fn_inputs.weights"
        assert post(one_body(small, model_id)).status_code == 200
        assert offload(fresh)._pool is None  # decoded on the loop: the CPU pool was never started

        assert refused_at(one_body(large, model_id, nan_last=True)) == "data[199].loss_fn_inputs.weights"
        assert offload(fresh)._pool is not None  # started for the large body
        accepted = post(one_body(large, model_id))
        assert accepted.status_code == 200, accepted.text
    payload = asyncio.run(queued_payload(fresh, accepted.json()["request_id"]))
    assert payload == {
        "loss_fn": "cross_entropy",
        "loss_fn_config": {},
        "forward_only": False,
        "data": [
            {"tokens": r[:-1], "inputs": {"target_tokens": r[1:], "weights": [1.0, 1.0]}} for r in large
        ],
    }

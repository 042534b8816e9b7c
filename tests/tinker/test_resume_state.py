"""A training model let go between a client's calls goes on exactly where it was.

A worker saves a model it lets go (idle past `tinker_idle_timeout_s`, or yielding its slot to waiting work:
both save the same way) and its next holder loads that state in a new training process. A client may be let
go between its `forward_backward` and its `optim_step`: the gradients it computed, Adam's moments and its
step count all carry over, so the step, and every one after it, is the step of a model never let go (the
training process's own code run here in one piece, as `tests/tinker/test_batches.py` does).
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import asyncpg
import numpy as np
import pytest
import tinker
from safetensors.numpy import load_file
from tinker import types

from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.stack import GatewayServer, Tenant
from tests.support.tinker import ADAPTER, assert_saved_adapter, datum

gw = gateway_fixture("tinker-resume", own_database=True, engine=False)
worker = worker_fixture(
    autouse=True, TUNEGATE_TRAINING_SLOTS="1", TUNEGATE_TINKER_IDLE_TIMEOUT_S="1"
)  # a model is let go a second after its last answer

ROWS = [
    [5, 17, 42, 9, 33, 7, 61, 12],
    [8, 23, 4, 56, 19, 40, 11, 3],
]
ADAM = {"learning_rate": 0.01, "beta1": 0.9, "beta2": 0.95, "eps": 1e-12, "weight_decay": 0.0}
SEED = 7
RELEASE_S = 120.0
"""Longest wait for the worker to let an idle model go: the idle timeout, a save, a loaded machine."""


def raw(rows: list[list[int]]) -> list[dict[str, Any]]:
    """`rows` as the training process gets them from the worker."""
    return [
        {"tokens": r[:-1], "inputs": {"target_tokens": r[1:], "weights": [1.0] * (len(r) - 1)}} for r in rows
    ]


async def _holder_of(gw: GatewayServer, model_id: str) -> dict[str, Any]:
    assert gw.settings.database_url is not None
    conn = await asyncpg.connect(gw.settings.database_url)
    try:
        row = await conn.fetchrow(
            "SELECT worker_id, resume_path, lost FROM tinker_models WHERE id = $1", model_id
        )
    finally:
        await conn.close()
    assert row is not None
    return dict(row)


def let_go(gw: GatewayServer, model_id: str) -> None:
    """Wait until the worker, idle past its timeout, has saved the model and let it go (not lost it). Called
    after a request's answer, which its holder wrote while it held the model: the release came after it."""
    deadline = time.monotonic() + RELEASE_S
    while (row := asyncio.run(_holder_of(gw, model_id)))["worker_id"] is not None:
        assert time.monotonic() < deadline, "the idle model was never let go"
        time.sleep(0.2)
    assert row["lost"] is None
    assert row["resume_path"] is not None and Path(row["resume_path"]).is_dir()


def never_let_go(gw: GatewayServer, out: Path) -> dict[str, Any]:
    """The same calls in one training process's own code (`trainer.tinker_session.Session`), never saved nor
    let go: the outputs of each, the gradient norms of the steps, and the adapter at the end."""
    from trainer.tinker_session import Session

    session = Session(
        {"base_path": str(gw.settings.base_model_path("tiny-chat")), "rank": 4, "seed": SEED,
         "train_attn": True, "train_mlp": True}
    )  # fmt: skip

    def fb(rows: list[list[int]], *, forward_only: bool = False) -> dict[str, Any]:
        return session.forward_backward(
            {
                "loss_fn": "cross_entropy",
                "loss_fn_config": None,
                "data": raw(rows),
                "forward_only": forward_only,
            }
        )

    first, second = fb(ROWS[:1]), fb(ROWS[1:])
    step = session.optim_step(ADAM)
    both = fb(ROWS)
    again = session.optim_step(ADAM)
    after = fb(ROWS, forward_only=True)
    session.save_state({"dir": str(out), "optimizer": False})
    return {
        "outputs": [first, second, both, after],
        "grad_norms": [step["metrics"]["grad_norm:mean"], again["metrics"]["grad_norm:mean"]],
        "adapter": load_file(out / ADAPTER),
    }


def same_outputs(got: types.ForwardBackwardOutput, want: dict[str, Any]) -> None:
    assert len(got.loss_fn_outputs) == len(want["outputs"])
    for a, b in zip(got.loss_fn_outputs, want["outputs"], strict=True):
        np.testing.assert_allclose(a["logprobs"].to_numpy(), b["logprobs"], rtol=1e-5, atol=1e-5)
    assert got.metrics["loss:sum"] == pytest.approx(want["metrics"]["loss:sum"], rel=1e-5)


@pytest.mark.timeout(900)
def test_a_model_let_go_between_its_calls_trains_as_one_never_let_go(
    gw: GatewayServer, org: Tenant, service: tinker.ServiceClient, tmp_path: Path
) -> None:
    """Let go after each of: a `forward_backward` (its gradient carries over), a second one (added to it), a
    step (Adam's moments and step count carry over, the gradients it cleared do not come back), and another
    `forward_backward`; then a step, a forward pass and the adapter equal those of a model never let go."""
    tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=SEED)
    adam = types.AdamParams(**ADAM)
    first = tc.forward_backward([datum(ROWS[0])], "cross_entropy").result(timeout=300)
    let_go(gw, tc.model_id)
    second = tc.forward_backward([datum(ROWS[1])], "cross_entropy").result(timeout=300)
    let_go(gw, tc.model_id)
    step = tc.optim_step(adam).result(timeout=300)
    let_go(gw, tc.model_id)
    both = tc.forward_backward([datum(r) for r in ROWS], "cross_entropy").result(timeout=300)
    let_go(gw, tc.model_id)
    again = tc.optim_step(adam).result(timeout=300)
    after = tc.forward([datum(r) for r in ROWS], "cross_entropy").result(timeout=300)
    saved = tc.save_state("after").result(timeout=300)

    want = never_let_go(gw, tmp_path / "reference")
    for got, expected in zip([first, second, both, after], want["outputs"], strict=True):
        same_outputs(got, expected)
    assert step.metrics is not None and again.metrics is not None
    assert want["grad_norms"][0] > 0  # the first step had a gradient to take
    assert [step.metrics["grad_norm:mean"], again.metrics["grad_norm:mean"]] == pytest.approx(
        want["grad_norms"], rel=1e-4
    )
    assert_saved_adapter(gw.settings.blob_dir, org.org_id, saved.path, want["adapter"])

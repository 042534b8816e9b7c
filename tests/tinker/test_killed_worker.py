"""A worker killed while it holds a training model: the SDK raises an error within the stale time instead of
waiting forever, and the state saved before goes on in a new training client on a new worker."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import tinker
from tinker import types

from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, WorkerProcess

STALE_S = 3.0
gw = gateway_fixture("tinker-kill", own_database=True, stale_after_s=STALE_S)


def datum() -> types.Datum:
    tokens = [5, 17, 42, 9, 33, 7]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={"target_tokens": tokens[1:]}
    )


@pytest.mark.timeout(600)
def test_a_killed_worker_is_an_error_not_a_hang(gw: GatewayServer, gw_admin: Admin, tmp_path: Path) -> None:
    org = gw_admin.tenant("tinker-kill")
    first = WorkerProcess(gw.settings, tmp_path / "w1.log", TUNEGATE_STALE_AFTER_S=str(STALE_S))
    try:
        service = tinker.ServiceClient(base_url=gw.url, api_key="tml-" + org.key)
        tc = service.create_lora_training_client(base_model="tiny-chat", rank=4, seed=0)
        tc.forward_backward([datum()], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=0.01)).result()
        state = tc.save_state("before-kill").result().path
        first.kill()

        started = time.monotonic()
        with pytest.raises(tinker.RequestFailedError, match="stopped responding"):
            tc.forward_backward([datum()], "cross_entropy").result(timeout=120)
        assert time.monotonic() - started < 60
    finally:
        first.stop()

    second = WorkerProcess(gw.settings, tmp_path / "w2.log", TUNEGATE_STALE_AFTER_S=str(STALE_S))
    try:
        restored = service.create_training_client_from_state_with_optimizer(state).result()
        out = restored.forward_backward([datum()], "cross_entropy").result(timeout=120)
        assert out.metrics["loss:sum"] > 0
    finally:
        second.stop()

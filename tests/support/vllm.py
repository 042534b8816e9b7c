"""The tests' vLLM: one for the whole test session, shared by every module that asks for `vllm_server`
(registered in the root conftest), since each start imports torch and vLLM in three processes (20 s alone on
2 cores, a minute or more while the machine is busy); and `vllm_gateway_fixture`, a gateway of a module's
own in front of it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from inference.vllm import VllmSizes, VllmUnavailable, find_vllm
from tests.support.stack import GatewayServer, Services, start_gateway
from tunegate.processes import free_port
from tunegate.services import scratch_database
from tunegate.supervisor import Supervisor
from tunegate.vllm_process import VllmEngineProcess

VLLM_MAX_LORA_RANK = 16
"""The test vLLM's `--max-lora-rank` (vLLM's own default): an adapter of rank 32 is refused."""
VLLM_MAX_MODEL_LEN = 1024
"""The test vLLM's `--max-model-len`, under tiny-chat's own 2048: a prompt between the two reaches vLLM and
is refused there, not by the gateway."""
VLLM_MAX_LORAS = 2
"""The test vLLM's `--max-loras` and `--max-cpu-loras`: small, so that tests using four adapters in turn use
more than its batch takes and its host cache holds."""


@pytest.fixture(scope="session")
def vllm_server(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[VllmEngineProcess]:
    """vLLM serving the tiny model as ``tiny-chat`` (2 adapters a batch, 2 cached, rank 16 at most, 1024
    tokens, 1 GiB of KV cache) under a `Supervisor`, as ``tunegate up`` runs it: started again when it
    exits. One for the session: each start imports torch and vLLM in three processes. Skipped where vLLM
    is not installed (``scripts/install-vllm``) or cannot run."""
    try:
        install = find_vllm()
    except VllmUnavailable as exc:
        pytest.skip(str(exc))
    supervisor = Supervisor()
    server = VllmEngineProcess(
        install,
        tiny_model_dir,
        "tiny-chat",
        free_port(),
        tmp_path_factory.mktemp("vllm") / "vllm.log",
        sizes=VllmSizes(
            max_loras=VLLM_MAX_LORAS,
            max_cpu_loras=VLLM_MAX_LORAS,
            max_lora_rank=VLLM_MAX_LORA_RANK,
            max_model_len=VLLM_MAX_MODEL_LEN,
            kv_cache_gib=1.0,
        ),
    )
    try:
        supervisor.watch(server).wait_ready()
        yield server
    finally:
        supervisor.stop()


VLLM_SIZES: dict[str, Any] = {
    "engine_max_model_len": VLLM_MAX_MODEL_LEN,
    "engine_max_lora_rank": VLLM_MAX_LORA_RANK,
    "engine_max_loras": VLLM_MAX_LORAS,
    "engine_max_cpu_loras": VLLM_MAX_LORAS,
}
"""The settings of a gateway in front of the test vLLM, sized as `tunegate up` sizes both: requests and
adapters it cannot serve are refused by the gateway, jobs of a rank above its `--max-lora-rank` at create."""


def vllm_gateway_fixture(label: str, **settings: Any) -> Any:
    """A module fixture of a `GatewayServer` whose `tiny-chat` is served by the session's vLLM
    (`vllm_server`), sized as it is (`VLLM_SIZES`), with `settings` over the tests' defaults; on a database
    of its own, dropped afterwards, so that its worker (`tests.support.fixtures.worker_fixture`) and no other
    module's claims its jobs, eval runs and Tinker sessions. `label` names its data dir and its database."""

    @pytest.fixture(scope="module")
    def gateway(
        services: Services,
        tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory,
        vllm_server: VllmEngineProcess,
    ) -> Iterator[GatewayServer]:
        prefix = "tunegate_test_" + label.replace("-", "_")
        with scratch_database(services.pg_dsn, prefix) as database:
            server = start_gateway(
                services,
                database,
                tiny_model_dir,
                tmp_path_factory.mktemp(f"{label}-data"),
                upstreams=[vllm_server.url],
                **{**VLLM_SIZES, **settings},
            )
            try:
                yield server
            finally:
                server.stop()

    return gateway

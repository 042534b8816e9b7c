"""The tests' vLLM: one for the whole test session, shared by every module that asks for `vllm_server`
(registered in the root conftest), since each start imports torch and vLLM in three processes (20 s alone on
2 cores, a minute or more while the machine is busy)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from inference.vllm import VllmUnavailable, find_vllm
from tunegate.processes import Supervisor, free_port
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
        max_loras=VLLM_MAX_LORAS,
        max_cpu_loras=VLLM_MAX_LORAS,
        max_lora_rank=VLLM_MAX_LORA_RANK,
        max_model_len=VLLM_MAX_MODEL_LEN,
        kv_cache_gib=1.0,
    )
    try:
        supervisor.watch(server).wait_ready()
        yield server
    finally:
        supervisor.stop()

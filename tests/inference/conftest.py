"""Fixtures of the engine tests: random LoRA adapters and running engine servers, the embedded engine in a
thread and vLLM as a process (the tiny chat model comes from the root conftest)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from inference.vllm import VllmUnavailable, find_vllm
from tests.support.engine import make_lora_adapter
from tunegate.processes import ServerThread, Supervisor, free_port
from tunegate.vllm_process import VllmEngineProcess

MODEL_NAME = "tiny-chat"
VLLM_MAX_LORA_RANK = 16
"""The test vLLM's `--max-lora-rank` (vLLM's own default): an adapter of rank 32 is refused."""
VLLM_MAX_MODEL_LEN = 1024
"""The test vLLM's `--max-model-len`, under tiny-chat's own 2048: a prompt between the two reaches vLLM and
is refused there, not by the gateway."""
VLLM_MAX_LORAS = 2
"""The test vLLM's `--max-loras` and `--max-cpu-loras`: small, so that tests using four adapters in turn use
more than its batch takes and its host cache holds."""


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four distinct random adapters on the tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    return [make_lora_adapter(tiny_model_dir, root / f"lora{i}", seed=100 + i) for i in range(4)]


@dataclass
class RunningServer:
    """An engine app served by uvicorn in a background thread."""

    running: ServerThread

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def app(self) -> Any:
        return self.running.app

    @property
    def engine(self) -> Any:
        return self.app.state.router.engines[MODEL_NAME]

    def close(self) -> None:
        self.running.stop()


def start_server(models: dict[str, str], **kwargs: Any) -> RunningServer:
    """The embedded engine serving `models`, `kwargs` passed to `inference.server.create_app`."""
    import uvicorn

    from inference.server import create_app

    app = create_app(models, device="cpu", **kwargs)
    config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
    return RunningServer(ServerThread(uvicorn.Server(config), "engine").start())


@pytest.fixture(scope="session")
def engine_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """One shared engine serving the tiny model as ``tiny-chat`` (max_loras=4)."""
    running = start_server({MODEL_NAME: str(tiny_model_dir)}, max_loras=4)
    yield running
    running.close()


@pytest.fixture
def server_factory(tiny_model_dir: Path) -> Iterator[Callable[..., RunningServer]]:
    """Start extra engines with their own settings; they are stopped after the test."""
    started: list[RunningServer] = []

    def start(**kwargs: Any) -> RunningServer:
        running = start_server({MODEL_NAME: str(tiny_model_dir)}, **kwargs)
        started.append(running)
        return running

    yield start
    for running in started:
        running.close()


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
        MODEL_NAME,
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

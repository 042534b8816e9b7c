"""Fixtures of the engine tests: random LoRA adapters and the embedded engine served in a thread (the tiny
chat model and the session's vLLM, `vllm_server`, come from the root conftest)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine import make_lora_adapter
from tunegate.processes import ServerThread, free_port

MODEL_NAME = "tiny-chat"


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
        return self.app.state.models.engines[MODEL_NAME]

    def close(self) -> None:
        self.running.stop()


def start_server(models: dict[str, str], **kwargs: Any) -> RunningServer:
    """The embedded engine serving `models` on the CPU, `kwargs` its other `EngineOptions`."""
    import uvicorn

    from inference.options import EngineOptions
    from inference.server import create_app

    app = create_app(models, EngineOptions(device="cpu", **kwargs))
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

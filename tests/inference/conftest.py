"""Fixtures of the engine tests: random LoRA adapters and running engine servers (the tiny chat model comes
from the root conftest)."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.engine import make_lora_adapter

MODEL_NAME = "tiny-chat"


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four distinct random adapters on the tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    return [make_lora_adapter(tiny_model_dir, root / f"lora{i}", seed=100 + i) for i in range(4)]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class RunningServer:
    """An engine app served by uvicorn in a background thread."""

    url: str
    app: Any
    server: Any
    thread: threading.Thread

    @property
    def engine(self) -> Any:
        return self.app.state.router.engines[MODEL_NAME]

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def _start_server(models: dict[str, str], **kwargs: Any) -> RunningServer:
    import uvicorn

    from inference.server import create_app

    app = create_app(models, device="cpu", **kwargs)
    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, name=f"engine-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("engine server did not start")
        time.sleep(0.05)
    return RunningServer(url=f"http://127.0.0.1:{port}", app=app, server=server, thread=thread)


@pytest.fixture(scope="session")
def engine_server(tiny_model_dir: Path) -> Iterator[RunningServer]:
    """One shared engine serving the tiny model as ``tiny-chat`` (max_loras=4)."""
    running = _start_server({MODEL_NAME: str(tiny_model_dir)}, max_loras=4)
    yield running
    running.close()


@pytest.fixture
def server_factory(tiny_model_dir: Path) -> Iterator[Callable[..., RunningServer]]:
    """Start extra engines with their own settings; they are stopped after the test."""
    started: list[RunningServer] = []

    def start(**kwargs: Any) -> RunningServer:
        running = _start_server({MODEL_NAME: str(tiny_model_dir)}, **kwargs)
        started.append(running)
        return running

    yield start
    for running in started:
        running.close()

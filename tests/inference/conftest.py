"""Fixtures of the engine tests: the tiny chat model, random LoRA adapters, and running engine servers."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

MODEL_NAME = "tiny-chat"


def _make_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter on ``base_dir`` whose B matrices are random, so it changes the model's outputs."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = AutoModelForCausalLM.from_pretrained(base_dir)
    model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(0.0, 0.5)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-chat"))


@pytest.fixture(scope="session")
def adapter_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """Four distinct random adapters on the tiny model."""
    root = tmp_path_factory.mktemp("adapters")
    return [_make_adapter(tiny_model_dir, root / f"lora{i}", seed=100 + i) for i in range(4)]


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

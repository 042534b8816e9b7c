"""The embedded inference engine served in a background thread, and random LoRA adapters, for tests."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import uvicorn

from tests.support.stack import free_port


@dataclass
class EngineServer:
    """`inference.server.create_app` on a free port, served by uvicorn in a thread."""

    url: str
    server: uvicorn.Server
    thread: threading.Thread

    @classmethod
    def start(cls, models: dict[str, str], *, max_loras: int = 4) -> EngineServer:
        from inference.server import create_app

        port = free_port()
        app = create_app(models, device="cpu", max_loras=max_loras)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 60
        while not server.started:
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the engine did not start")
            time.sleep(0.05)
        return cls(f"http://127.0.0.1:{port}", server, thread)

    def models(self) -> dict[str, dict]:
        """`/v1/models` of the engine, by id."""
        with httpx.Client(trust_env=False) as http:
            return {m["id"]: m for m in http.get(f"{self.url}/v1/models").json()["data"]}

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def make_lora_adapter(base_dir: Path, out_dir: Path, seed: int, rank: int = 8) -> Path:
    """A LoRA adapter on `base_dir` whose B matrices are random, so it changes the model's outputs."""
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
    model.save_pretrained(str(out_dir))
    return out_dir

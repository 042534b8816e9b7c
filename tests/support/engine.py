"""The embedded inference engine served in a background thread, and random LoRA adapters, for tests."""

from __future__ import annotations

import asyncio
import secrets
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import httpx
import uvicorn

from gateway.deps import Resources
from tests.support.data import BASE
from tests.support.stack import GatewayServer, Tenant
from tunegate.processes import ServerThread, free_port


@dataclass
class EngineServer:
    """`inference.server.create_app` on a free port, served by uvicorn in a thread."""

    running: ServerThread

    @classmethod
    def start(cls, models: dict[str, str], *, max_loras: int = 4) -> EngineServer:
        from inference.options import EngineOptions
        from inference.server import create_app

        app = create_app(models, EngineOptions(device="cpu", max_loras=max_loras))
        config = uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning")
        return cls(ServerThread(uvicorn.Server(config), "engine").start())

    @property
    def url(self) -> str:
        return self.running.url

    def models(self) -> dict[str, dict]:
        """`/v1/models` of the engine, by id."""
        with httpx.Client(trust_env=False) as http:
            return {m["id"]: m for m in http.get(f"{self.url}/v1/models").json()["data"]}

    def stop(self) -> None:
        self.running.stop()


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


def register_model(
    database: str,
    org_id: str,
    model_id: str,
    adapter: str,
    *,
    checkpoint: str | None = None,
    base: str = "tiny-chat",
) -> None:
    """What the worker does when a job succeeds: a `models` row (and a checkpoint row with its job)."""

    async def run() -> None:
        conn = await asyncpg.connect(database)
        try:
            job_id = model_id.rsplit(":", 1)[-1]
            await conn.execute(
                "INSERT INTO fine_tuning_jobs (id, organization_id, model, training_file, status, method,"
                " seed) VALUES ($1, $2, $3, 'file-x', 'succeeded',"
                """ '{"type": "supervised", "supervised": {}}'::jsonb, 1)"""
                " ON CONFLICT (id) DO NOTHING",
                job_id,
                org_id,
                base,
            )
            await conn.execute(
                "INSERT INTO models (id, organization_id, base_model, job_id, adapter_path)"
                " VALUES ($1, $2, $3, $4, $5)",
                model_id,
                org_id,
                base,
                job_id,
                adapter,
            )
            if checkpoint is not None:
                await conn.execute(
                    "INSERT INTO fine_tuning_job_checkpoints (id, job_id, organization_id, step_number,"
                    " fine_tuned_model_checkpoint, path) VALUES ($1, $2, $3, 2, $4, $5)",
                    "ftckpt-" + secrets.token_hex(6),
                    job_id,
                    org_id,
                    checkpoint,
                    adapter,
                )
        finally:
            await conn.close()

    asyncio.run(run())


def ft_model(gateway: GatewayServer, org: Tenant, adapter: str | Path) -> str:
    """A fine-tuned model of `org` on `adapter` in `gateway`'s database, as the worker records one when a
    job succeeds."""
    model_id = f"ft:{BASE}:{org.org_id}::ftjob-{secrets.token_hex(6)}"
    assert gateway.settings.database_url is not None
    register_model(gateway.settings.database_url, org.org_id, model_id, str(adapter))
    return model_id


def resources_of(gateway: GatewayServer) -> Resources:
    """The running gateway's resources (engines and their adapter loads, the usage buffer, the guard)."""
    res = gateway.app.state.resources
    assert isinstance(res, Resources)
    return res

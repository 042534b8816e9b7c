"""A job's model is served the moment the job succeeds: the worker loads the adapter into every engine of
the base model before the job reports `succeeded`; its checkpoints are servable too."""

from __future__ import annotations

import asyncio
import json
import secrets
import time
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import asyncpg
import pytest

from tests.support.engine import EngineServer
from tests.support.stack import (
    Admin,
    GatewayServer,
    Services,
    WorkerProcess,
    drop_database,
    make_database,
    start_gateway,
)

pytestmark = pytest.mark.slow

RFT = [{"messages": [{"role": "user", "content": f"Say yes ({i})"}], "answer": "yes"} for i in range(8)]
GRADER = {
    "type": "string_check",
    "name": "yes",
    "input": "{{ sample.output_text }}",
    "reference": "y",
    "operation": "like",
}


@pytest.fixture(scope="module")
def served(
    services: Services, engine: EngineServer, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayServer, EngineServer]]:
    """A gateway, engine and worker on a database of their own (no other module's worker claims its jobs)."""
    name = f"tunegate_test_{secrets.token_hex(4)}"
    database = make_database(services.pg_dsn, name)
    gateway = start_gateway(
        services, database, tiny_model_dir, tmp_path_factory.mktemp("serve-data"), upstreams=[engine.url]
    )
    worker = WorkerProcess(gateway.settings, tmp_path_factory.mktemp("serve-worker") / "worker.log")
    yield gateway, engine
    worker.stop()
    gateway.stop()
    drop_database(services.pg_dsn, name)


async def _finished_at(gateway: GatewayServer, job_id: str) -> datetime:
    conn = await asyncpg.connect(gateway.settings.database_url)
    try:
        value: datetime = await conn.fetchval(
            "SELECT finished_at FROM fine_tuning_jobs WHERE id = $1", job_id
        )
        return value
    finally:
        await conn.close()


def test_trained_model_is_loaded_before_success_and_answers(
    served: tuple[GatewayServer, EngineServer],
) -> None:
    gateway, engine = served
    assert gateway.settings.admin_key is not None
    tenant = Admin(gateway.url, gateway.settings.admin_key.get_secret_value()).tenant("train-serve")
    client = tenant.client
    data = "\n".join(json.dumps(r) for r in RFT).encode()
    fid = client.files.create(file=("tasks.jsonl", data), purpose="fine-tune").id
    job = client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=fid,
        suffix="served",
        seed=3,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": GRADER,
                "hyperparameters": {
                    "batch_size": 2,
                    "num_generations": 4,
                    "max_completion_length": 8,
                    "max_steps": 4,
                    "checkpoint_every": 2,
                },
            },
        },
    )
    deadline = time.monotonic() + 240
    while (current := client.fine_tuning.jobs.retrieve(job.id)).status not in ("succeeded", "failed"):
        assert time.monotonic() < deadline, current.status
        time.sleep(0.2)
    assert current.status == "succeeded", current.error
    model = current.fine_tuned_model
    assert model is not None

    # The engine took the adapter before the job's success was committed (the database keeps microseconds).
    listed = engine.models()
    assert model in listed and listed[model]["parent"] == "tiny-chat"
    finished = asyncio.run(_finished_at(gateway, job.id))
    assert listed[model]["loaded_at"] < finished.timestamp()
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say yes"}], max_tokens=8, temperature=0, seed=1
    )
    assert reply.model == model and reply.choices[0].message.role == "assistant"
    assert reply.usage is not None and reply.usage.completion_tokens > 0

    chunks = list(
        client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": "Say yes"}],
            max_tokens=8,
            temperature=0,
            seed=1,
            stream=True,
        )
    )
    assert all(c.model == model for c in chunks)
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == reply.choices[0].message.content
    )

    # A checkpoint of the job is a model too (loaded on its first request).
    ckpt = client.fine_tuning.jobs.checkpoints.list(job.id).data[-1]
    assert ckpt.fine_tuned_model_checkpoint == f"{model}:ckpt-step-2"
    text = client.completions.create(model=ckpt.fine_tuned_model_checkpoint, prompt="Say", max_tokens=4)
    assert text.model == ckpt.fine_tuned_model_checkpoint and text.object == "text_completion"

    # Deleting the model unloads it from the engine.
    assert client.models.delete(model).deleted is True
    assert model not in engine.models()

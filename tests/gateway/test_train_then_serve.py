"""A job's model is served the moment the job succeeds: the worker loads the adapter into every engine of
the base model before the job reports `succeeded`; its checkpoints are servable too."""

from __future__ import annotations

import asyncio
import json
import time
from datetime import datetime

import asyncpg
import pytest

from tests.support.data import RFT, SAYS_YES
from tests.support.engine import EngineServer
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.stack import Admin, GatewayServer

pytestmark = pytest.mark.slow

gw = gateway_fixture("train-serve", own_database=True)
"""A gateway in front of the module's engine, and a worker, on a database of their own (no other module's
worker claims its jobs)."""
worker = worker_fixture(autouse=True)


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
    gw: GatewayServer, gw_admin: Admin, engine: EngineServer
) -> None:
    tenant = gw_admin.tenant("train-serve")
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
                "grader": SAYS_YES,
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
    finished = asyncio.run(_finished_at(gw, job.id))
    reply = client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say yes"}], max_tokens=8, temperature=0, seed=1
    )
    assert reply.model == model and reply.choices[0].message.role == "assistant"
    version = reply.system_fingerprint  # engines know the model by its version
    assert version is not None and version in listed and listed[version]["parent"] == "tiny-chat"
    assert listed[version]["loaded_at"] < finished.timestamp()
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
    assert version not in engine.models()

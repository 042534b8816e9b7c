"""Training through the whole stack: the openai SDK -> gateway -> queue -> worker -> trainer process.

One worker process serves this module; tests that kill or restart workers start their own.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import load_file

from tests.support.data import DPO, SFT
from tests.support.fixtures import worker_fixture
from tests.support.jobs import (
    all_events,
    long_sft_job,
    metrics_steps,
    rl_job,
    trainer_processes,
    upload_rows,
    wait_for,
    wait_trainer_gone,
)
from tests.support.stack import Admin, GatewayServer, Services, Tenant, WorkerProcess, make_settings

pytestmark = pytest.mark.slow

worker = worker_fixture(of="stack", TUNEGATE_STALE_AFTER_S="4", TUNEGATE_REQUEUE_INTERVAL_S="2")


def _assert_adapter_trained(stack: GatewayServer, t: Tenant, job_id: str) -> None:
    adapter = stack.settings.blob_dir / "adapters" / t.org_id / job_id / "adapter_model.safetensors"
    tensors = load_file(str(adapter))
    lora_b = [v for k, v in tensors.items() if "lora_B" in k]
    assert lora_b and any(float(v.abs().max()) > 0 for v in lora_b)  # LoRA B starts at zero


def test_supervised_job_succeeds(stack: GatewayServer, worker: WorkerProcess, tenant: Tenant) -> None:
    job = tenant.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=upload_rows(tenant, SFT),
        suffix="sft",
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {
                    "n_epochs": 2,
                    "batch_size": 4,
                    "checkpoint_every": 2,
                }
            },
        },
    )
    done = wait_for(tenant, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model == f"ft:tiny-chat:{tenant.org_id}:sft:{job.id}"
    assert done.trained_tokens and done.trained_tokens > 0 and done.finished_at
    assert metrics_steps(tenant, job.id) == [1, 2, 3, 4]
    metric = next(e for e in all_events(tenant, job.id) if e.type == "metrics")
    assert {"step", "train_loss", "learning_rate"} <= set(metric.data)
    ckpts = tenant.client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert [c.step_number for c in ckpts] == [4, 2]
    assert ckpts[0].fine_tuned_model_checkpoint == f"{done.fine_tuned_model}:ckpt-step-4"
    assert ckpts[0].object == "fine_tuning.job.checkpoint" and ckpts[0].metrics.train_loss is not None
    assert done.fine_tuned_model in [m.id for m in tenant.client.models.list()]
    # The job shows exactly the hyperparameters the trainer reported using (auto ones resolved at create).
    shown = done.method.supervised.hyperparameters.model_dump()
    used = next(e.data for e in all_events(tenant, job.id) if e.message.startswith("Hyperparameters: "))
    assert used["learning_rate"] > 0 and used["lora_r"] == 8
    assert all(shown.get(name) == value for name, value in used.items()), (shown, used)
    csv = tenant.client.files.content(done.result_files[0]).read().decode()
    assert csv.splitlines()[0].startswith("step,") and len(csv.splitlines()) == 5
    _assert_adapter_trained(stack, tenant, job.id)


def test_dpo_job_succeeds(stack: GatewayServer, worker: WorkerProcess, tenant: Tenant) -> None:
    job = tenant.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=upload_rows(tenant, DPO),
        method={
            "type": "dpo",
            "dpo": {
                "hyperparameters": {
                    "n_epochs": 1,
                    "batch_size": 4,
                    "beta": 0.1,
                }
            },
        },
    )
    done = wait_for(tenant, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    assert metrics_steps(tenant, job.id) == [1, 2]
    _assert_adapter_trained(stack, tenant, job.id)


def test_failing_trainer_fails_the_job(services: Services, own_database: str, tmp_path: Path) -> None:
    """A node whose base model folder is broken: the trainer fails, the job reports it in one line."""
    broken = tmp_path / "broken-model"
    broken.mkdir()
    (broken / "config.json").write_text("{not json")
    settings = make_settings(
        data_dir=tmp_path / "data", database_url=own_database, redis_url=services.redis_url, tiny_model=broken
    )
    gateway = GatewayServer(settings).start()
    worker = WorkerProcess(settings, tmp_path / "worker.log")
    try:
        assert settings.admin_key is not None
        t = Admin(gateway.url, settings.admin_key.get_secret_value()).tenant("broken-node")
        job = t.client.fine_tuning.jobs.create(
            model="tiny-chat",
            training_file=upload_rows(t, SFT),
            method={"type": "supervised", "supervised": {"hyperparameters": {"max_steps": 2}}},
        )
        done = wait_for(t, job.id, ("succeeded", "failed"))
        events = all_events(t, job.id)
    finally:
        worker.stop()
        gateway.stop()
    assert done.status == "failed" and done.error is not None
    assert done.error.code == "invalid_model", done.error
    assert "\n" not in done.error.message and "Traceback" not in done.error.message
    assert trainer_processes(job.id) == []
    assert any(e.level == "error" and e.message.startswith("Job failed") for e in events)


def _long_rl(t: Tenant, steps: int) -> Any:
    """An RL job whose steps (generation included) are slow enough to be interrupted mid-run."""
    return rl_job(t, steps=steps)


def _long_sft(t: Tenant, steps: int = 400) -> Any:
    return long_sft_job(t, SFT, steps=steps)


def _wait_steps(t: Tenant, job_id: str, at_least: int, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while len(metrics_steps(t, job_id)) < at_least:
        assert time.monotonic() < deadline, "training did not progress"
        time.sleep(0.3)


def test_cancel_while_running(stack: GatewayServer, worker: WorkerProcess, tenant: Tenant) -> None:
    job = _long_sft(tenant)
    _wait_steps(tenant, job.id, 2)
    assert trainer_processes(job.id)
    assert tenant.client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    wait_trainer_gone(job.id, timeout=20)
    assert wait_for(tenant, job.id, ("cancelled",)).status == "cancelled"


def test_pause_then_resume_continues(stack: GatewayServer, worker: WorkerProcess, tenant: Tenant) -> None:
    jobs = tenant.client.fine_tuning.jobs
    job = _long_rl(tenant, steps=40)
    _wait_steps(tenant, job.id, 4)
    assert jobs.pause(job.id).status == "paused"
    wait_trainer_gone(job.id)
    saved = max(c.step_number for c in jobs.checkpoints.list(job.id).data)
    paused_steps = metrics_steps(tenant, job.id)
    assert jobs.retrieve(job.id).status == "paused" and saved >= 3
    assert jobs.resume(job.id).status == "queued"
    done = wait_for(tenant, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    assert metrics_steps(tenant, job.id) == list(range(1, 41))
    assert len(paused_steps) < 40
    messages = [e.message for e in all_events(tenant, job.id)]
    assert any("resuming from step" in m for m in messages), messages


def test_two_organisations_interleave(
    stack: GatewayServer, worker: WorkerProcess, tenant: Tenant, other_tenant: Tenant
) -> None:
    jobs_a = [_long_sft(tenant, steps=3) for _ in range(3)]
    job_b = _long_sft(other_tenant, steps=3)
    for j in jobs_a:
        assert wait_for(tenant, j.id, ("succeeded", "failed")).status == "succeeded"
    assert wait_for(other_tenant, job_b.id, ("succeeded", "failed")).status == "succeeded"

    def started(t: Tenant, job_id: str) -> float:
        return min(
            e.created_at for e in all_events(t, job_id) if e.message.startswith("Fine-tuning job started")
        )

    # B's one job does not wait for all of A's: it starts before A's last job.
    assert started(other_tenant, job_b.id) <= started(tenant, jobs_a[2].id)


def test_worker_killed_mid_job_resumes(
    stack: GatewayServer, worker: WorkerProcess, tenant: Tenant, tmp_path: Path
) -> None:
    # A second worker takes the job while the module's worker is stopped, then is SIGKILLed.
    worker.proc.send_signal(signal.SIGSTOP)
    try:
        victim = WorkerProcess(
            stack.settings,
            tmp_path / "victim.log",
            TUNEGATE_STALE_AFTER_S="4",
            TUNEGATE_REQUEUE_INTERVAL_S="2",
        )
        job = _long_rl(tenant, steps=40)
        _wait_steps(tenant, job.id, 5)
        victim.kill()
        wait_trainer_gone(job.id, timeout=20)  # the trainer dies with its worker
        victim.stop()
    finally:
        worker.proc.send_signal(signal.SIGCONT)
    done = wait_for(tenant, job.id, ("succeeded", "failed"))
    assert done.status == "succeeded", done.error
    events = all_events(tenant, job.id)
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert sorted(steps) == list(range(1, 41))  # each step once, also the replayed ones
    ckpts = [c.step_number for c in tenant.client.fine_tuning.jobs.checkpoints.list(job.id, limit=100)]
    assert len(ckpts) == len(set(ckpts))
    assert any("re-queued" in e.message for e in events)

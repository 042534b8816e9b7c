"""Workers own devices and jobs ask for them: multi-process training through the whole stack, on CPU.

The module has a database of its own and two workers: `pair` owns two CPU devices, `single` one. A job with
`gpus: 2` trains in two processes (DDP over gloo, launched by `accelerate launch`); only rank 0 reports, so
every step, checkpoint and milestone is recorded once.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path
from typing import Any

import openai
import pytest
from safetensors.torch import load_file

from gateway.settings import Settings
from gateway.work.devices import Device, DevicePool, cpu_devices, launch, parse_devices, strategy
from tests.support.data import SFT
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.jobs import (
    all_events,
    long_sft_job,
    metrics_steps,
    rl_job,
    trainer_processes,
    wait_for,
    wait_trainer_gone,
)
from tests.support.stack import GatewayServer, Tenant, WorkerProcess, admin_of
from trainer.contract import ModelDefaults, devices_for, estimate_parameters

# ---- the pieces, without a stack -------------------------------------------------------------------------


def test_devices_setting_names_gpus_or_cpu_processes() -> None:
    assert parse_devices("auto", cpu_slots=2, gpus=0) == [Device("cpu", 0), Device("cpu", 1)]
    assert parse_devices("auto", cpu_slots=1, gpus=4) == [Device("cuda", i) for i in range(4)]
    assert parse_devices("3,1", cpu_slots=1) == [Device("cuda", 1), Device("cuda", 3)]
    assert parse_devices("cpu:3", cpu_slots=1) == cpu_devices(3)
    for bad in ("cpu:0", "", "-1"):
        with pytest.raises(ValueError):
            parse_devices(bad, cpu_slots=1)
    # CPU devices split the cores evenly, each at least one.
    assert [d.cores for d in cpu_devices(2, cores=8)] == [(0, 1, 2, 3), (4, 5, 6, 7)]
    assert [d.cores for d in cpu_devices(3, cores=2)] == [(0,), (1,), (0,)]


def test_a_pool_never_hands_out_a_device_twice() -> None:
    async def run() -> None:
        pool = DevicePool(cpu_devices(3, cores=3))
        first = pool.take(2)
        with pytest.raises(ValueError):
            pool.take(2)
        second = pool.take(1)
        assert not {*first} & {*second} and pool.free == []
        waiter = asyncio.create_task(pool.wait_for_free())
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await pool.give_back(first)
        assert await asyncio.wait_for(waiter, 1) == 2
        assert pool.take(2) == first

    asyncio.run(run())


def test_launch_confines_the_trainer_and_chooses_the_strategy(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    one = launch(cpu_devices(1, cores=2), "/w/spec.json", parameters=10**6, port=1234)
    assert one.argv[1:] == ["-m", "trainer", "run", "/w/spec.json"] and one.cpus == {0, 1}
    assert one.env == {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "2"}
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the host's own cap holds
    capped = launch(cpu_devices(1, cores=2), "/w/spec.json", parameters=10**6, port=1234)
    assert capped.env["OMP_NUM_THREADS"] == "1" and capped.cpus == {0, 1}
    pair = launch(cpu_devices(2, cores=2), "/w/spec.json", parameters=10**6, port=1234)
    assert pair.argv[1:3] == ["-m", "accelerate.commands.launch"] and "--multi_gpu" in pair.argv
    assert pair.argv[pair.argv.index("--num_processes") + 1] == "2"
    assert pair.argv[-4:] == ["-m", "trainer", "run", "/w/spec.json"] and pair.cpus == {0, 1}
    gpus = [Device("cuda", 2), Device("cuda", 5)]
    big = launch(gpus, "/w/spec.json", parameters=70 * 10**9, port=1234)
    assert big.env == {"CUDA_VISIBLE_DEVICES": "2,5"} and "--use_fsdp" in big.argv and big.cpus is None
    assert [strategy(1, 10**12), strategy(2, 10**9), strategy(2, 10**10)] == ["single", "ddp", "fsdp"]


def test_auto_devices_follow_the_model_size() -> None:
    qwen_half = {"hidden_size": 896, "num_hidden_layers": 24, "vocab_size": 151936, "intermediate_size": 4864}
    llama_70 = {
        "hidden_size": 8192,
        "num_hidden_layers": 80,
        "vocab_size": 128256,
        "intermediate_size": 28672,
    }
    assert 0.45e9 < estimate_parameters({**qwen_half, "tie_word_embeddings": True}) < 0.6e9
    assert 69e9 < estimate_parameters(llama_70) < 81e9
    assert devices_for(ModelDefaults(parameters=estimate_parameters(qwen_half))) == 1
    assert devices_for(ModelDefaults(parameters=estimate_parameters(llama_70))) == 8
    assert devices_for(ModelDefaults(parameters=14 * 10**9)) == 2


# ---- through the stack -----------------------------------------------------------------------------------

pytestmark = pytest.mark.slow

gw = gateway_fixture("devices", engine=False, own_database=True)
pair = worker_fixture(
    TUNEGATE_DEVICES="cpu:2", TUNEGATE_REQUEUE_INTERVAL_S="1", TUNEGATE_COLLECTIVE_TIMEOUT_S="60"
)
single = worker_fixture(TUNEGATE_DEVICES="cpu:1", TUNEGATE_REQUEUE_INTERVAL_S="1")


@pytest.fixture(scope="module")
def org(gw: GatewayServer) -> Tenant:
    return admin_of(gw).tenant("devices")


def _sft(t: Tenant, gpus: int, *, steps: int = 4, batch_size: int = 2) -> Any:
    return long_sft_job(t, SFT, steps=steps, checkpoint_every=2, gpus=gpus, batch_size=batch_size)


def _placement(t: Tenant, job_id: str) -> dict[str, Any]:
    """The worker and devices of the job's (first) attempt, from its event."""
    found = [e for e in all_events(t, job_id) if e.message.startswith("Training on")]
    assert found, [e.message for e in all_events(t, job_id)]
    return dict(found[-1].data)


def _wait_announced(gw: GatewayServer, devices: int) -> None:
    from gateway.work import store

    async def largest() -> int | None:
        import asyncpg

        conn = await asyncpg.connect(gw.settings.database_url)
        try:
            return await store.largest_worker(conn, within_s=60)
        finally:
            await conn.close()

    deadline = time.monotonic() + 60
    while asyncio.run(largest()) != devices:
        assert time.monotonic() < deadline, "the workers never announced their devices"
        time.sleep(0.3)


@pytest.mark.timeout(600)
def test_jobs_run_where_their_devices_fit(
    gw: GatewayServer, pair: WorkerProcess, single: WorkerProcess, org: Tenant
) -> None:
    _wait_announced(gw, 2)
    with pytest.raises(openai.BadRequestError) as refused:
        _sft(org, 3)
    error = refused.value.body
    assert isinstance(error, dict) and error["param"] == "method.supervised.hyperparameters.gpus"
    assert error["code"] == "too_many_devices" and "largest worker has 2" in error["message"]

    jobs = {gpus: _sft(org, gpus, steps=6) for gpus in (2, 1)}
    extra = _sft(org, 1, steps=6)
    done = {job.id: wait_for(org, job.id, timeout=420) for job in (*jobs.values(), extra)}
    assert all(j.status == "succeeded" for j in done.values()), {k: v.error for k, v in done.items()}

    placed = {job_id: _placement(org, job_id) for job_id in done}
    assert placed[jobs[2].id]["worker"].split(":")[1] == str(pair.proc.pid)  # host:pid:suffix
    assert placed[jobs[2].id]["devices"] == ["cpu:0", "cpu:1"]
    for job_id, where in placed.items():
        assert len(where["devices"]) == (2 if job_id == jobs[2].id else 1)
    # No device held by two jobs at once: a job's devices are taken from its start event to its end.
    spans = []
    for job_id, where in placed.items():
        start = next(e.created_at for e in all_events(org, job_id) if e.message.startswith("Training on"))
        spans.append((where["worker"], set(where["devices"]), start, done[job_id].finished_at, job_id))
    for a in spans:
        for b in spans:
            if a[4] < b[4] and a[0] == b[0] and a[1] & b[1]:
                assert a[3] <= b[2] or b[3] <= a[2], (a, b)


def _assert_reported_once(t: Tenant, job_id: str, steps: int) -> None:
    """Every step, checkpoint and milestone of a job on two processes recorded once (rank 0 reports)."""
    assert metrics_steps(t, job_id) == list(range(1, steps + 1))
    listed = [c.step_number for c in t.client.fine_tuning.jobs.checkpoints.list(job_id).data]
    assert listed and sorted(listed) == sorted(set(listed)) and max(listed) == steps
    messages = [e.message for e in all_events(t, job_id)]
    assert len([m for m in messages if m.startswith("Loaded model")]) == 1, messages


@pytest.mark.timeout(600)
def test_supervised_and_reinforcement_train_on_two_processes(
    gw: GatewayServer, pair: WorkerProcess, org: Tenant
) -> None:
    sft = _sft(org, 2, steps=4)
    rl = rl_job(org, steps=3, checkpoint_every=3, gpus=2, max_completion_length=8)
    for job, steps in ((sft, 4), (rl, 3)):
        done = wait_for(org, job.id, timeout=420)
        assert done.status == "succeeded", done.error
        assert done.method.type in ("supervised", "reinforcement")
        hp = getattr(done.method, done.method.type).hyperparameters
        assert hp.gpus == 2  # type: ignore[union-attr]
        _assert_reported_once(org, job.id, steps)
        assert _placement(org, job.id)["devices"] == ["cpu:0", "cpu:1"]
        adapter = gw.settings.blob_dir / "adapters" / org.org_id / job.id / "adapter_model.safetensors"
        lora_b = [v for k, v in load_file(str(adapter)).items() if "lora_B" in k]
        assert lora_b  # saved once, by rank 0, whole
        if job is sft:  # LoRA B starts at zero: the two processes' averaged gradients moved it
            assert any(float(v.abs().max()) > 0 for v in lora_b)
    rewards = [e.data for e in all_events(org, rl.id) if e.type == "metrics" and "reward_mean" in e.data]
    assert len(rewards) == 3 and all(0.0 <= d["reward_mean"] <= 1.0 for d in rewards)


def _ranks(job_id: str) -> list[int]:
    """The rank processes of a job on several devices (not their launcher)."""
    ranks = []
    for pid in trainer_processes(job_id):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"accelerate" not in cmd:
            ranks.append(pid)
    return ranks


def _wait_ranks_training(t: Tenant, job_id: str) -> list[int]:
    deadline = time.monotonic() + 240
    while not (len(metrics_steps(t, job_id)) >= 1 and len(_ranks(job_id)) == 2):
        assert time.monotonic() < deadline, "the job never trained on two processes"
        time.sleep(0.3)
    return _ranks(job_id)


@pytest.mark.timeout(600)
def test_cancel_stops_every_rank(gw: GatewayServer, pair: WorkerProcess, org: Tenant) -> None:
    job = _sft(org, 2, steps=400, batch_size=2)
    _wait_ranks_training(org, job.id)
    assert org.client.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    wait_trainer_gone(job.id, timeout=60)
    assert wait_for(org, job.id, ("cancelled",)).status == "cancelled"


@pytest.mark.timeout(600)
def test_pause_stops_every_rank_and_resume_resumes_them(
    gw: GatewayServer, pair: WorkerProcess, org: Tenant
) -> None:
    jobs = org.client.fine_tuning.jobs
    steps = 48  # enough that the job is still training when the pause lands, on a fast quiet machine too
    job = _sft(org, 2, steps=steps)
    _wait_ranks_training(org, job.id)
    while not jobs.checkpoints.list(job.id).data:
        time.sleep(0.3)
    assert jobs.pause(job.id).status == "paused"
    wait_trainer_gone(job.id, timeout=60)
    paused_at = metrics_steps(org, job.id)
    assert jobs.resume(job.id).status == "queued"
    done = wait_for(org, job.id, timeout=420)
    assert done.status == "succeeded", done.error
    assert len(paused_at) < steps and metrics_steps(org, job.id) == list(range(1, steps + 1))
    messages = [e.message for e in all_events(org, job.id)]
    assert any("resuming from step" in m for m in messages), messages
    assert len([m for m in messages if m.startswith("Training on 2 device(s)")]) == 2  # both attempts


@pytest.mark.timeout(600)
def test_a_killed_rank_ends_the_attempt_instead_of_hanging_it(
    gw: GatewayServer, pair: WorkerProcess, org: Tenant
) -> None:
    job = _sft(org, 2, steps=400, batch_size=2)
    ranks = _wait_ranks_training(org, job.id)
    os.kill(ranks[-1], signal.SIGKILL)
    # The launcher sees its rank die and stops the other: nothing of that attempt is left waiting on it.
    deadline = time.monotonic() + 90
    while any(pid in _ranks(job.id) for pid in ranks):
        assert time.monotonic() < deadline, "a rank of the broken attempt is still running"
        time.sleep(0.3)
    done = wait_for(org, job.id, ("failed", "succeeded", "cancelled"), timeout=120)
    assert done.status == "failed" and done.error and done.error.message, done
    assert done.error.code in ("trainer_crashed", "trainer_error"), done.error
    wait_trainer_gone(job.id, timeout=60)


def test_settings_name_the_devices() -> None:
    assert Settings().devices == "auto" and Settings().vllm_server_gpus == 0

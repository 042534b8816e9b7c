"""A worker killed while its job's trainer holds a minted key: the worker that takes the job back revokes the
key then, long before it would expire (`KEY_TTL_S`), so the key of a trainer that died answers 401.

The module has a database, a gateway (serving `tiny-chat` from the module's engine) and workers of its own.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.jobs.running import key_name
from gateway.worker.job.process import KEY_TTL_S
from tests.support.data import BASE
from tests.support.fixtures import gateway_fixture
from tests.support.jobs import all_events, graded_rl_job, trainer_processes, wait_for
from tests.support.stack import Admin, GatewayServer, Tenant, WorkerProcess
from trainer.contract import INFERENCE_KEY_ENV

STALE_S = 3.0
AUTH_CACHE_S = 1.0
WORKER = {
    "TUNEGATE_STALE_AFTER_S": str(STALE_S),
    "TUNEGATE_HEARTBEAT_INTERVAL_S": "0.5",
    "TUNEGATE_REQUEUE_INTERVAL_S": "1",
}
gw = gateway_fixture("keyreap", own_database=True, auth_cache_ttl_s=AUTH_CACHE_S)

JUDGE = {
    "type": "score_model",
    "name": "judge",
    "model": BASE,
    "input": [{"role": "user", "content": "Score 0 to 1: {{ item.question }} -> {{ sample.output_text }}"}],
    "sampling_params": {"temperature": 0, "max_completion_tokens": 2},
}


def long_rl_job(t: Tenant) -> Any:
    """A reinforcement job graded by a model (so its trainer gets a key) that trains long enough to be
    killed mid-run."""
    return graded_rl_job(t, JUDGE, n_epochs=50, max_steps=400, checkpoint_every=100)


def trainer_key(job_id: str, timeout: float = 240) -> str:
    """The key in the environment of the job's trainer, once it runs."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in trainer_processes(job_id):
            try:
                environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
            except OSError:
                continue
            for entry in environ:
                name, _, value = entry.decode(errors="replace").partition("=")
                if name == INFERENCE_KEY_ENV:
                    return value
        assert time.monotonic() < deadline, f"no trainer of {job_id} with a key"
        time.sleep(0.2)


def chat(gw: GatewayServer, key: str) -> openai.types.chat.ChatCompletion:
    client = openai.OpenAI(base_url=f"{gw.url}/v1", api_key=key, max_retries=0, timeout=120)
    return client.chat.completions.create(
        model=BASE, messages=[{"role": "user", "content": "hi"}], max_tokens=1
    )


def job_keys(admin: Admin, t: Tenant, job_id: str) -> list[dict[str, Any]]:
    listed = admin.http.get(f"/v1/admin/organizations/{t.org_id}/api_keys", params={"kind": "job"}).json()
    return [k for k in listed["data"] if k["name"] == key_name(job_id)]


@pytest.mark.timeout(900)
def test_a_dead_workers_job_key_is_revoked_when_the_job_is_taken_back(
    gw: GatewayServer, gw_admin: Admin, tmp_path: Path
) -> None:
    org = gw_admin.tenant("keyreap")
    first = WorkerProcess(gw.settings, tmp_path / "w1.log", **WORKER)
    second: WorkerProcess | None = None
    try:
        job = long_rl_job(org)
        secret = trainer_key(job.id)
        assert chat(gw, secret).usage is not None  # the trainer's key calls the gateway's chat route
        (live,) = job_keys(gw_admin, org, job.id)
        assert live["revoked_at"] is None
        first.kill()  # its trainer dies with it (PR_SET_PDEATHSIG); nothing revokes the key on the way out

        second = WorkerProcess(gw.settings, tmp_path / "w2.log", **WORKER)
        deadline = time.monotonic() + 120
        while not any("stopped responding" in e.message for e in all_events(org, job.id)):
            assert time.monotonic() < deadline, "the job was not taken back from its dead worker"
            time.sleep(0.3)

        # taken back: the dead trainer's key is revoked, though it had minutes left to live
        (reaped,) = [k for k in job_keys(gw_admin, org, job.id) if k["id"] == live["id"]]
        assert reaped["revoked_at"] is not None
        assert reaped["expires_at"] - reaped["revoked_at"] > KEY_TTL_S / 2
        # and refused once the gateway's cache of it lapses (a second or so; it would expire minutes later)
        refused_by = time.monotonic() + 30 * AUTH_CACHE_S
        while True:
            try:
                chat(gw, secret)
            except openai.AuthenticationError as exc:
                assert exc.status_code == 401 and exc.code == "invalid_api_key"
                break
            assert time.monotonic() < refused_by, "a revoked key is still accepted"
            time.sleep(0.2)
        org.client.fine_tuning.jobs.cancel(job.id)
        assert wait_for(org, job.id, timeout=120).status == "cancelled"
    finally:
        first.stop()
        if second is not None:
            second.stop()

"""Env servers (`tunegate env-server`): a worker's RL jobs score their environment on the pool's servers, and
a server killed mid-job costs the job nothing.

The module has a gateway and database of its own, a worker naming a pool of its own, and two env servers of
that pool. Every job trains a few GRPO steps of the tiny model.
"""

from __future__ import annotations

import json
import os
import secrets
import signal
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from envsdk.remote_wire import live_servers, pool_key
from envsdk.venvs import VENV_DIR_ENV, builder_env
from gateway.settings import Settings
from gateway.worker.job.process import env_pool_env
from tests.gateway.test_environments import upload_package, write_package
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.jobs import all_events, metrics, upload_rows, wait_for
from tests.support.stack import Admin, GatewayServer, Tenant
from trainer.spec import ENV_POOL_NAME_ENV, ENV_POOL_REDIS_ENV
from tunegate.processes import EnvServerProcess

pytestmark = pytest.mark.slow

POOL = "test-" + secrets.token_hex(3)
STEPS = 4
PROMPTS = 2
GENERATIONS = 2
COMPLETIONS = STEPS * PROMPTS * GENERATIONS
"""Completions of a job: each step scores ``PROMPTS x GENERATIONS``."""
SLOW_ARITHMETIC = """import time

from envsdk import SingleTurnEnv, completion_text


class SlowArithmetic(SingleTurnEnv):
    def reward(self, task, completion):
        time.sleep(float(self.config.get("sleep_s", 0)))
        return 1.0 if completion_text(completion).strip() == task["answer"] else 0.0
"""

gw = gateway_fixture("envsrv", engine=False, own_database=True)
worker = worker_fixture(of="gw", TUNEGATE_ENV_POOL=POOL)


@pytest.fixture(scope="module")
def servers(
    gw: GatewayServer, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, EnvServerProcess]]:
    """Two env servers of the module's pool, by server id."""
    data = tmp_path_factory.mktemp("env-servers")
    started = [
        EnvServerProcess(
            gw.settings,
            data / f"server-{i}.log",
            capacity=2,
            overrides={"TUNEGATE_ENV_POOL": POOL, "TUNEGATE_DATA_DIR": str(data / f"server-{i}")},
        )
        for i in range(2)
    ]
    try:
        yield {server.wait_registered(): server for server in started}
    finally:
        for server in started:
            server.stop(timeout_s=30)


@pytest.fixture(scope="module")
def redis_client(gw: GatewayServer) -> Iterator[redis.Redis]:
    assert gw.settings.redis_url
    client = redis.Redis.from_url(gw.settings.redis_url)
    yield client
    client.close()


@pytest.fixture
def tenant(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("org-" + secrets.token_hex(3))


def rl_job(t: Tenant, env_file: str, **config: Any) -> str:
    rows = [
        {
            "messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
            "answer": str(a + b),
        }
        for a, b in [(1, 2), (3, 4), (5, 1), (2, 2)]
    ]
    job = t.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=upload_rows(t, rows),
        method={
            "type": "reinforcement",
            "reinforcement": {
                "environment": {"file_id": env_file, "config": config},
                "hyperparameters": {
                    "batch_size": PROMPTS,
                    "num_generations": GENERATIONS,
                    "max_completion_length": 16,
                    "max_steps": STEPS,
                    "checkpoint_every": 100,
                },
            },
        },  # type: ignore[typeddict-unknown-key]
    )
    return job.id


def served(client: redis.Redis, job_id: str) -> list[dict[str, Any]]:
    """What each counted result of the job was: the server that computed it, the method, the completions."""
    return [json.loads(v) for v in client.hvals(pool_key(POOL, "served", job_id))]


def scored(records: list[dict[str, Any]]) -> int:
    return sum(r["items"] for r in records if r["method"] == "reward_batch")


def package(tmp_path: Path, t: Tenant) -> str:
    src = write_package(tmp_path / "slow", "slow_arithmetic", "slow_env:SlowArithmetic", SLOW_ARITHMETIC)
    return upload_package(t, src, tmp_path)


def no_duplicated_events(t: Tenant, job_id: str) -> None:
    events = all_events(t, job_id)
    assert len({e.id for e in events}) == len(events)
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert sorted(steps) == list(range(1, STEPS + 1))


@pytest.mark.timeout(400)
def test_rewards_are_computed_on_the_env_servers(
    worker: Any,
    servers: dict[str, EnvServerProcess],
    redis_client: redis.Redis,
    tenant: Tenant,
    tmp_path: Path,
) -> None:
    job_id = rl_job(tenant, package(tmp_path, tenant))
    done = wait_for(tenant, job_id, timeout=300)
    assert done.status == "succeeded", done.error
    records = served(redis_client, job_id)
    # every completion of every step was scored once, on the servers, and both servers took a share
    assert scored(records) == COMPLETIONS
    assert {r["server"] for r in records} == set(servers)
    steps = metrics(tenant, job_id)
    for data in steps:
        assert data["episode_failures"] == 0 and data["env_wait_s"] >= 0.0 and data["env_retries"] == 0
        assert 0.0 <= data["env_sent_early"] <= 1.0  # scored while generating: the job's trainer pipelines
    no_duplicated_events(tenant, job_id)


@pytest.mark.timeout(400)
def test_a_server_killed_mid_job_costs_the_job_nothing(
    worker: Any,
    servers: dict[str, EnvServerProcess],
    redis_client: redis.Redis,
    tenant: Tenant,
    tmp_path: Path,
) -> None:
    # each reward takes a second, so the kill lands while a server holds a request
    job_id = rl_job(tenant, package(tmp_path, tenant), sleep_s=2.0)
    deadline = time.monotonic() + 240
    victim: str | None = None
    while victim is None:  # a request stays in its server's stream until it is answered
        assert time.monotonic() < deadline, "no server ever had a request in flight"
        busy = [i for i in servers if redis_client.xlen(pool_key(POOL, "requests", i)) > 0]
        if busy and served(redis_client, job_id):  # past the job's start: kill a server serving a reward
            time.sleep(0.2)  # still holding it 0.2 s on (each reward takes 2 s): the kill lands mid-request
            if redis_client.xlen(pool_key(POOL, "requests", busy[0])) > 0:
                victim = busy[0]
        else:
            time.sleep(0.05)
    os.kill(servers[victim].pid, signal.SIGKILL)
    done = wait_for(tenant, job_id, timeout=300)
    assert done.status == "succeeded", done.error
    records = served(redis_client, job_id)
    assert scored(records) == COMPLETIONS  # no reward lost, none counted twice
    survivors = set(servers) - {victim}
    assert victim not in live_servers(redis_client, POOL)
    retries = max(step["env_retries"] for step in metrics(tenant, job_id))
    assert retries >= 1  # the request lost with the server was sent again
    assert {r["server"] for r in records if r["method"] == "reward_batch"} & survivors
    no_duplicated_events(tenant, job_id)


def test_only_an_environment_job_s_trainer_learns_where_the_pool_is() -> None:
    settings = Settings(redis_url="redis://:secret@redis:6379/0", env_pool="gpu-a")
    environment = {"type": "reinforcement", "reinforcement": {"environment": {"file_id": "file-x"}}}
    grader = {"type": "reinforcement", "reinforcement": {"grader": {"type": "string_check"}}}
    supervised = {"type": "supervised", "supervised": {}}
    venvs = builder_env(settings.venv_builder())  # and where its package's venv is cached
    assert venvs[VENV_DIR_ENV] == str(settings.data_dir / "venvs")
    assert env_pool_env(settings, environment) == {
        ENV_POOL_REDIS_ENV: "redis://:secret@redis:6379/0",
        ENV_POOL_NAME_ENV: "gpu-a",
        **venvs,
    }
    alone = Settings(redis_url=None)  # no env servers: the trainer runs the package, on the same cache
    assert env_pool_env(alone, environment) == builder_env(alone.venv_builder())
    for method in (grader, supervised):
        assert env_pool_env(settings, method) == {}

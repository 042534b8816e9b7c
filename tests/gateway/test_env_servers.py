"""Env servers (`tunegate env-server`): a worker's RL jobs score their environment on the pool's servers, a
server killed mid-job costs the job nothing, and one organisation's job never sees another's tasks nor, with
the Redis user its trainer gets, reaches another's keys.

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

from envsdk.remote_wire import grants_key, live_servers, org_key, pool_key, requests_key, served_key
from envsdk.venvs import VENV_DIR_ENV, builder_env
from gateway.settings import Settings
from gateway.worker.job.process import environment_env, uses_env_pool
from tests.gateway.test_environments import upload_package, write_package
from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.jobs import all_events, metrics, trainer_processes, upload_rows, wait_for
from tests.support.stack import Admin, GatewayServer, Tenant
from trainer.contract import ENV_POOL_NAME_ENV, ENV_POOL_ORG_ENV, ENV_POOL_REDIS_ENV
from tunegate.role_processes import EnvServerProcess

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


def rl_job(t: Tenant, env_file: str, *, secret: str | None = None, **config: Any) -> str:
    """A few GRPO steps of the tiny model on `env_file`; `secret`: a field of every task."""
    rows = [
        {
            "messages": [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
            "answer": str(a + b),
            **({"secret": secret} if secret else {}),
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


def served(client: redis.Redis, t: Tenant, job_id: str) -> list[dict[str, Any]]:
    """What each counted result of the job was: the server that computed it, the method, the completions."""
    return [json.loads(v) for v in client.hvals(served_key(POOL, t.org_id, job_id))]


def scored(records: list[dict[str, Any]]) -> int:
    return sum(r["items"] for r in records if r["method"] == "reward_batch")


@pytest.fixture
def slow_package(worker: Any, tenant: Tenant, tmp_path: Path) -> str:
    """`SLOW_ARITHMETIC` uploaded by `tenant`, for a job of the module's worker: the file id."""
    src = write_package(tmp_path / "slow", "slow_arithmetic", "slow_env:SlowArithmetic", SLOW_ARITHMETIC)
    return upload_package(tenant, src, tmp_path)


def no_duplicated_events(t: Tenant, job_id: str) -> None:
    events = all_events(t, job_id)
    assert len({e.id for e in events}) == len(events)
    steps = [e.data["step"] for e in events if e.type == "metrics"]
    assert sorted(steps) == list(range(1, STEPS + 1))


@pytest.mark.timeout(400)
def test_rewards_are_computed_on_the_env_servers(
    servers: dict[str, EnvServerProcess], redis_client: redis.Redis, tenant: Tenant, slow_package: str
) -> None:
    job_id = rl_job(tenant, slow_package)
    done = wait_for(tenant, job_id, timeout=300)
    assert done.status == "succeeded", done.error
    records = served(redis_client, tenant, job_id)
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
    servers: dict[str, EnvServerProcess], redis_client: redis.Redis, tenant: Tenant, slow_package: str
) -> None:
    # each reward takes a second, so the kill lands while a server holds a request
    job_id = rl_job(tenant, slow_package, sleep_s=2.0)
    deadline = time.monotonic() + 240
    victim: str | None = None
    while victim is None:  # a request stays in its server's stream until it is answered
        assert time.monotonic() < deadline, "no server ever had a request in flight"
        busy = [i for i in servers if redis_client.xlen(requests_key(POOL, tenant.org_id, i)) > 0]
        if busy and served(
            redis_client, tenant, job_id
        ):  # past the job's start: kill a server serving a reward
            time.sleep(0.2)  # still holding it 0.2 s on (each reward takes 2 s): the kill lands mid-request
            if redis_client.xlen(requests_key(POOL, tenant.org_id, busy[0])) > 0:
                victim = busy[0]
        else:
            time.sleep(0.05)
    os.kill(servers[victim].pid, signal.SIGKILL)
    done = wait_for(tenant, job_id, timeout=300)
    assert done.status == "succeeded", done.error
    records = served(redis_client, tenant, job_id)
    assert scored(records) == COMPLETIONS  # no reward lost, none counted twice
    survivors = set(servers) - {victim}
    assert victim not in live_servers(redis_client, POOL)
    retries = max(step["env_retries"] for step in metrics(tenant, job_id))
    assert retries >= 1  # the request lost with the server was sent again
    assert {r["server"] for r in records if r["method"] == "reward_batch"} & survivors
    no_duplicated_events(tenant, job_id)


def test_only_an_environment_job_s_trainer_uses_the_pool() -> None:
    settings = Settings(redis_url="redis://:secret@redis:6379/0", env_pool="gpu-a")
    environment = {"type": "reinforcement", "reinforcement": {"environment": {"file_id": "file-x"}}}
    grader = {"type": "reinforcement", "reinforcement": {"grader": {"type": "string_check"}}}
    supervised = {"type": "supervised", "supervised": {}}
    venvs = builder_env(settings.venv_builder())  # where its package's venv is cached
    assert venvs[VENV_DIR_ENV] == str(settings.data_dir / "venvs")
    assert environment_env(settings, environment) == venvs and uses_env_pool(settings, environment)
    alone = Settings(redis_url=None)  # no env servers: the trainer runs the package, on the same cache
    assert environment_env(alone, environment) == builder_env(alone.venv_builder())
    assert not uses_env_pool(alone, environment)
    for method in (grader, supervised):
        assert environment_env(settings, method) == {} and not uses_env_pool(settings, method)


REMEMBERS = """import time

from envsdk import SingleTurnEnv, completion_text

SEEN = set()  # module state: it lives as long as the sandbox's process


class Remembers(SingleTurnEnv):
    def reward(self, task, completion):
        time.sleep(float(self.config.get("sleep_s", 0)))
        SEEN.add(task["secret"])
        if len(SEEN) > 1:  # another job's tasks were here before: say what they held
            raise ValueError("this sandbox saw " + ", ".join(sorted(SEEN)))
        return 1.0 if completion_text(completion).strip() == task["answer"] else 0.0
"""


def trainer_environment(t: Tenant, job_id: str) -> dict[str, str]:
    """The environment of the job's trainer, read from /proc while it runs."""
    deadline = time.monotonic() + 240
    while True:
        for pid in trainer_processes(job_id):
            try:
                raw = Path(f"/proc/{pid}/environ").read_bytes().decode()
            except OSError:  # gone meanwhile
                continue
            env = dict(item.split("=", 1) for item in raw.split("\0") if "=" in item)
            if ENV_POOL_REDIS_ENV in env:
                return env
        assert time.monotonic() < deadline, "the job's trainer never started"
        assert t.client.fine_tuning.jobs.retrieve(job_id).status in ("validating_files", "queued", "running")
        time.sleep(0.05)


def outputs(t: Tenant, job_id: str) -> str:
    """Everything the organisation can read of the job: the job (its error) and every event, as text."""
    job = t.client.fine_tuning.jobs.retrieve(job_id)
    return json.dumps([job.model_dump(), *(e.model_dump() for e in all_events(t, job_id))])


@pytest.mark.timeout(600)
def test_a_package_that_remembers_never_shows_one_organisation_s_tasks_to_another(
    gw: GatewayServer,
    worker: Any,
    servers: dict[str, EnvServerProcess],
    redis_client: redis.Redis,
    gw_admin: Admin,
    tmp_path: Path,
) -> None:
    a, b = (gw_admin.tenant("org-" + secrets.token_hex(3)) for _ in range(2))
    secret = {t.org_id: f"secret-of-{t.org_id}-{secrets.token_hex(4)}" for t in (a, b)}
    files = {}
    for t in (a, b):  # the same package, byte for byte, uploaded by each organisation
        src = write_package(
            tmp_path / t.org_id / "remembers", "remembers", "remembers_env:Remembers", REMEMBERS
        )
        files[t.org_id] = upload_package(t, src, tmp_path / t.org_id)

    job_a = rl_job(a, files[a.org_id], secret=secret[a.org_id], sleep_s=0.5)
    # the trainer's Redis user, as the worker gave it: A's namespace of the pool and nothing else
    env = trainer_environment(a, job_a)
    assert (env[ENV_POOL_NAME_ENV], env[ENV_POOL_ORG_ENV]) == (POOL, a.org_id)
    url = env[ENV_POOL_REDIS_ENV]
    assert url != gw.settings.redis_url
    trainer = redis.Redis.from_url(url)
    try:
        assert set(live_servers(trainer, POOL, a.org_id)) == set(live_servers(redis_client, POOL))
        assert trainer.set(org_key(POOL, a.org_id, "probe"), b"1") is True
        server = next(iter(live_servers(redis_client, POOL)))
        for call in (
            lambda: trainer.xadd(requests_key(POOL, b.org_id, server), {"data": "{}"}),  # B's requests
            lambda: trainer.get(org_key(POOL, b.org_id, "probe")),  # B's namespace
            lambda: trainer.get(grants_key(POOL)),  # the pool's own keys
            lambda: trainer.smembers(pool_key(POOL, "servers")),
            lambda: trainer.get(pool_key(POOL, "server", server)),
            lambda: trainer.zcard(gw.settings.queue_name),  # the gateway's job queue
            lambda: trainer.keys("*"),
            lambda: trainer.flushall(),
        ):
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
    finally:
        trainer.close()
    done_a = wait_for(a, job_a, timeout=300)
    # the trainer ended: its user with it
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(url).ping()
    assert url.split("//", 1)[1].split(":", 1)[0] not in redis_client.acl_users()

    job_b = rl_job(b, files[b.org_id], secret=secret[b.org_id], sleep_s=0.5)
    done_b = wait_for(b, job_b, timeout=300)
    for t, job_id, done in ((a, job_a, done_a), (b, job_b, done_b)):
        assert done.status == "succeeded", done.error
        # no reward of either job ran in a sandbox that had seen the other's tasks
        assert [m["episode_failures"] for m in metrics(t, job_id)] == [0.0] * STEPS
        assert {r["server"] for r in served(redis_client, t, job_id)} <= set(servers)
    # and nothing either organisation can read of its job holds the other's task data
    assert secret[b.org_id] not in outputs(a, job_a) and secret[a.org_id] not in outputs(b, job_b)

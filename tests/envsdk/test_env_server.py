"""Env servers without a training stack: real `tunegate env-server` processes on the tests' Redis, driven by
the trainer's client (`envsdk.remote.RemoteSandbox`) and by `trainer.environment.EnvironmentSession`, with the
Redis user and grant a worker makes for a job's trainer (`gateway.worker.redis_acl`).

Each test names a pool of its own, so no other test's servers or trainers see its servers.
"""

from __future__ import annotations

import asyncio
import json
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, cast

import pytest
import redis
import redis.asyncio

from envsdk.errors import SandboxError
from envsdk.remote import RemoteSandbox
from envsdk.remote_wire import (
    crash_count,
    episode_key,
    episode_state,
    live_servers,
    requests_key,
    result_key,
    served_key,
)
from envsdk.sandbox import Sandbox
from gateway.settings import Settings
from gateway.worker import redis_acl
from gateway.worker.redis_acl import PoolGrant
from tests.support.stack import Services
from tests.trainer.conftest import make_spec
from trainer.contract import TrainerSpec
from trainer.data import ITEM_COLUMN
from trainer.errors import TrainerError
from trainer.run import read_spec
from tunegate.role_processes import EnvServerProcess

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "envs"
SLOW = """
import time

from envsdk import SingleTurnEnv


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        time.sleep(30)
        return 1.0

    def group_reward(self, task, completions):
        return [float(len(c)) for c in completions]
"""

Start = Callable[..., dict[str, EnvServerProcess]]
Grant = Callable[[str, str], PoolGrant]
ORG = "org-envsrv"


@pytest.fixture
def pool() -> str:
    return "t-" + secrets.token_hex(3)


@pytest.fixture
def redis_client(services: Services) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(services.redis_url)
    yield client
    client.close()


def on_redis(services: Services, call: Callable[[redis.asyncio.Redis], Any]) -> Any:
    """``call`` with the worker's own (asyncio) client of the tests' Redis."""

    async def run() -> Any:
        client = redis.asyncio.Redis.from_url(services.redis_url)
        try:
            return await call(client)
        finally:
            await client.aclose()

    return asyncio.run(run())


@pytest.fixture
def grant(services: Services, pool: str) -> Iterator[Grant]:
    """What a worker does as a job's trainer starts: a Redis user and a grant for (organisation, job) in the
    test's pool; revoked after the test."""
    made: list[PoolGrant] = []

    def make(org: str, job: str) -> PoolGrant:
        granted = on_redis(
            services,
            lambda c: redis_acl.grant(c, redis_url=services.redis_url, pool=pool, org_id=org, job_id=job),
        )
        made.append(granted)
        return cast(PoolGrant, granted)

    yield make
    for granted in made:
        on_redis(services, lambda c, g=granted: redis_acl.revoke(c, g))


@pytest.fixture
def start_servers(services: Services, tmp_path: Path, pool: str, sandbox_backend: str) -> Iterator[Start]:
    """Start env servers of the test's pool; by server id. All are stopped after the test."""
    started: list[EnvServerProcess] = []
    settings = Settings(redis_url=services.redis_url, data_dir=tmp_path / "servers")

    def start(count: int, capacity: int = 2) -> dict[str, EnvServerProcess]:
        new = [
            EnvServerProcess(
                settings,
                tmp_path / f"server-{len(started) + i}.log",
                capacity=capacity,
                overrides={"TUNEGATE_ENV_POOL": pool},
            )
            for i in range(count)
        ]
        started.extend(new)
        return {server.wait_registered(): server for server in new}

    yield start
    for server in started:
        if server.poll() is None:
            server.kill()


Remote = Callable[..., RemoteSandbox]


@pytest.fixture
def remote() -> Iterator[Remote]:
    """`RemoteSandbox`es, as a trainer with grant `granted` makes them (`job_id`: the job it names, else the
    grant's); closed after the test."""
    made: list[RemoteSandbox] = []

    def make(granted: PoolGrant, package: Path, job_id: str | None = None) -> RemoteSandbox:
        box = RemoteSandbox(
            granted.url, package, org=granted.org_id, pool=granted.pool, job_id=job_id or granted.job_id
        )
        made.append(box)
        return box

    yield make
    for box in made:
        box.close()


def write_package(root: Path, name: str, code: str) -> Path:
    """A package `name` under `root` whose `env.py` is `code` (entrypoint `env:Env`)."""
    package = root / name
    package.mkdir()
    (package / "environment.toml").write_text(f'name = "{name}"\nversion = "0.1.0"\nentrypoint = "env:Env"\n')
    (package / "env.py").write_text(code)
    return package


def trainer_uses_pool(monkeypatch: pytest.MonkeyPatch, granted: PoolGrant) -> None:
    """What a worker tells an environment job's trainer: its Redis user, the pool and its organisation."""
    for name, value in granted.env.items():
        monkeypatch.setenv(name, value)


PooledSpec = Callable[..., TrainerSpec]


@pytest.fixture
def pooled_spec(
    grant: Grant, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_model_dir: Path
) -> PooledSpec:
    """The spec of `ORG`'s environment job `job_id` on `package` over `rows` (with `hyperparameters`), its
    grant of the test's pool given to the trainer as a worker gives it (`trainer_uses_pool`)."""

    def make(job_id: str, package: Path, rows: list[dict[str, Any]], **hyperparameters: Any) -> TrainerSpec:
        trainer_uses_pool(monkeypatch, grant(ORG, job_id))
        environment = {"package_dir": str(package), "config": {}}
        return read_spec(
            make_spec(
                tmp_path,
                tiny_model_dir,
                "reinforcement",
                rows,
                environment=environment,
                hyperparameters=hyperparameters,
                job_id=job_id,
            )
        )

    return make


def guess_task() -> dict[str, Any]:
    return json.loads((EXAMPLES / "guess_number" / "tasks.jsonl").read_text().splitlines()[0])


def play(box: Any, guesses: list[str]) -> list[Any]:
    """Reset an episode of guess_number and step it with each guess; the step results."""
    opened = box.call("reset", {"task": guess_task()})
    steps = []
    for guess in guesses:
        message = {"role": "assistant", "content": guess}
        steps.append(box.call("step", {"episode_id": opened["episode_id"], "assistant_message": message}))
    return steps


def test_an_episode_whose_server_dies_goes_on_from_its_last_turn_elsewhere(
    start_servers: Start, grant: Grant, remote: Remote, pool: str, redis_client: redis.Redis
) -> None:
    servers = start_servers(2)
    box = remote(grant(ORG, "ftjob-resume"), EXAMPLES / "guess_number")
    guesses = ["10", "5", "1", "3"]  # the target is 3: the fourth turn ends the episode
    box.start()
    with Sandbox(EXAMPLES / "guess_number") as local:
        episode = box.call("reset", {"task": guess_task()})["episode_id"]
        steps = []
        for i, guess in enumerate(guesses):
            if i == 2:  # two turns done: the server holding the episode dies
                holder = box._episodes[episode].server
                servers[holder].kill()
            message = {"role": "assistant", "content": guess}
            steps.append(box.call("step", {"episode_id": episode, "assistant_message": message}))
        # the same turns in a sandbox of our own: the episode went on from its second turn, none played twice
        # (the reward counts the turns)
        assert steps == play(local, guesses) and steps[-1]["done"] and steps[-1]["reward"] > 0
        assert box.retries == 1 and holder not in live_servers(redis_client, pool)
        # the episode's state in Redis: its task and each completed turn once, in order
        task, turns = episode_state(redis_client, pool, ORG, "ftjob-resume", episode)
        assert task == guess_task()
        assert turns == [{"role": "assistant", "content": g} for g in guesses]
        recorded = redis_client.hkeys(episode_key(pool, ORG, "ftjob-resume", episode))
        assert sorted(k.decode() for k in recorded) == ["0", "1", "2", "3", "task"]
        served = [json.loads(v) for v in redis_client.hvals(served_key(pool, ORG, "ftjob-resume"))]
        assert [r["method"] for r in served].count("resume") == 1
        assert {r["server"] for r in served if r["method"] == "resume"} == set(servers) - {holder}


def test_sigterm_drains_a_server_after_its_episodes(
    start_servers: Start, grant: Grant, remote: Remote, pool: str, redis_client: redis.Redis
) -> None:
    ((server_id, server),) = start_servers(1).items()
    box = remote(grant(ORG, "ftjob-drain"), EXAMPLES / "guess_number")
    box.start()
    opened = box.call("reset", {"task": guess_task()})
    server.terminate()
    deadline = time.monotonic() + 10
    while not live_servers(redis_client, pool, ORG)[server_id].draining:  # as the trainer sees it
        assert time.monotonic() < deadline
        time.sleep(0.1)
    # draining: it takes no new work, but the episode it holds goes on there
    message = {"role": "assistant", "content": "3"}
    step = box.call("step", {"episode_id": opened["episode_id"], "assistant_message": message})
    assert step["error"] is None and server.poll() is None
    box.call("close_episode", {"episode_id": opened["episode_id"]})
    assert server.proc.wait(timeout=30) == 0  # then it stops by itself, deregistered
    assert live_servers(redis_client, pool) == {} and live_servers(redis_client, pool, ORG) == {}
    assert not redis_client.exists(requests_key(pool, ORG, server_id))


def test_a_package_that_keeps_crashing_servers_is_refused_across_jobs(
    start_servers: Start,
    services: Services,
    grant: Grant,
    pooled_spec: PooledSpec,
    pool: str,
    redis_client: redis.Redis,
    tmp_path: Path,
) -> None:
    from trainer.environment import EnvironmentSession

    package = write_package(tmp_path, "slow", SLOW)
    servers = start_servers(3, capacity=1)
    spec = pooled_spec("ftjob-crashes", package, [{"messages": [{"role": "user", "content": "q"}]}])
    session = EnvironmentSession(spec)  # servers are registered: the one place chose them
    try:
        assert session.sandbox.backend == f"env servers of pool {pool!r}"
        reward = session.reward_func()
        task = json.dumps({"messages": [{"role": "user", "content": "q"}]})
        # group rewards are served by the pool, each group at once
        assert session.uses_group_reward
        assert reward([None] * 3, ["a", "bb", "ccc"], **{ITEM_COLUMN: [task] * 3}) == [1.0, 2.0, 3.0]
        session.uses_group_reward = False
        failed: list[BaseException] = []

        def score() -> None:
            try:
                reward([None], ["x"], **{ITEM_COLUMN: [task]})
            except BaseException as exc:  # noqa: BLE001 - handed to the test's thread
                failed.append(exc)

        scoring = threading.Thread(target=score)
        scoring.start()
        killed = 0
        deadline = time.monotonic() + 60
        while killed < 3:  # each server that takes the request dies with it
            assert time.monotonic() < deadline and not failed, failed
            for server_id, server in servers.items():
                if server.poll() is None and services_stream_len(services, pool, server_id):
                    server.proc.send_signal(signal.SIGKILL)
                    server.proc.wait()
                    killed += 1
            time.sleep(0.05)
        scoring.join(timeout=30)
        assert len(failed) == 1 and isinstance(failed[0], TrainerError), failed
        assert failed[0].code == "environment_error"
        assert "package slow" in failed[0].message and "took down 3 env servers" in failed[0].message
    finally:
        session.close()
    # the count is the package's, in Redis: with a server up again, another job on it fails at once, naming it
    package_sha = session.sandbox.package
    assert crash_count(redis_client, pool, ORG, package_sha) == 3
    ((server_id, _),) = start_servers(1).items()
    with pytest.raises(TrainerError) as refused:
        EnvironmentSession(spec)
    assert refused.value.code == "environment_error" and "package slow" in refused.value.message
    # ... and the server refuses it
    assert probe(redis_client, pool, ORG, server_id, package_sha)["error"]["code"] == "package_refused"
    # ... to that organisation: the count is its own trainers', so another's same package starts there
    other = "org-other"
    grant(other, "ftjob-other")
    started = probe(redis_client, pool, other, server_id, package_sha, stored=package)
    assert "error" not in started and started["result"]["kind"] == "single_turn"


def probe(
    client: redis.Redis, pool: str, org: str, server_id: str, sha256: str, *, stored: Path | None = None
) -> dict[str, Any]:
    """A `start` request of `org`'s for package `sha256`, sent straight to a server's stream; its answer.
    `stored`: store that package's archive in the organisation's namespace first, as its trainer would."""
    from envsdk.archive import pack
    from envsdk.remote_wire import package_key

    if stored is not None:
        archive, _ = pack(stored, stored.parent / f"{stored.name}.tar.gz")
        client.set(package_key(pool, org, sha256), archive.read_bytes())
    key = f"probe-{secrets.token_hex(3)}"
    request = {
        "key": key,
        "method": "start",
        "params": {},
        "package": sha256,
        "name": "slow",
        "client": "probe",
        "deadline": time.time() + 30,
    }
    client.xadd(requests_key(pool, org, server_id), {"data": json.dumps(request)})
    deadline = time.monotonic() + 60
    while (answer := client.get(result_key(pool, org, key))) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return cast(dict[str, Any], json.loads(answer))


def services_stream_len(services: Services, pool: str, server_id: str) -> int:
    client = redis.Redis.from_url(services.redis_url)
    try:
        return int(client.xlen(requests_key(pool, ORG, server_id)))
    finally:
        client.close()


def test_rewards_are_scored_while_the_batch_generates_each_once(
    start_servers: Start, pooled_spec: PooledSpec, pool: str, redis_client: redis.Redis
) -> None:
    from trainer.environment import EnvironmentSession
    from trainer.pipeline import RewardPipeline

    start_servers(2)
    rows = [
        json.loads(line) for line in (EXAMPLES / "arithmetic" / "tasks.jsonl").read_text().splitlines()[:4]
    ]
    spec = pooled_spec(
        "ftjob-pipelined",
        EXAMPLES / "arithmetic",
        rows,
        batch_size=4,
        num_generations=4,
        max_completion_length=8,
    )
    session = EnvironmentSession(spec)
    session.pipeline = RewardPipeline(session)
    try:
        trainer, dataset = grpo_trainer(spec, session)
        # the pipelined trainer (under the class that measures the sampler/trainer mismatch)
        assert "PipelinedGRPOTrainer" in [c.__name__ for c in type(trainer).__mro__]
        trainer.model.train()
        batch = [dict(dataset[i]) for i in range(4) for _ in range(4)]  # GRPO's layout: each prompt 4 times
        trainer._generate_and_score_completions(batch)
        # groups whose completions all ended went to the servers during generation (those cut at the length
        # limit when it returned); each completion was scored exactly once there
        (early,) = trainer._metrics["train"]["env_sent_early"]
        assert 0 < early <= 1
        records = [json.loads(v) for v in redis_client.hvals(served_key(pool, ORG, "ftjob-pipelined"))]
        assert sum(r["items"] for r in records if r["method"] == "reward_batch") == 16
        # the rewards TRL got are the package's own for exactly the completions TRL made
        completions = trainer._logs["completion"]
        local = Sandbox(EXAMPLES / "arithmetic")
        local.start()
        try:
            tasks = [rows[i] for i in range(4) for _ in range(4)]
            items = [{"task": t, "completion": c} for t, c in zip(tasks, completions, strict=True)]
            expected = [r["reward"] for r in local.reward_batch(items)]
        finally:
            local.close()
        assert list(trainer._logs["rewards"]["environment"]) == pytest.approx(expected)  # float32 in TRL
    finally:
        session.close()


def grpo_trainer(spec: Any, session: Any) -> tuple[Any, Any]:
    """The job's GRPO trainer on the tiny model, as the trainer builds it, and its dataset."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.data import load_dataset
    from trainer.rewards import build_reward_funcs
    from trainer.run import _build_trainer

    tokenizer = AutoTokenizer.from_pretrained(spec.base_model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec.base_model)
    dataset = load_dataset("reinforcement", spec.training_file)
    funcs = build_reward_funcs(spec, session)
    return _build_trainer(spec, model, tokenizer, dataset, False, funcs, session), dataset


TURNS = """
import time

from envsdk import MultiTurnEnv, StepResult, task_messages


class Env(MultiTurnEnv):
    max_turns = 2

    def reset(self, task):
        self.spans = []
        return task_messages(task)

    def step(self, assistant_message):
        started = time.time()
        time.sleep(0.5)
        self.spans.append([started, time.time()])
        done = len(self.spans) == 2
        observation = [] if done else [{"role": "user", "content": "Once more."}]
        return StepResult(observation=observation, reward=float(done), done=done, info={"spans": self.spans})
"""


def test_a_batch_s_multi_turn_episodes_step_at_once_across_servers(
    start_servers: Start, pooled_spec: PooledSpec, pool: str, redis_client: redis.Redis, tmp_path: Path
) -> None:
    from trainer.environment import EnvironmentSession

    package = write_package(tmp_path, "turns", TURNS)
    servers = start_servers(2)
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(4)]
    spec = pooled_spec("ftjob-turns", package, rows)
    session = EnvironmentSession(spec)
    try:
        trainer, _ = grpo_trainer(spec, session)
        episodes = session.play(trainer, [dict(r) for r in rows], budget=96, temperature=0.0)
    finally:
        session.close()
    assert [(e.error, e.turns, e.reward) for e in episodes] == [(None, 2, 1.0)] * 4
    # each turn of the batch: the episodes' steps ran at the same time, as the servers recorded them
    for turn in (0, 1):
        spans = sorted(e.info["spans"][turn] for e in episodes)
        overlapping = [a for a, b in zip(spans, spans[1:], strict=False) if b[0] < a[1]]
        assert overlapping, spans
    served = [json.loads(v) for v in redis_client.hvals(served_key(pool, ORG, "ftjob-turns"))]
    assert {r["server"] for r in served if r["method"] == "step"} == set(servers)


REMEMBERS = """
from envsdk import SingleTurnEnv

SEEN = []  # module state: it lives as long as the sandbox's process


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        SEEN.append(task["secret"])
        raise ValueError("seen " + ",".join(sorted(set(SEEN))))
"""


def seen(remote: RemoteSandbox, secret: str) -> str:
    """The error the package answers a reward of a task carrying `secret` with: what its process has seen."""
    [result] = remote.reward_batch([{"task": {"secret": secret}, "completion": "x"}])
    assert result["reward"] is None
    return str(result["error"])


def test_an_organisation_s_calls_never_run_in_a_sandbox_that_served_another_s(
    start_servers: Start, grant: Grant, remote: Remote, tmp_path: Path
) -> None:
    package = write_package(tmp_path, "remembers", REMEMBERS)
    start_servers(1, capacity=1)  # one sandbox per package: the same one for every call, were they shared
    a, b = grant("org-aaa", "ftjob-a"), grant("org-bbb", "ftjob-b")
    remote_a, remote_b = remote(a, package), remote(b, package)
    remote_a.start()
    remote_b.start()
    assert remote_a.package == remote_b.package  # the same package, byte for byte
    assert seen(remote_a, "secret-of-a") == "ValueError: seen secret-of-a"
    assert seen(remote_b, "secret-of-b") == "ValueError: seen secret-of-b"
    # each organisation's sandbox goes on remembering its own organisation's tasks only
    assert seen(remote_a, "more-of-a") == "ValueError: seen more-of-a,secret-of-a"


def test_a_request_reaches_only_its_own_organisation_s_state(
    start_servers: Start, grant: Grant, remote: Remote, pool: str, redis_client: redis.Redis
) -> None:
    ((server_id, _),) = start_servers(1).items()
    a, b = grant("org-aaa", "ftjob-a"), grant("org-bbb", "ftjob-b")
    remote_a = remote(a, EXAMPLES / "guess_number")
    # B's trainer names A's job, to find A's episodes
    remote_b = remote(b, EXAMPLES / "arithmetic", job_id="ftjob-a")
    remote_a.start()
    remote_b.start()
    episode = remote_a.call("reset", {"task": guess_task()})["episode_id"]
    # resuming A's open episode from B's namespace finds no state there: B never sees A's task
    with pytest.raises(SandboxError) as lost:
        remote_b.gather([remote_b.submit("resume", {"episode_id": episode})])
    assert lost.value.code == "episode_lost"

    # the registrations B's trainer reads list none of A's packages (each heartbeat writes them)
    def listed() -> list[list[list[str]]]:
        return [
            [r.packages for r in live_servers(redis_client, pool, o).values()] for o in ("org-aaa", "org-bbb")
        ]

    deadline = time.monotonic() + 10
    while (seen := listed()) != [[[remote_a.package]], [[remote_b.package]]]:  # both heartbeats written
        assert time.monotonic() < deadline, seen
        time.sleep(0.1)
    # a package named by a path, to reach A's unpacked copy on the server (A's sandbox is open), is refused
    answer = probe(redis_client, pool, "org-bbb", server_id, f"../org-aaa/{remote_a.package}")
    assert answer["error"] == {
        "code": "package_invalid",
        "message": "a request named a package by something not a sha256",
    }


def test_a_trainer_s_redis_user_reaches_its_organisation_s_namespace_only(
    start_servers: Start, grant: Grant, services: Services, pool: str, redis_client: redis.Redis
) -> None:
    ((server_id, _),) = start_servers(1).items()
    granted = grant("org-aaa", "ftjob-a")
    assert granted.scoped and granted.user in set(redis_client.acl_users())
    trainer = redis.Redis.from_url(granted.url)
    try:
        # its own namespace: the registrations, its requests, its package
        assert set(live_servers(trainer, pool, "org-aaa")) == {server_id}
        assert trainer.set(f"tunegate:envpool:{pool}:org:org-aaa:package:x", b"1") is True
        # another organisation's namespace, the pool's own keys, the gateway's: NOPERM, for every command
        outside = [
            lambda: trainer.xadd(requests_key(pool, "org-bbb", server_id), {"data": "{}"}),
            lambda: trainer.get(f"tunegate:envpool:{pool}:org:org-bbb:result:k"),
            lambda: trainer.set(f"tunegate:envpool:{pool}:org:org-aaaa:x", b"1"),  # a longer id's prefix
            lambda: trainer.smembers(f"tunegate:envpool:{pool}:servers"),
            lambda: trainer.get(f"tunegate:envpool:{pool}:grants"),
            lambda: trainer.zcard("tunegate:jobs"),  # the job queue
            lambda: trainer.keys("*"),
            lambda: trainer.scan(),
            lambda: trainer.hgetall(
                f"tunegate:envpool:{pool}:org:org-aaa:served:ftjob-a"
            ),  # not a command of its
            lambda: trainer.execute_command("ACL", "LIST"),
            lambda: trainer.config_get("*"),
            lambda: trainer.publish("tunegate", "x"),
            lambda: trainer.flushall(),
            lambda: trainer.eval("return 1", 0),
        ]
        for call in outside:
            with pytest.raises(redis.exceptions.NoPermissionError):
                call()
        assert redis_client.exists(f"tunegate:envpool:{pool}:servers")  # nothing of the pool was touched
    finally:
        trainer.close()
    # revoked (the trainer ended): the user is gone, and so is the grant its servers served
    on_redis(services, lambda c: redis_acl.revoke(c, granted))
    assert granted.user not in set(redis_client.acl_users())
    assert not redis_client.hexists(f"tunegate:envpool:{pool}:grants", granted.user)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis.from_url(granted.url).ping()


def test_the_grant_of_a_trainer_whose_worker_died_is_swept(
    grant: Grant, services: Services, pool: str, redis_client: redis.Redis
) -> None:
    dead = grant("org-aaa", "ftjob-dead")
    # its worker died: nobody renews the lease, which runs out
    lease = json.loads(redis_client.hget(f"tunegate:envpool:{pool}:grants", dead.user) or b"{}")
    lease["expires_at"] = time.time() - 1
    redis_client.hset(f"tunegate:envpool:{pool}:grants", dead.user, json.dumps(lease))
    live = grant("org-bbb", "ftjob-live")  # the next grant on any worker sweeps it
    users = set(redis_client.acl_users())
    assert dead.user not in users and live.user in users
    grants = {k.decode() for k in redis_client.hkeys(f"tunegate:envpool:{pool}:grants")}
    assert grants == {live.user}


def test_the_trainer_s_url_names_its_own_user() -> None:
    url = redis_acl.scoped_url("redis://:deployment@redis:6379/2?socket_timeout=5", "tunegate-job-x", "p/w")
    assert url == "redis://tunegate-job-x:p%2Fw@redis:6379/2?socket_timeout=5"
    unix = redis_acl.scoped_url("unix:///run/redis.sock?db=0&password=deployment", "u", "p")
    assert unix == "unix://u:p@/run/redis.sock?db=0"
    kwargs = redis.connection.parse_url(unix)
    assert (kwargs["username"], kwargs["password"], kwargs["path"]) == ("u", "p", "/run/redis.sock")

"""Env servers without a training stack: real `tunegate env-server` processes on the tests' Redis, driven by
the trainer's client (`envsdk.remote.RemoteSandbox`) and by `trainer.environment.EnvironmentSession`.

Each test names a pool of its own, so no other test's servers or trainers see its servers.
"""

from __future__ import annotations

import json
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis

from envsdk.remote import RemoteSandbox
from envsdk.remote_wire import crash_count, episode_key, episode_state, live_servers, pool_key
from envsdk.sandbox import Sandbox
from gateway.settings import Settings
from tests.support.stack import Services
from tests.trainer.conftest import make_spec
from trainer.data import ITEM_COLUMN
from trainer.errors import TrainerError
from trainer.run import read_spec
from trainer.spec import ENV_POOL_NAME_ENV, ENV_POOL_REDIS_ENV
from tunegate.processes import EnvServerProcess

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


@pytest.fixture
def pool() -> str:
    return "t-" + secrets.token_hex(3)


@pytest.fixture
def redis_client(services: Services) -> Iterator[redis.Redis]:
    client = redis.Redis.from_url(services.redis_url)
    yield client
    client.close()


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


def write_package(root: Path, name: str, code: str) -> Path:
    """A package `name` under `root` whose `env.py` is `code` (entrypoint `env:Env`)."""
    package = root / name
    package.mkdir()
    (package / "environment.toml").write_text(f'name = "{name}"\nversion = "0.1.0"\nentrypoint = "env:Env"\n')
    (package / "env.py").write_text(code)
    return package


def trainer_uses_pool(monkeypatch: pytest.MonkeyPatch, services: Services, pool: str) -> None:
    """What a worker tells an environment job's trainer: the env servers' Redis and pool name."""
    monkeypatch.setenv(ENV_POOL_REDIS_ENV, services.redis_url)
    monkeypatch.setenv(ENV_POOL_NAME_ENV, pool)


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
    start_servers: Start, services: Services, pool: str, redis_client: redis.Redis
) -> None:
    servers = start_servers(2)
    remote = RemoteSandbox(services.redis_url, EXAMPLES / "guess_number", pool=pool, job_id="ftjob-resume")
    local = Sandbox(EXAMPLES / "guess_number")
    guesses = ["10", "5", "1", "3"]  # the target is 3: the fourth turn ends the episode
    try:
        remote.start()
        local.start()
        episode = remote.call("reset", {"task": guess_task()})["episode_id"]
        steps = []
        for i, guess in enumerate(guesses):
            if i == 2:  # two turns done: the server holding the episode dies
                holder = remote._episodes[episode].server
                servers[holder].kill()
            message = {"role": "assistant", "content": guess}
            steps.append(remote.call("step", {"episode_id": episode, "assistant_message": message}))
        # the same turns in a sandbox of our own: the episode went on from its second turn, none played twice
        # (the reward counts the turns)
        assert steps == play(local, guesses) and steps[-1]["done"] and steps[-1]["reward"] > 0
        assert remote.retries == 1 and holder not in live_servers(redis_client, pool)
        # the episode's state in Redis: its task and each completed turn once, in order
        task, turns = episode_state(redis_client, pool, "ftjob-resume", episode)
        assert task == guess_task()
        assert turns == [{"role": "assistant", "content": g} for g in guesses]
        recorded = redis_client.hkeys(episode_key(pool, "ftjob-resume", episode))
        assert sorted(k.decode() for k in recorded) == ["0", "1", "2", "3", "task"]
        served = [json.loads(v) for v in redis_client.hvals(pool_key(pool, "served", "ftjob-resume"))]
        assert [r["method"] for r in served].count("resume") == 1
        assert {r["server"] for r in served if r["method"] == "resume"} == set(servers) - {holder}
    finally:
        remote.close()
        local.close()


def test_sigterm_drains_a_server_after_its_episodes(
    start_servers: Start, services: Services, pool: str, redis_client: redis.Redis
) -> None:
    ((server_id, server),) = start_servers(1).items()
    remote = RemoteSandbox(services.redis_url, EXAMPLES / "guess_number", pool=pool, job_id="ftjob-drain")
    try:
        remote.start()
        opened = remote.call("reset", {"task": guess_task()})
        server.terminate()
        deadline = time.monotonic() + 10
        while not live_servers(redis_client, pool)[server_id].draining:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        # draining: it takes no new work, but the episode it holds goes on there
        message = {"role": "assistant", "content": "3"}
        step = remote.call("step", {"episode_id": opened["episode_id"], "assistant_message": message})
        assert step["error"] is None and server.poll() is None
        remote.call("close_episode", {"episode_id": opened["episode_id"]})
        assert server.proc.wait(timeout=30) == 0  # then it stops by itself, deregistered
        assert live_servers(redis_client, pool) == {}
        assert not redis_client.exists(pool_key(pool, "requests", server_id))
    finally:
        remote.close()


def test_a_package_that_keeps_crashing_servers_is_refused_across_jobs(
    start_servers: Start,
    services: Services,
    pool: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    package = write_package(tmp_path, "slow", SLOW)
    servers = start_servers(3, capacity=1)
    trainer_uses_pool(monkeypatch, services, pool)
    from trainer.environment import EnvironmentSession

    environment = {"package_dir": str(package), "config": {}}
    rows = [{"messages": [{"role": "user", "content": "q"}]}]
    spec = read_spec(make_spec(tmp_path, tiny_model_dir, "reinforcement", rows, environment=environment))
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
    assert crash_count(redis_client, pool, session.sandbox.package) == 3
    ((server_id, _),) = start_servers(1).items()
    with pytest.raises(TrainerError) as refused:
        EnvironmentSession(spec)
    assert refused.value.code == "environment_error" and "package slow" in refused.value.message
    # ... and the server refuses it
    request = {
        "key": "probe",
        "method": "start",
        "params": {},
        "package": session.sandbox.package,
        "name": "slow",
        "reply": pool_key(pool, "replies", "probe"),
        "deadline": time.time() + 30,
    }
    redis_client.xadd(pool_key(pool, "requests", server_id), {"data": json.dumps(request)})
    deadline = time.monotonic() + 30
    while (answer := redis_client.get(pool_key(pool, "result", "probe"))) is None:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert json.loads(answer)["error"]["code"] == "package_refused"


def services_stream_len(services: Services, pool: str, server_id: str) -> int:
    client = redis.Redis.from_url(services.redis_url)
    try:
        return int(client.xlen(pool_key(pool, "requests", server_id)))
    finally:
        client.close()


def test_rewards_are_scored_while_the_batch_generates_each_once(
    start_servers: Start,
    services: Services,
    pool: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainer.environment import EnvironmentSession
    from trainer.pipeline import RewardPipeline

    start_servers(2)
    trainer_uses_pool(monkeypatch, services, pool)
    rows = [
        json.loads(line) for line in (EXAMPLES / "arithmetic" / "tasks.jsonl").read_text().splitlines()[:4]
    ]
    environment = {"package_dir": str(EXAMPLES / "arithmetic"), "config": {}}
    hyperparameters = {"batch_size": 4, "num_generations": 4, "max_completion_length": 8}
    spec = read_spec(
        make_spec(
            tmp_path,
            tiny_model_dir,
            "reinforcement",
            rows,
            environment=environment,
            hyperparameters=hyperparameters,
            job_id="ftjob-pipelined",
        )
    )
    session = EnvironmentSession(spec)
    session.pipeline = RewardPipeline(session)
    try:
        trainer, dataset = grpo_trainer(spec, session)
        assert type(trainer).__name__ == "PipelinedGRPOTrainer"
        trainer.model.train()
        batch = [dict(dataset[i]) for i in range(4) for _ in range(4)]  # GRPO's layout: each prompt 4 times
        trainer._generate_and_score_completions(batch)
        # groups whose completions all ended went to the servers during generation (those cut at the length
        # limit when it returned); each completion was scored exactly once there
        (early,) = trainer._metrics["train"]["env_sent_early"]
        assert 0 < early <= 1
        records = [json.loads(v) for v in redis_client.hvals(pool_key(pool, "served", "ftjob-pipelined"))]
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
    start_servers: Start,
    services: Services,
    pool: str,
    redis_client: redis.Redis,
    tmp_path: Path,
    tiny_model_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from trainer.environment import EnvironmentSession

    package = write_package(tmp_path, "turns", TURNS)
    servers = start_servers(2)
    trainer_uses_pool(monkeypatch, services, pool)
    rows = [{"messages": [{"role": "user", "content": f"What is {i} + 1?"}]} for i in range(4)]
    environment = {"package_dir": str(package), "config": {}}
    spec = read_spec(
        make_spec(
            tmp_path, tiny_model_dir, "reinforcement", rows, environment=environment, job_id="ftjob-turns"
        )
    )
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
    served = [json.loads(v) for v in redis_client.hvals(pool_key(pool, "served", "ftjob-turns"))]
    assert {r["server"] for r in served if r["method"] == "step"} == set(servers)

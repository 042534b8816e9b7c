"""Reinforcement learning on environment packages: ``python -m trainer run`` with ``spec.environment``.

The example packages (single-turn, multi-turn, tools) train a few GRPO steps in their sandbox; a package
that fails some calls keeps training with the failures counted; one that fails every call fails the job
with ``environment_error`` naming the cause. A package that judges groups gets all completions of one
prompt in one call; the calculator's forced tool calls run in the sandbox and say so in the metrics.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.conftest import REPO, lora_tensors, make_spec, run_trainer
from trainer.data import ITEM_COLUMN
from trainer.environment import EnvironmentSession
from trainer.run import read_spec

pytestmark = pytest.mark.slow

EXAMPLES = REPO / "examples" / "envs"
HP = {
    "max_steps": 3,
    "batch_size": 2,
    "num_generations": 2,
    "max_completion_length": 40,
    "checkpoint_every": 10,
    "learning_rate": 0.05,
}


def rows_of(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (EXAMPLES / name / "tasks.jsonl").read_text().splitlines() if line]


def env_spec(tmp: Path, tiny: Path, package: Path, rows: list[dict[str, Any]], **config: Any) -> Path:
    return make_spec(
        tmp,
        tiny,
        "reinforcement",
        rows,
        hyperparameters=HP,
        environment={"package_dir": str(package), "config": config},
    )


def write_package(root: Path, body: str, *, kind: str = "SingleTurnEnv", timeout_s: int = 5) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "environment.toml").write_text(
        f'name = "broken"\nversion = "0.1.0"\nentrypoint = "broken_env:Env"\n'
        f"\n[limits]\ntimeout_s = {timeout_s}\n"
    )
    (root / "broken_env.py").write_text(f"from envsdk import {kind}, StepResult\n\n\n{body}")
    return root


@pytest.mark.parametrize("name", ["arithmetic", "guess_number", "calculator"])
def test_example_environment_trains(
    tiny: Path, tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # a secret in the trainer's own environment, which no environment code may see
    monkeypatch.setenv("TUNEGATE_DATABASE_URL", "postgresql://tunegate:hunter2@db/tunegate")
    config = {"force_first_tool_call": True} if name == "calculator" else {}
    job = run_trainer(env_spec(tmp_path, tiny, EXAMPLES / name, rows_of(name), **config))
    assert job.rc == 0, job.stderr[-3000:]
    started = [e["message"] for e in job.of("message") if e["message"].startswith("Environment")]
    assert started and name in started[0]
    assert "sandbox (bwrap)" in started[0] or "sandbox (unshare)" in started[0]
    metrics = job.of("metrics")
    assert [m["step"] for m in metrics] == [1, 2, 3]
    for m in metrics:
        data = m["data"]
        assert 0.0 <= data["rewards/environment"] <= 1.0 and data["episode_failures"] == 0
        if name == "arithmetic":
            assert "turns_mean" not in data
        else:
            assert 1.0 <= data["turns_mean"] <= 6 and data["tool_calls_mean"] >= 0
        if name == "calculator":  # every episode opens with the forced call, run by the sandboxed tool
            assert data["tool_calls_mean"] >= 1.0 and data["turns_mean"] >= 1.0
            assert data["tools/calls"] >= 1.0 and data["tools/sandboxed_fraction"] == 1.0
    if name == "arithmetic":  # shaped rewards: any digit earns 0.1, so rewards differ and the model learns
        assert any(m["data"]["reward_mean"] > 0 for m in metrics)
        assert_trained(job.of("result")[0]["adapter_path"])


def assert_trained(adapter_path: str) -> None:
    tensors = lora_tensors(Path(adapter_path))
    assert any(float(v.abs().max()) > 0 for k, v in tensors.items() if "lora_B" in k)  # B starts at zero


def test_multi_turn_rewards_train_the_model_tokens(tiny: Path, tmp_path: Path) -> None:
    package = write_package(
        tmp_path / "talk",
        "class Env(MultiTurnEnv):\n"
        "    max_turns = 2\n"
        "    def step(self, message):\n"
        "        self.turn = getattr(self, 'turn', 0) + 1\n"
        "        reward = min(len(message['content']), 30) / 30\n"
        "        reply = [{'role': 'user', 'content': 'And again?'}]\n"
        "        return StepResult(observation=reply, reward=reward, done=self.turn >= 2)\n",
        kind="MultiTurnEnv",
    )
    (tmp_path / "run").mkdir()
    job = run_trainer(env_spec(tmp_path / "run", tiny, package, rows_of("arithmetic")[:4]))
    assert job.rc == 0, job.stderr[-3000:]
    metrics = [m["data"] for m in job.of("metrics")]
    assert all(1.0 <= d["turns_mean"] <= 2.0 for d in metrics) and any(d["turns_mean"] > 1 for d in metrics)
    assert any(d["reward_std"] > 0 for d in metrics)
    assert_trained(job.of("result")[0]["adapter_path"])


def test_failures_are_data_and_a_broken_environment_fails_the_job(tiny: Path, tmp_path: Path) -> None:
    rows = rows_of("arithmetic")
    flaky = write_package(
        tmp_path / "flaky",
        "class Env(SingleTurnEnv):\n"
        "    def reward(self, task, completion):\n"
        "        if task['answer'] in ('12', '4'):\n"
        "            raise ValueError('cannot score this one')\n"
        "        return 0.5\n",
    )
    (tmp_path / "a").mkdir()
    job = run_trainer(env_spec(tmp_path / "a", tiny, flaky, rows[:4]))
    assert job.rc == 0, job.stderr[-3000:]
    failures = [m["data"]["episode_failures"] for m in job.of("metrics")]
    assert len(failures) == 3 and sum(failures) > 0

    broken = write_package(
        tmp_path / "broken",
        "class Env(MultiTurnEnv):\n"
        "    def reset(self, task):\n"
        "        raise RuntimeError('the dice are lost')\n",
        kind="MultiTurnEnv",
    )
    (tmp_path / "b").mkdir()
    job = run_trainer(env_spec(tmp_path / "b", tiny, broken, rows_of("guess_number")))
    assert job.rc == 1
    error = job.events[-1]
    assert error["type"] == "error" and error["code"] == "environment_error", job.events[-3:]
    assert "the dice are lost" in error["message"] and "broken" in error["message"]


def test_python_grader_rewards_come_from_the_sandbox(tiny: Path, tmp_path: Path) -> None:
    source = (
        "import os\n"
        "def grade(sample, item):\n"
        "    assert os.getuid() != 0 and os.getpid() < 10, 'not in the sandbox'\n"
        "    return min(len(sample['output_text']), 20) / 20\n"
    )
    grader = {"type": "python", "name": "length", "source": source}
    hp = {**HP, "max_steps": 2}
    job = run_trainer(
        make_spec(
            tmp_path, tiny, "reinforcement", rows_of("arithmetic")[:4], hyperparameters=hp, grader=grader
        )
    )
    assert job.rc == 0, job.stderr[-3000:]
    metrics = [m["data"] for m in job.of("metrics")]
    assert len(metrics) == 2
    assert all(d["grader_error_rate"] == 0 and 0 < d["rewards/length"] <= 1 for d in metrics)


LONGEST = (
    "class Env(SingleTurnEnv):\n"
    "    def group_reward(self, task, completions):\n"
    "        lengths = [len(c if isinstance(c, str) else c[-1]['content']) for c in completions]\n"
    "        best = lengths.index(max(lengths))\n"
    "        return [1.0 if i == best else 0.0 for i in range(len(completions))]\n"
)


def test_group_reward_judges_each_prompt_s_completions_together(tiny: Path, tmp_path: Path) -> None:
    package = write_package(tmp_path / "longest", LONGEST)
    rows = [{"messages": [{"role": "user", "content": "unused"}]}] * 2
    spec = read_spec(env_spec(tmp_path, tiny, package, rows))
    session = EnvironmentSession(spec)
    try:
        assert session.uses_group_reward  # describe says the class overrides group_reward
        a, b = ({"messages": [{"role": "user", "content": q}]} for q in ("a?", "b?"))
        # GRPO's groups are consecutive: 3 completions of a, then 2 of b
        completions = ["xx", "xxxxx", "x", "yyyy", "y"]
        rows = [json.dumps(t) for t in (a, a, a, b, b)]
        logged: dict[str, float] = {}
        reward = session.reward_func()
        rewards = reward([None] * 5, completions, **{ITEM_COLUMN: rows, "log_metric": logged.__setitem__})
        assert rewards == [0.0, 1.0, 0.0, 1.0, 0.0]  # the longest of each group, not of the batch
        assert logged["episode_failures"] == 0
        messages = [[{"role": "assistant", "content": c}] for c in ("aaa", "a", "aaaa", "aa")]
        assert reward([None] * 4, messages, **{ITEM_COLUMN: [rows[0]] * 4}) == [0.0, 0.0, 1.0, 0.0]
    finally:
        session.close()

    # through a real run: in every group of 2 exactly one completion scores 1, so every step's mean is 0.5
    (tmp_path / "run").mkdir()
    job = run_trainer(env_spec(tmp_path / "run", tiny, package, rows_of("arithmetic")[:4]))
    assert job.rc == 0, job.stderr[-3000:]
    metrics = [m["data"] for m in job.of("metrics")]
    assert len(metrics) == 3
    for data in metrics:
        assert data["rewards/environment"] == pytest.approx(0.5) and data["episode_failures"] == 0
        assert data["reward_std"] > 0

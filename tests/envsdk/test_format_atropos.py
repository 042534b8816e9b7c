"""The Atropos format (`envsdk.formats.atropos`, atroposlib 0.4.0 from PyPI) through the real sandbox: the
package's `BaseEnv` subclass is made from its own `config_init()`, its `get_next_item` gives the tasks, and
its own `collect_trajectories`/`score` judge each group the trainer generated, answered through an in-process
stand-in for its OpenAI server.

atroposlib is installed from pip's index into a venv (the example package's exact requirement set, built once
for the module) and mounted read-only into the sandbox.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from envsdk.sandbox import Sandbox, SandboxError
from envsdk.venvs import VenvBuilder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envs" / "atropos_arithmetic"


def test_an_atropos_env_scores_the_trainers_group_with_its_own_code_in_the_sandbox(
    builder: VenvBuilder, sandbox_backend: str, tmp_path: Path
) -> None:
    package = tmp_path / "pkg"
    shutil.copytree(EXAMPLE, package)
    with Sandbox(package, config={"atropos_tasks": 3}, venvs=builder, backend=sandbox_backend) as sandbox:
        described = sandbox.describe()
        assert described["kind"] == "single_turn" and described["group_reward"] is True
        tasks = sandbox.tasks()  # drawn from the env's get_next_item, with the prompt its request named
        assert len(tasks) == 3
        first = tasks[0]
        assert first["messages"] == [{"role": "user", "content": first["item"]["question"]}]
        answer = first["item"]["answer"]
        group = [answer, f"I think it is {answer}.", "no idea", [{"role": "assistant", "content": answer}]]
        rewards = [r["reward"] for r in sandbox.group_reward(first, group)]
        # the env's own score(): 1.0 for exactly the answer, 0.5 for the number somewhere, else 0.0
        assert rewards == [1.0, 0.5, 0.0, 1.0]

        # a job's own row (its messages, and the item's columns beside them), in a group of another size
        row = {"messages": first["messages"], "question": first["item"]["question"], "answer": answer}
        assert [r["reward"] for r in sandbox.group_reward(row, ["0", answer])] == [0.0, 1.0]

        # completions are never scored against a prompt they were not generated for
        other = {**row, "messages": [{"role": "user", "content": "What is 1 + 1?"}]}
        refused = sandbox.group_reward(other, ["2", "2"])
        assert all(r["reward"] is None and "did not generate this group for" in r["error"] for r in refused)


# BaseEnv's default collect_trajectories: collect_trajectory once per completion, each asking for n=1
PER_ITEM = """
from atropos_arithmetic import ArithmeticEnv, tokenize_for_trainer


class PerItemEnv(ArithmeticEnv):
    async def collect_trajectories(self, item):
        return await super(ArithmeticEnv, self).collect_trajectories(item)

    async def collect_trajectory(self, item):
        messages = [{"role": "user", "content": item["question"]}]
        out = await self.server.chat_completion(messages=messages, n=1)
        reply = out.choices[0].message.content
        tokens = tokenize_for_trainer(self.tokenizer, messages + [{"role": "assistant", "content": reply}])
        score = 1.0 if reply == item["answer"] else 0.0
        return {"tokens": tokens["tokens"], "masks": tokens["masks"], "scores": score}, []
"""


def test_an_atropos_env_scoring_one_trajectory_at_a_time_keeps_the_groups_order(
    builder: VenvBuilder, sandbox_backend: str, tmp_path: Path
) -> None:
    package = tmp_path / "per-item"
    shutil.copytree(EXAMPLE, package)
    (package / "per_item.py").write_text(PER_ITEM)
    manifest = package / "environment.toml"
    text = manifest.read_text().replace("atropos_arithmetic:ArithmeticEnv", "per_item:PerItemEnv")
    manifest.write_text(text)
    with Sandbox(package, config={"atropos_tasks": 1}, venvs=builder, backend=sandbox_backend) as sandbox:
        (task,) = sandbox.tasks()
        answer = task["item"]["answer"]
        group = [answer, "x", "y", answer, "z", answer]
        assert [r["reward"] for r in sandbox.group_reward(task, group)] == [1.0, 0.0, 0.0, 1.0, 0.0, 1.0]


def test_what_is_not_an_atropos_env_is_refused_at_start(
    builder: VenvBuilder, sandbox_backend: str, tmp_path: Path
) -> None:
    package = tmp_path / "notenv"
    shutil.copytree(EXAMPLE, package)
    (package / "atropos_arithmetic.py").write_text("class ArithmeticEnv:\n    pass\n")
    with pytest.raises(SandboxError, match="is not an atroposlib BaseEnv subclass") as caught:
        Sandbox(package, venvs=builder, backend=sandbox_backend).start()
    assert caught.value.code == "entrypoint_error"

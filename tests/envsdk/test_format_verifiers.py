"""The verifiers format (`envsdk.formats.verifiers`, verifiers 0.3.1 from PyPI) through the real sandbox: the
package's `load_environment(**config)` builds a verifiers environment, its dataset gives the tasks, its
`env_response` answers multi-turn episodes and its `vf.Rubric` computes the rewards.

verifiers is installed from pip's index into a venv (the example package's exact requirement set, built
once for the module) and mounted read-only into the sandbox.
"""

from __future__ import annotations

import shutil
import textwrap
from pathlib import Path
from typing import Any

import pytest

from envsdk.rollout import run_episode
from envsdk.sandbox import Sandbox, SandboxError
from envsdk.types import StopReason
from envsdk.venvs import VenvBuilder

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "envs" / "verifiers_arithmetic"

# A multi-turn verifiers environment, in verifiers' own style: the user gives a hint after a wrong guess,
# a @vf.stop condition ends the rollout on the right number, and the rubric's reward functions see what
# verifiers passes them (state, info, parser, prompt, completion, answer).
GUESS = """
import verifiers as vf
from datasets import Dataset


class GuessEnv(vf.MultiTurnEnv):
    async def env_response(self, messages, state, **kwargs):
        guess = self.parser.parse_answer(messages) or ""
        hint = "higher" if guess.strip().isdigit() and int(guess) < int(state["answer"]) else "lower"
        return [vf.UserMessage(content=f"No, {hint}.")]

    @vf.stop
    async def guessed(self, state) -> bool:
        last = state["trajectory"][-1]["completion"] if state["trajectory"] else []
        return bool(last) and (self.parser.parse_answer(last) or "").strip() == state["answer"]


def solved(parser, completion, answer, **kwargs) -> float:
    return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0


def quick(state, info, prompt, **kwargs) -> float:
    assert isinstance(state, vf.State) and prompt[0]["content"].startswith("Guess")
    return 1.0 / len(state["trajectory"]) * info.get("scale", 1.0)


def load_environment(max_turns: int = 4, **kwargs):
    rows = [{"question": "Guess my number (1-9).", "answer": "6", "info": {"scale": 1.0}}]
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[solved, quick], weights=[1.0, 0.5], parser=parser)
    return GuessEnv(dataset=Dataset.from_list(rows), rubric=rubric, parser=parser, max_turns=max_turns)
"""


def guess_package(root: Path) -> Path:
    root.mkdir()
    manifest = (EXAMPLE / "environment.toml").read_text()
    manifest = manifest.replace('name = "verifiers-arithmetic"', 'name = "vf-guess"')
    manifest = manifest.replace("vf_arithmetic:load_environment", "vf_guess:load_environment")
    (root / "environment.toml").write_text(manifest)
    (root / "vf_guess.py").write_text(textwrap.dedent(GUESS))
    return root


def test_a_verifiers_single_turn_env_is_scored_by_its_rubric_in_the_sandbox(
    builder: VenvBuilder, sandbox_backend: str, tmp_path: Path
) -> None:
    package = tmp_path / "pkg"
    shutil.copytree(EXAMPLE, package)
    with Sandbox(package, config={"num_examples": 5}, venvs=builder, backend=sandbox_backend) as sandbox:
        assert sandbox.describe()["kind"] == "single_turn"
        tasks = sandbox.tasks()  # the environment's own dataset, formatted by verifiers
        assert len(tasks) == 5  # load_environment(num_examples=5): the config became its kwargs
        first = tasks[0]
        assert first["messages"] == [{"role": "user", "content": first["question"]}]
        answer = first["answer"]
        items = [
            {"task": first, "completion": answer},
            {"task": first, "completion": f"I think it is {answer}."},
            {"task": first, "completion": "no idea"},
            {"task": first, "completion": [{"role": "assistant", "content": answer}]},
        ]
        rewards = [r["reward"] for r in sandbox.reward_batch(items)]
        # vf.Rubric's weighted sum: exact_answer (weight 1.0) + number_present (weight 0.5)
        assert rewards == [1.5, 0.5, 0.0, 1.5]


def test_a_verifiers_multi_turn_env_steps_through_env_response_in_the_sandbox(
    builder: VenvBuilder, sandbox_backend: str, tmp_path: Path
) -> None:
    package = guess_package(tmp_path / "guess")
    with Sandbox(package, venvs=builder, backend=sandbox_backend) as sandbox:
        assert sandbox.describe()["kind"] == "multi_turn"
        (task,) = sandbox.tasks()
        assert task["answer"] == "6" and task["info"] == {"scale": 1.0}
        guesses = iter(["3", "8", "6"])

        def policy(messages: list[dict[str, Any]], tools: Any) -> dict[str, Any]:
            return {"role": "assistant", "content": next(guesses)}

        result = run_episode(sandbox, task, policy)
        assert result.stop_reason == StopReason.DONE and result.turns == 3
        # each wrong guess answered by env_response, the right one stopped by the @vf.stop condition
        assert [m["content"] for m in result.messages if m["role"] == "user"][1:] == [
            "No, higher.",
            "No, lower.",
        ]
        # solved (1.0, weight 1.0) + quick (1/3 turns, weight 0.5), summed by the rubric
        assert result.reward == pytest.approx(1.0 + 0.5 / 3)
        assert result.info["metrics"]["reward/solved"] == 1.0
        assert result.info["metrics"]["reward/quick"] == pytest.approx(1 / 3)
        assert result.info["stop_condition"] == "guessed"

        never = run_episode(sandbox, task, lambda m, t: {"role": "assistant", "content": "1"})
        # verifiers' own max_turns stop condition (4) ends it, and the rubric still scores it
        assert never.turns == 4 and never.reward == pytest.approx(0.5 / 4)
        assert never.info["stop_condition"] == "max_turns_reached"


def test_what_is_not_a_verifiers_environment_is_refused_at_start(
    builder: VenvBuilder, sandbox_backend: str, tmp_path: Path
) -> None:
    package = guess_package(tmp_path / "notenv")
    (package / "vf_guess.py").write_text("def load_environment(**kwargs):\n    return {'dataset': []}\n")
    refused = "load_environment returned dict, not a verifiers Environment"
    with pytest.raises(SandboxError, match=refused) as caught:
        Sandbox(package, venvs=builder, backend=sandbox_backend).start()
    assert caught.value.code == "entrypoint_error"

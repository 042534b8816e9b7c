"""TRL's `environment_factory` format played as a tunegate tool environment (`envsdk.formats.trl`), through
the same host API the sandbox serves: TRL's calling conventions for `reset`, tools, `get_reward` and
`reward_funcs`."""

from __future__ import annotations

import json
from typing import Any

import pytest

from envsdk.formats.trl import trl_environment
from envsdk.host import InProcessRunner
from envsdk.rollout import run_episode
from envsdk.types import StopReason

SEEN: list[dict[str, Any]] = []


class Calculator:
    """A TRL environment: written for `GRPOTrainer(environment_factory=Calculator)`."""

    def __init__(self) -> None:
        self.calls = 0
        self.target = 0

    def reset(self, **kwargs: Any) -> str:
        self.target = kwargs["a"] * kwargs["b"]
        self.calls = 0
        return " Use the calculator."

    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first factor.
            b: The second factor.
        """
        self.calls += 1
        return str(a * b)

    def get_reward(self) -> float:
        return 0.5 if self.calls == 1 else 0.0


def exact_answer(completions: list[Any], answer: list[int], **kwargs: Any) -> list[float | None]:
    SEEN.append({"completions": completions, "answer": answer, **kwargs})
    return [
        1.0 if c[-1]["content"].strip() == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)
    ]


def not_for_me(completions: list[Any], **kwargs: Any) -> list[float | None]:
    return [None for _ in completions]  # not applicable: left out of the sum, as TRL leaves it out


TASK = {"messages": [{"role": "user", "content": "What is 6 times 7?"}], "a": 6, "b": 7, "answer": 42}


def calls_then_answers(answer: str) -> Any:
    def policy(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
        if not any(m["role"] == "tool" for m in messages):
            call = {"name": "multiply", "arguments": json.dumps({"a": 6, "b": 7})}
            return {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"id": "c1", "type": "function", "function": call}],
            }
        return {"role": "assistant", "content": answer}

    return policy


def test_a_trl_environment_plays_and_is_scored_as_trl_scores_it() -> None:
    SEEN.clear()
    runner = InProcessRunner(trl_environment(Calculator, [exact_answer, not_for_me]))
    described = runner.describe()
    assert described["kind"] == "tool" and described["scores_truncated"]  # as TRL, which scores them all
    (schema,) = described["tools"]
    assert schema["function"]["name"] == "multiply"
    assert schema["function"]["description"] == "Multiply two integers."
    assert schema["function"]["parameters"]["properties"]["a"] == {
        "type": "integer",
        "description": "The first factor.",
    }

    result = run_episode(runner, TASK, calls_then_answers("42"))
    assert result.stop_reason == StopReason.DONE and result.turns == 2
    assert result.reward == pytest.approx(1.5)  # the reward function's 1 + get_reward's 0.5; None left out
    assert (
        result.messages[0]["content"] == "What is 6 times 7? Use the calculator."
    )  # reset's string appended
    assert result.messages[2] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    (seen,) = SEEN  # called once, with TRL's batch-of-one keyword arguments
    assert seen["answer"] == [42] and seen["a"] == [6] and seen["b"] == [7]
    assert [m["role"] for m in seen["completions"][0]] == ["assistant", "tool", "assistant"]
    assert seen["prompts"] == [[{"role": "user", "content": "What is 6 times 7? Use the calculator."}]]
    assert isinstance(seen["environments"][0], Calculator) and seen["environments"][0].calls == 1
    assert result.info["metrics"] == {"reward/exact_answer": 1.0, "reward/Calculator": 0.5}

    wrong = run_episode(runner, TASK, calls_then_answers("41"))
    assert wrong.reward == pytest.approx(0.5)


def test_each_rollout_gets_a_fresh_environment() -> None:
    runner = InProcessRunner(trl_environment(Calculator, [exact_answer]))
    first = run_episode(runner, TASK, calls_then_answers("42"))
    second = run_episode(runner, TASK, calls_then_answers("42"))
    assert first.reward == second.reward == pytest.approx(1.5)  # the call count did not carry over


def test_what_trl_refuses_is_refused() -> None:
    class NoReset:
        def look(self) -> str:
            """Look around."""
            return ""

    with pytest.raises(Exception, match="reset"):
        InProcessRunner(trl_environment(NoReset, [exact_answer])).describe()

    class NoReward:
        def reset(self, **kwargs: Any) -> None:
            return None

    with pytest.raises(Exception, match="reward_funcs or an environment with get_reward"):
        InProcessRunner(trl_environment(NoReward)).describe()
    with pytest.raises(TypeError, match="callable"):
        trl_environment(Calculator, ["not a function"])  # type: ignore[list-item]

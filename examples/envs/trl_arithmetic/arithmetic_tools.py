"""An environment written for TRL's `GRPOTrainer(environment_factory=...)`, unchanged: tunegate runs it as a
tool environment (`format = "trl"` in environment.toml).

In TRL this file would be used as::

    trainer = GRPOTrainer(
        model=..., train_dataset=dataset, environment_factory=ArithmeticTools,
        reward_funcs=[correct_answer, think_format_reward],
    )

`reset` receives the dataset row's columns; `add` and `multiply` are tools (public methods with a docstring);
`correct_answer` is this package's reward function and `think_format_reward` is TRL's own.
"""

from trl.rewards import think_format_reward


class ArithmeticTools:
    def __init__(self) -> None:
        self.answer = ""
        self.tool_calls = 0

    def reset(self, **kwargs) -> str | None:
        self.answer = str(kwargs["answer"])
        self.tool_calls = 0
        return None

    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.tool_calls += 1
        return str(a + b)

    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        self.tool_calls += 1
        return str(a * b)


def correct_answer(completions, answer, **kwargs) -> list[float]:
    """1.0 when the last assistant message is exactly the answer, 0.5 when it contains it."""
    rewards = []
    for completion, expected in zip(completions, answer):
        text = completion[-1]["content"].strip() if completion else ""
        rewards.append(1.0 if text == str(expected) else 0.5 if str(expected) in text else 0.0)
    return rewards


reward_funcs = [correct_answer, think_format_reward]

"""Test data that more than one module uses: the base model, a chat, rows of each training method, and the
grader of the reinforcement rows."""

from __future__ import annotations

from typing import Any

BASE = "tiny-chat"
"""The base model of every test stack (`trainer.tiny`)."""

MESSAGES: Any = [{"role": "user", "content": "What is the weather in Paris?"}]
"""A chat of one user message."""

TOOLS: Any = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
"""The one tool of the tool-call tests: the weather of a city, asked for by `MESSAGES`."""

SFT: list[dict[str, Any]] = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{2 * i}"},
        ]
    }
    for i in range(8)
]
"""Supervised rows: eight sums answered with the number."""

HELLO_SFT: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
    for i in range(4)
]
"""Four short supervised rows, for jobs whose training is not what a test looks at."""

DPO: list[dict[str, Any]] = [
    {
        "input": {"messages": [{"role": "user", "content": f"Greet person {i}"}]},
        "preferred_output": [{"role": "assistant", "content": "Hello there!"}],
        "non_preferred_output": [{"role": "assistant", "content": "Go away."}],
    }
    for i in range(8)
]
"""Preference rows: a greeting preferred to a rebuff."""

RFT: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": f"Say yes ({i})"}], "answer": "yes"} for i in range(8)
]
"""Reinforcement tasks, graded by `SAYS_YES` (learning itself is tested in test_learning.py)."""

SAYS_YES: dict[str, Any] = {
    "type": "string_check",
    "name": "yes",
    "input": "{{ sample.output_text }}",
    "reference": "y",
    "operation": "like",
}
"""The grader of `RFT`: 1 for an answer with a "y" in it."""

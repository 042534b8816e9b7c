"""Single-digit sums, written as a verifiers environment (`verifiers==0.3.1`, the classic API), unchanged:
tunegate plays it with `format = "verifiers"` in environment.toml.

With verifiers this module is used as::

    env = vf.load_environment("vf-arithmetic")          # or vf_arithmetic.load_environment()
    results = env.evaluate(client, model, num_examples=8)

Its dataset supplies the tasks and its rubric the rewards: 1.0 (weight 1.0) for exactly the answer, and, to
give a tiny model a gradient, 0.5 (weight 0.5) for a reply that holds the right number somewhere.
"""

import re

import verifiers as vf
from datasets import Dataset

NUMBER = re.compile(r"-?\d+")


def sums(n: int, seed: int) -> list[dict]:
    rows, x = [], seed
    for _ in range(n):
        x = (x * 1103515245 + 12345) % (2**31)
        a, b = x % 10, (x // 10) % 10
        rows.append({"question": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b)})
    return rows


def exact_answer(parser, completion, answer, **kwargs) -> float:
    return 1.0 if (parser.parse_answer(completion) or "").strip() == answer else 0.0


def number_present(parser, completion, answer, **kwargs) -> float:
    return 1.0 if answer in NUMBER.findall(parser.parse_answer(completion) or "") else 0.0


def load_environment(num_examples: int = 64, seed: int = 7, **kwargs) -> vf.Environment:
    parser = vf.Parser()
    rubric = vf.Rubric(funcs=[exact_answer, number_present], weights=[1.0, 0.5], parser=parser)
    return vf.SingleTurnEnv(
        dataset=Dataset.from_list(sums(num_examples, seed)), parser=parser, rubric=rubric, **kwargs
    )

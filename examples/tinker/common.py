"""What both Tinker loops share: the arithmetic problems, the chat prompt as tokens, and held-out scoring.

The problems are the arithmetic example's (`examples/envs/arithmetic`): 70 single-digit additions to train
on and 30 held out, asked as "What is 3 + 4? Reply with the number only.". Rewards come from that
environment's own `ArithmeticEnv` (1.0 for exactly the answer, 0.5 for the right number in a sentence).
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any

import tinker
from tinker import types

ARITHMETIC = Path(__file__).resolve().parents[1] / "envs" / "arithmetic"


def problems(name: str) -> list[dict[str, Any]]:
    """`tasks.jsonl` (training) or `heldout.jsonl` rows: `messages` and `answer`."""
    return [json.loads(line) for line in (ARITHMETIC / name).read_text().splitlines() if line.strip()]


def arithmetic_env() -> Any:
    """The arithmetic environment's `ArithmeticEnv`, loaded from its package directory."""
    spec = importlib.util.spec_from_file_location("arithmetic_env", ARITHMETIC / "arithmetic_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.ArithmeticEnv({"partial_credit": True})


def prompt_tokens(tokenizer: Any, task: dict[str, Any]) -> list[int]:
    """The chat prompt of a problem, ending where the assistant's answer starts."""
    text = tokenizer.apply_chat_template(task["messages"], tokenize=False, add_generation_prompt=True)
    return list(tokenizer.encode(text, add_special_tokens=False))


def heldout_reward(sampler: tinker.SamplingClient, tokenizer: Any, env: Any, tasks: list[dict]) -> float:
    """Mean reward of greedy answers to `tasks`."""
    params = types.SamplingParams(max_tokens=12, temperature=0.0, stop=["<|im_end|>"])
    futures = [
        sampler.sample(types.ModelInput.from_ints(prompt_tokens(tokenizer, t)), 1, params) for t in tasks
    ]
    total = 0.0
    for task, future in zip(tasks, futures, strict=True):
        text = tokenizer.decode(future.result().sequences[0].tokens, skip_special_tokens=True)
        total += float(env.reward(task, text))
    return total / len(tasks)


def register_server_tokenizer(base_url: str | None, model_name: str) -> str | None:
    """Make tinker-cookbook's `get_tokenizer(model_name)` load the tokenizer the server advertises for it.

    The cookbook loads a tokenizer by model name, as a Hugging Face hub id; a tunegate base model such as
    `tiny-chat` is none. tunegate's `get_server_capabilities` gives each model's `tokenizer_id` (the model's
    directory on a one-machine stack, the hub id it is configured with otherwise), the one the SDK's own
    `TrainingClient.get_tokenizer()` loads: registered under the model's name, the cookbook loads it too.
    Returns that id; a server that advertises none (Thinking Machines' own) leaves the cookbook's default.
    """
    import functools
    import os

    import httpx
    from tinker_cookbook import tokenizer_utils

    url = (base_url or os.environ["TINKER_BASE_URL"]).rstrip("/")
    answer = httpx.get(
        f"{url}/api/v1/get_server_capabilities",
        headers={"X-API-Key": os.environ["TINKER_API_KEY"]},
        timeout=30,
    )
    answer.raise_for_status()
    for model in answer.json()["supported_models"]:
        if model.get("model_name") == model_name and model.get("tokenizer_id"):
            tokenizer_id: str = model["tokenizer_id"]
            load = functools.partial(tokenizer_utils.get_tokenizer, tokenizer_id)  # cached there
            tokenizer_utils.register_tokenizer(model_name, load)
            return tokenizer_id
    return None

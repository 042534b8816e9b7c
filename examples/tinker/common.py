"""What the Tinker examples share. The two loops (`sft_loop.py`, `rl_loop.py`): their settings and results,
the training client, the arithmetic problems, the chat prompt as tokens, held-out scoring and the command
line. The two tinker-cookbook drivers (`cookbook_sl.py`, `cookbook_rl.py`): the server's tokenizer and how
a cookbook loop is run from the command line.

The problems are the arithmetic example's (`examples/envs/arithmetic`): 70 single-digit additions to train
on and 30 held out, asked as "What is 3 + 4? Reply with the number only.". Rewards come from that
environment's own `ArithmeticEnv` (1.0 for exactly the answer, 0.5 for the right number in a sentence).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import sys
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import tinker
from tinker import types

ARITHMETIC = Path(__file__).resolve().parents[1] / "envs" / "arithmetic"


@dataclass
class LoopConfig:
    """The settings of both loops; each loop's `Config` sets its own defaults and adds its own."""

    base_model: str = "tiny-chat"
    rank: int = 8
    """LoRA rank."""
    learning_rate: float = 1e-3
    steps: int = 10
    batch: int = 8
    """Problems per step."""
    seed: int = 0
    base_url: str | None = None
    """The server (else `TINKER_BASE_URL`)."""
    api_key: str | None = None
    """The key (else `TINKER_API_KEY`)."""


@dataclass
class LoopResult:
    """Held-out reward before and after training; each loop's `Result` adds what its steps measured."""

    heldout_before: float
    heldout_after: float


@contextmanager
def lora_training(config: LoopConfig) -> Iterator[tinker.TrainingClient]:
    """A LoRA training client of `config`'s base model, rank and seed. Leaving the block finishes the
    session: the server saves the model and frees its training slot at once, rather than after the idle
    timeout."""
    with tinker.ServiceClient(base_url=config.base_url, api_key=config.api_key) as service:
        yield service.create_lora_training_client(
            base_model=config.base_model, rank=config.rank, seed=config.seed
        )


ConfigT = TypeVar("ConfigT", bound=LoopConfig)


def loop_cli(main: Callable[[ConfigT], Any], config: type[ConfigT], doc: str) -> None:
    """A loop's command line: `--steps N`, everything else at the loop's defaults."""
    parser = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    parser.add_argument(
        "--steps", type=int, default=config.steps, help="training steps (default: %(default)s)"
    )
    main(config(steps=parser.parse_args().steps))


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


def run_cookbook(train_main: Callable[[Any], Awaitable[None]], config: Any) -> None:
    """Run a tinker-cookbook training loop (`supervised.train.main`, `rl.train.main`) with its `config`,
    the server's tokenizer registered for the model first."""
    from tinker_cookbook import cli_utils

    register_server_tokenizer(config.base_url, config.model_name)
    # Avoid clobbering log dir from your previous run:
    cli_utils.check_log_dir(config.log_path, behavior_if_exists="ask")
    asyncio.run(train_main(config))


def cookbook_cli(
    build_config_blueprint: Callable[[str], Any], main: Callable[[Any], None], model: str
) -> None:
    """A cookbook driver's command line: `key=value` for any field of the cookbook's `Config`, `model_name`
    (default `model`) resolved first so that the data's tokenizer follows it."""
    from tinker_cookbook import cli_utils

    blueprint = build_config_blueprint(cli_utils.model_name_from_argv(sys.argv[1:], default=model))
    blueprint.make_from_argv(sys.argv[1:])
    main(blueprint.make())

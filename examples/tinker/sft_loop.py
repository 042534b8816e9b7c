"""A supervised loop: teach `tiny-chat` to answer the arithmetic problems with the number only.

Each step trains on a batch of (prompt, answer) pairs with the `cross_entropy` loss, the prompt's tokens
weighted 0 and the answer's (and its end-of-turn token) 1. Held-out reward (greedy answers to 30 problems
never trained on, scored by the arithmetic environment) is measured before and after.

    TINKER_BASE_URL=http://localhost:8000 TINKER_API_KEY=tml-sk-tg-... python examples/tinker/sft_loop.py

`--steps N` sets the number of training steps (default 9).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tinker import types

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import (  # noqa: E402
    LoopConfig,
    LoopResult,
    arithmetic_env,
    heldout_reward,
    loop_cli,
    lora_training,
    problems,
    prompt_tokens,
)


@dataclass
class Config(LoopConfig):
    learning_rate: float = 2e-3
    steps: int = 9
    batch: int = 8


@dataclass
class Result(LoopResult):
    losses: list[float] = field(default_factory=list)
    """Mean loss per answer token of each step."""


def sft_datum(tokenizer: Any, task: dict[str, Any]) -> types.Datum:
    prompt = prompt_tokens(tokenizer, task)
    answer = list(tokenizer.encode(task["answer"] + "<|im_end|>", add_special_tokens=False))
    tokens = prompt + answer
    weights = [0.0] * (len(prompt) - 1) + [1.0] * len(answer)
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": weights},
    )


def main(config: Config) -> Result:
    with lora_training(config) as tc:
        tokenizer = tc.get_tokenizer()
        env = arithmetic_env()
        train, heldout = problems("tasks.jsonl"), problems("heldout.jsonl")
        rng = random.Random(config.seed)
        before = heldout_reward(tc.save_weights_and_get_sampling_client(), tokenizer, env, heldout)
        result = Result(before, 0.0)
        adam = types.AdamParams(learning_rate=config.learning_rate)
        for step in range(config.steps):
            batch = [sft_datum(tokenizer, task) for task in rng.sample(train, config.batch)]
            fb = tc.forward_backward(batch, "cross_entropy")
            optim = tc.optim_step(adam)
            out = fb.result()
            optim.result()
            answer_tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
            result.losses.append(out.metrics["loss:sum"] / answer_tokens)
            print(f"step {step}: loss {result.losses[-1]:.4f}", flush=True)
        result.heldout_after = heldout_reward(
            tc.save_weights_and_get_sampling_client(), tokenizer, env, heldout
        )
        print(f"held-out reward {result.heldout_before:.3f} -> {result.heldout_after:.3f}")
        return result


if __name__ == "__main__":
    loop_cli(main, Config, __doc__)

"""An RL loop in the shape of tinker-cookbook's `rl_loop`, on the arithmetic environment.

Each step: sample a group of answers to each problem of a batch from the current sampler, score them with
the environment, centre the rewards within each group (the advantages), train on the sampled tokens with
the `importance_sampling` loss (the sampler's log-probabilities as the old policy), take an Adam step and
save new sampler weights. Held-out reward (greedy answers to 30 problems never trained on) is measured
before and after.

    TINKER_BASE_URL=http://localhost:8000 TINKER_API_KEY=tml-sk-tg-... python examples/tinker/rl_loop.py

`--steps N` sets the number of training steps (default 24).
"""

from __future__ import annotations

import random
import sys
from dataclasses import dataclass, field
from pathlib import Path

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
    learning_rate: float = 5e-4
    steps: int = 24
    batch: int = 4
    group: int = 8
    """Answers sampled per problem."""
    max_tokens: int = 12


@dataclass
class Result(LoopResult):
    train_reward: list[float] = field(default_factory=list)
    """Mean sampled reward of each step."""


def main(config: Config) -> Result:
    with lora_training(config) as tc:
        tokenizer = tc.get_tokenizer()
        env = arithmetic_env()
        train, heldout = problems("tasks.jsonl"), problems("heldout.jsonl")
        rng = random.Random(config.seed)
        stop = ["<|im_end|>"]
        sampler = tc.save_weights_and_get_sampling_client()
        result = Result(heldout_reward(sampler, tokenizer, env, heldout), 0.0)
        adam = types.AdamParams(learning_rate=config.learning_rate)
        for step in range(config.steps):
            batch = rng.sample(train, config.batch)
            params = types.SamplingParams(max_tokens=config.max_tokens, temperature=1.0, stop=stop, seed=step)
            prompts = [prompt_tokens(tokenizer, task) for task in batch]
            futures = [sampler.sample(types.ModelInput.from_ints(p), config.group, params) for p in prompts]
            data: list[types.Datum] = []
            rewards: list[float] = []
            for task, prompt, future in zip(batch, prompts, futures, strict=True):
                sequences = future.result().sequences
                scores = [
                    float(env.reward(task, tokenizer.decode(s.tokens, skip_special_tokens=True)))
                    for s in sequences
                ]
                rewards.extend(scores)
                mean = sum(scores) / len(scores)
                for seq, score in zip(sequences, scores, strict=True):
                    if score == mean or not seq.tokens:
                        continue  # no signal in this answer
                    tokens = prompt + list(seq.tokens)
                    n_prompt = len(prompt) - 1
                    data.append(
                        types.Datum(
                            model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={
                                "target_tokens": tokens[1:],
                                "logprobs": [0.0] * n_prompt + list(seq.logprobs or []),
                                "advantages": [0.0] * n_prompt + [score - mean] * len(seq.tokens),
                            },
                        )
                    )
            result.train_reward.append(sum(rewards) / len(rewards))
            if data:
                fb = tc.forward_backward(data, "importance_sampling")
                tc.optim_step(adam).result()
                fb.result()
                sampler = tc.save_weights_and_get_sampling_client()
            print(
                f"step {step}: sampled reward {result.train_reward[-1]:.3f}, {len(data)} datums", flush=True
            )
        result.heldout_after = heldout_reward(sampler, tokenizer, env, heldout)
        print(f"held-out reward {result.heldout_before:.3f} -> {result.heldout_after:.3f}")
        return result


if __name__ == "__main__":
    loop_cli(main, Config, __doc__)

"""tinker-cookbook's RL loop (`tinker_cookbook.rl.train.main`) on `tiny-chat`, offline.

The cookbook's `recipes/rl_basic.py`, with the environment swapped so that nothing is downloaded: instead of
GSM8K (`openai/gsm8k` from the hub), the cookbook's own `ArithmeticEnv` (`recipes/math_rl/arithmetic_env.py`:
it rewards 1 for the right final number and takes 0.1 off an answer that does not end with the renderer's
stop sequence) poses the 70 training problems of `examples/envs/arithmetic` in that example's words ("What
is 3 + 4? Reply with the number only."), which tiny-chat can learn, rather than its own sums of numbers up
to 100, which tiny-chat cannot. The settings are tiny: 4 steps of 4 problems x 8 samples, LoRA rank 8.
The tokenizer is the one the server advertises for the model; the renderer is `qwen3_instruct`, which
writes ChatML exactly as tiny-chat's Qwen2.5 chat template does when the conversation starts with a system
message (each prompt starts with the template's default one, then the environment's one-shot example).

    export TINKER_API_KEY=tml-sk-tg-...
    python examples/tinker/cookbook_rl.py base_url=http://localhost:8000 log_path=/tmp/cookbook-rl

Any field of `tinker_cookbook.rl.train.Config` can be set the same way (`learning_rate=1e-3`,
`dataset_builder.group_size=16`, ...). Metrics go to `<log_path>/metrics.jsonl` (rewards as
`env/all/reward/total`, `env/all/correct`), checkpoints (`tinker://` paths) to `<log_path>/checkpoints.jsonl`.
"""

from __future__ import annotations

import json
import random
import re
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path

import chz
from tinker_cookbook import cli_utils, renderers
from tinker_cookbook.recipes.math_rl.arithmetic_env import ArithmeticEnv
from tinker_cookbook.rl import train
from tinker_cookbook.rl.problem_env import ProblemGroupBuilder
from tinker_cookbook.rl.types import EnvGroupBuilder, RLDataset, RLDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ARITHMETIC, cookbook_cli, run_cookbook  # noqa: E402

MODEL_NAME = "tiny-chat"
RENDERER_NAME = "qwen3_instruct"
"""ChatML without `<think>`: tiny-chat's (Qwen2.5's) template token for token, given a system message."""
SYSTEM_PROMPT = "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
"""What the Qwen2.5 template puts first when a conversation has no system message."""
_PROBLEM = re.compile(r"What is (\d+) \+ (\d+)\?")


class ArithmeticExampleEnv(ArithmeticEnv):
    """The cookbook's `ArithmeticEnv` (its rewards, stop condition and logging), asking as the arithmetic
    example does: tiny-chat learned "What is 3 + 4? Reply with the number only." and rambles without the
    instruction."""

    def get_question(self) -> str:
        return super().get_question() + " Reply with the number only."


def arithmetic_problems(path: Path = ARITHMETIC / "tasks.jsonl") -> list[tuple[int, int]]:
    """The (x, y) of each "What is x + y?" problem of the arithmetic example's tasks."""
    problems = []
    for line in path.read_text().splitlines():
        if line.strip():
            found = _PROBLEM.search(json.loads(line)["messages"][-1]["content"])
            assert found is not None, line
            problems.append((int(found[1]), int(found[2])))
    return problems


class ArithmeticProblemsDataset(RLDataset):
    """Batches of `batch_size` problems drawn (seeded by the batch index) from `problems`, each a group of
    `group_size` `ArithmeticEnv`s."""

    def __init__(
        self,
        problems: list[tuple[int, int]],
        batch_size: int,
        group_size: int,
        n_batches: int,
        renderer: renderers.Renderer,
    ):
        self.problems = problems
        self.batch_size = batch_size
        self.group_size = group_size
        self.n_batches = n_batches
        self.renderer = renderer
        self.convo_prefix: list[renderers.Message] = [
            {"role": "system", "content": SYSTEM_PROMPT},
            *ArithmeticEnv.standard_fewshot_prefix(),
        ]

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        rng = random.Random(index)
        return [
            ProblemGroupBuilder(
                env_thunk=partial(ArithmeticExampleEnv, x, y, self.renderer, convo_prefix=self.convo_prefix),
                num_envs=self.group_size,
                dataset_name="arithmetic",
            )
            for x, y in rng.sample(self.problems, self.batch_size)
        ]

    def __len__(self) -> int:
        return self.n_batches


@chz.chz
class ArithmeticProblemsBuilder(RLDatasetBuilder):
    batch_size: int
    group_size: int
    n_batches: int
    model_name_for_tokenizer: str
    renderer_name: str

    async def __call__(self) -> tuple[ArithmeticProblemsDataset, None]:
        tokenizer = get_tokenizer(self.model_name_for_tokenizer)
        renderer = renderers.get_renderer(self.renderer_name, tokenizer=tokenizer)
        dataset = ArithmeticProblemsDataset(
            arithmetic_problems(), self.batch_size, self.group_size, self.n_batches, renderer
        )
        return dataset, None


def build_config_blueprint(model_name: str = MODEL_NAME) -> chz.Blueprint[train.Config]:
    builder = ArithmeticProblemsBuilder(
        batch_size=4,
        group_size=8,
        n_batches=4,
        model_name_for_tokenizer=model_name,
        renderer_name=RENDERER_NAME,
    )
    return chz.Blueprint(train.Config).apply(
        {
            "model_name": model_name,
            "recipe_name": "tunegate_cookbook_rl",
            "renderer_name": RENDERER_NAME,
            "log_path": cli_utils.runs_path("cookbook_rl"),
            "dataset_builder": builder,
            "learning_rate": 5e-4,
            "lora_rank": 8,
            "max_tokens": 8,
            "eval_every": 0,
            "save_every": 2,
            "ttl_seconds": None,
        }
    )


def main(config: train.Config) -> None:
    run_cookbook(train.main, config)


if __name__ == "__main__":
    cookbook_cli(build_config_blueprint, main, MODEL_NAME)

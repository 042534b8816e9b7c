"""Single-digit sums, written as an Atropos environment (`atroposlib==0.4.0`), unchanged: tunegate plays it
with `format = "atropos"` in environment.toml.

With Atropos this module is served as::

    python atropos_arithmetic.py serve --openai.base_url http://localhost:9001/v1

Its `collect_trajectories` asks its server for `group_size` answers to one sum and its `score` judges the
group: 1.0 for exactly the answer and, to give a tiny model a gradient, 0.5 for a reply that holds the right
number somewhere, else 0.0.
"""

import random
import re
from pathlib import Path

from atroposlib.envs.base import APIServerConfig, BaseEnv, BaseEnvConfig, ScoredDataGroup
from atroposlib.type_definitions import Item
from atroposlib.utils.tokenize_for_trainer import tokenize_for_trainer

NUMBER = re.compile(r"-?\d+")
TOKENIZER = Path(__file__).resolve().parent / "tokenizer"  # tiny-chat's tokenizer, shipped with the package


class ArithmeticEnv(BaseEnv):
    name = "atropos_arithmetic"

    @classmethod
    def config_init(cls) -> tuple[BaseEnvConfig, list[APIServerConfig]]:
        env_config = BaseEnvConfig(
            tokenizer_name=str(TOKENIZER),
            group_size=4,
            use_wandb=False,
            max_token_length=64,
            total_steps=100,
            batch_size=16,
            ensure_scores_are_not_same=False,
        )
        server_configs = [
            APIServerConfig(model_name="tiny-chat", base_url="http://localhost:9001/v1", api_key="x")
        ]
        return env_config, server_configs

    async def setup(self):
        rng = random.Random(7)
        self.train = [(rng.randrange(10), rng.randrange(10)) for _ in range(64)]
        self.iter = 0

    async def get_next_item(self) -> Item:
        a, b = self.train[self.iter % len(self.train)]
        self.iter += 1
        return {"question": f"What is {a} + {b}? Reply with the number only.", "answer": str(a + b)}

    async def collect_trajectories(self, item: Item) -> tuple[ScoredDataGroup | None, list[Item]]:
        messages = [{"role": "user", "content": item["question"]}]
        completions = await self.server.chat_completion(
            messages=messages, n=self.config.group_size, max_tokens=self.config.max_token_length
        )
        group = [
            (messages + [{"role": "assistant", "content": choice.message.content}], choice.finish_reason)
            for choice in completions.choices
        ]
        return await self.score(group, item["answer"]), []

    async def score(self, group, answer: str) -> ScoredDataGroup | None:
        scores = ScoredDataGroup()
        scores["tokens"], scores["masks"], scores["scores"] = [], [], []
        for messages, finish_reason in group:
            out = tokenize_for_trainer(self.tokenizer, messages, finish_reason)
            reply = messages[-1]["content"].strip()
            scores["tokens"].append(out["tokens"])
            scores["masks"].append(out["masks"])
            scores["scores"].append(
                1.0 if reply == answer else 0.5 if answer in NUMBER.findall(reply) else 0.0
            )
        return scores

    async def evaluate(self, *args, **kwargs):
        return None


if __name__ == "__main__":
    ArithmeticEnv.cli()

"""tinker-cookbook's supervised loop (`tinker_cookbook.supervised.train.main`) on `tiny-chat`, offline.

The cookbook's `recipes/sl_basic.py`, with two changes that let it run on a tunegate stack with no network:
the data is the cookbook's `FromConversationFileBuilder` over `arithmetic_conversations.jsonl` (the 70
training problems of `examples/envs/arithmetic`, each a conversation whose assistant turn is the answer)
instead of `HuggingFaceH4/no_robots` from the hub, and the settings are tiny (batches of 8, 8 steps, LoRA
rank 8). The tokenizer is the one the server advertises for the model (`common.register_server_tokenizer`);
the renderer is `qwen3_instruct`, which writes ChatML exactly as tiny-chat's Qwen2.5 chat template does
when the conversation has a system message (the data carries the template's default one).

    export TINKER_API_KEY=tml-sk-tg-...
    python examples/tinker/cookbook_sl.py base_url=http://localhost:8000 log_path=/tmp/cookbook-sl

Any field of `tinker_cookbook.supervised.train.Config` can be set the same way (`learning_rate=1e-3`,
`dataset_builder.common_config.batch_size=16`, ...). Metrics go to `<log_path>/metrics.jsonl`, checkpoints
(`tinker://` paths) to `<log_path>/checkpoints.jsonl`.
"""

from __future__ import annotations

import sys
from pathlib import Path

import chz
from tinker_cookbook import cli_utils
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.supervised import train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import cookbook_cli, run_cookbook  # noqa: E402

MODEL_NAME = "tiny-chat"
RENDERER_NAME = "qwen3_instruct"
"""ChatML without `<think>`: tiny-chat's (Qwen2.5's) template token for token, given a system message."""
CONVERSATIONS = Path(__file__).resolve().parent / "arithmetic_conversations.jsonl"


def build_config_blueprint(model_name: str = MODEL_NAME) -> chz.Blueprint[train.Config]:
    common_config = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model_name,
        renderer_name=RENDERER_NAME,
        max_length=256,
        batch_size=8,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    dataset = FromConversationFileBuilder(common_config=common_config, file_path=str(CONVERSATIONS))
    return chz.Blueprint(train.Config).apply(
        {
            "log_path": cli_utils.runs_path("cookbook_sl"),
            "model_name": model_name,
            "recipe_name": "tunegate_cookbook_sl",
            "renderer_name": RENDERER_NAME,
            "dataset_builder": dataset,
            "learning_rate": 2e-3,
            "lr_schedule": "constant",
            "lora_rank": 8,
            "num_epochs": 1,
            "max_steps": 8,
            "save_every": 4,
            "eval_every": 0,
            "ttl_seconds": None,
        }
    )


def main(config: train.Config) -> None:
    run_cookbook(train.main, config)


if __name__ == "__main__":
    cookbook_cli(build_config_blueprint, main, MODEL_NAME)

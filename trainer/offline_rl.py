"""Reinforcement learning offline, on logged episodes: a reinforcement job whose training file holds captured
samples (``gateway.capture.export``) learns from the rewards already posted for them, sampling nothing.

Each row is one sample: its exact token ids (``input_ids``), the tokens the engine sampled
(``completion_mask``), the sampler's log-probability of each of them (``logprobs``: the behaviour policy)
and the sample's group-relative ``advantage``. The loss is Tinker's (``trainer.tinker_losses``), ``ppo`` by
default: per sampled token, ``-min(ratio * A, clip(ratio, 0.8, 1.2) * A)`` with ``ratio = exp(logprob now -
logged logprob)``, so the update stays near the policy that sampled the data however far the data is from
the policy being trained; tokens that were not sampled (prompts, tool results, the chat template's own) carry
no loss. A step's loss is the mean over the sampled tokens of its batch.

The loop is transformers' ``Trainer`` (checkpoints that serve and resume, the linear schedule, the trainer's
events through ``trainer.callbacks.EventCallback``), with this loss and these metrics each step:
``reward_mean`` (the batch's rewards), ``advantage_abs_mean``, ``ratio_mean`` and ``clip_fraction`` (the
share of sampled tokens whose ratio left the clip range), and ``mismatch/logprob_diff_mean`` (mean
``|logprob now - logged logprob|``: at the first step, before any update, how closely the trainer
reproduces the sampler's numbers).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

from trainer.tinker_losses import per_token_loss

ROW_KEYS = ("input_ids", "completion_mask", "logprobs", "advantage", "reward")
"""The columns of a converted row (``trainer.data``)."""


@dataclass(frozen=True)
class OfflineRLConfig:
    """How logged episodes are trained on."""

    loss: str = "ppo"
    """A Tinker loss over per-token logprobs (``ppo``, ``importance_sampling``, ``cispo``, ``dro``, ...)."""
    loss_config: dict[str, float] = field(
        default_factory=lambda: {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    )
    """The loss's ``loss_fn_config`` (PPO's clip range by default)."""


def collate(rows: list[dict[str, Any]], pad_token_id: int) -> dict[str, Any]:
    """Rows padded on the right into tensors: ids, attention, the sampled tokens' mask, the logged logprobs
    (0 where none), and per row its advantage and reward."""
    import torch

    width = max(len(r["input_ids"]) for r in rows)

    def padded(key: str, value: Any, dtype: Any) -> Any:
        return torch.tensor([r[key] + [value] * (width - len(r[key])) for r in rows], dtype=dtype)

    return {
        "input_ids": padded("input_ids", pad_token_id, torch.long),
        "attention_mask": torch.tensor(
            [[1] * len(r["input_ids"]) + [0] * (width - len(r["input_ids"])) for r in rows], dtype=torch.long
        ),
        "completion_mask": padded("completion_mask", 0, torch.float32),
        "logprobs": padded("logprobs", 0.0, torch.float32),
        "advantage": torch.tensor([r["advantage"] for r in rows], dtype=torch.float32),
        "reward": torch.tensor([r["reward"] for r in rows], dtype=torch.float32),
    }


def loss_inputs(batch: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """The loss's inputs for the predicted tokens (each position's next token): the logged logprobs as the
    sampling logprobs, the advantage on the sampled tokens; and the mask of those tokens."""
    mask = batch["completion_mask"][:, 1:]
    inputs = {
        "logprobs": batch["logprobs"][:, 1:],
        "advantages": batch["advantage"][:, None].expand_as(mask) * mask,
    }
    return inputs, mask


def token_logprobs(model: Any, input_ids: Any, attention_mask: Any) -> Any:
    """The model's log-probability of each next token (float32), shape ``(batch, length - 1)``."""
    import torch

    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(-1, input_ids[:, 1:, None]).squeeze(-1)


def trainer_class() -> type:
    """transformers' ``Trainer`` with the offline loss (imported late: torch and transformers are heavy)."""
    import torch
    from transformers import Trainer

    class OfflineRLTrainer(Trainer):
        def __init__(self, *args: Any, offline: OfflineRLConfig, **kwargs: Any) -> None:
            super().__init__(*args, **kwargs)
            self.offline = offline
            self._metrics: dict[str, list[float]] = defaultdict(list)

        def compute_loss(
            self,
            model: Any,
            inputs: dict[str, Any],
            return_outputs: bool = False,
            num_items_in_batch: Any = None,
        ) -> Any:
            logprobs = token_logprobs(model, inputs["input_ids"], inputs["attention_mask"])
            given, mask = loss_inputs(inputs)
            per_token = per_token_loss(self.offline.loss, logprobs, given, self.offline.loss_config)
            tokens = mask.sum().clamp(min=1.0)
            loss = (per_token * mask).sum() / tokens
            with torch.no_grad():
                if model.training:
                    self._record(logprobs.detach(), given["logprobs"], mask, tokens, inputs)
            return (loss, {}) if return_outputs else loss

        def _record(self, new: Any, old: Any, mask: Any, tokens: Any, inputs: dict[str, Any]) -> None:
            # Counted in the trainer's state, so a resumed run goes on counting (as GRPO's tokens do).
            self.state.num_input_tokens_seen += int(
                self.accelerator.gather(inputs["attention_mask"].sum()).sum()
            )
            ratio = torch.exp((new - old).clamp(-20.0, 20.0))
            low = self.offline.loss_config.get("clip_low_threshold", 0.8)
            high = self.offline.loss_config.get("clip_high_threshold", 1.2)
            clipped = ((ratio < low) | (ratio > high)).float()
            m = self._metrics
            m["reward"].append(inputs["reward"].mean().item())
            m["advantage_abs_mean"].append(inputs["advantage"].abs().mean().item())
            m["ratio_mean"].append(((ratio * mask).sum() / tokens).item())
            m["clip_fraction"].append(((clipped * mask).sum() / tokens).item())
            m["mismatch/logprob_diff_mean"].append((((new - old).abs() * mask).sum() / tokens).item())

        def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
            if "loss" in logs:  # a training step's log: this step's means
                logs.update({k: sum(v) / len(v) for k, v in self._metrics.items() if v})
                logs["num_tokens"] = float(self.state.num_input_tokens_seen)
                self._metrics.clear()
            super().log(logs, start_time)

    return OfflineRLTrainer


def build_trainer(
    args: dict[str, Any],
    *,
    model: Any,
    tokenizer: Any,
    train_ds: Any,
    peft_config: Any,
    batch_size: int,
    config: OfflineRLConfig | None = None,
) -> Any:
    """The offline trainer of a job: ``args`` are its ``TrainingArguments`` (``trainer.run._common_args``),
    ``batch_size`` the samples of a step on this device (whole batches only, as ``total_steps`` counts)."""
    from peft import get_peft_model
    from transformers import TrainingArguments

    training_args = TrainingArguments(
        **args,
        per_device_train_batch_size=batch_size,
        remove_unused_columns=False,
        dataloader_drop_last=True,
    )
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cls = trainer_class()
    return cls(
        model=get_peft_model(model, peft_config),
        args=training_args,
        train_dataset=train_ds.select_columns(list(ROW_KEYS)),
        processing_class=tokenizer,
        data_collator=lambda rows: collate(rows, pad),
        offline=config or OfflineRLConfig(),
    )

"""DPO on preference pairs of token ids (a dpo job from captured episodes): the sampled ids trained on as they
were sampled, never rendered or tokenized again.

Each row holds the shared prompt's ids (``prompt_ids``), the chosen and the rejected continuation's ids
(``chosen_ids``, ``rejected_ids``) and which of their tokens were sampled (``chosen_mask``,
``rejected_mask``: a multi-turn continuation also holds tool results and the chat template's tokens). TRL's
``DPOTrainer`` (1.x) computes the loss from a batch's ``completion_mask``; it tokenizes every dataset it is
given, so here that step is skipped for rows of ids, and the collator builds ``completion_mask`` from the
rows' masks: the sequences' log-probabilities sum over the sampled tokens only.
"""

from __future__ import annotations

from typing import Any

PAIR_KEYS = ("prompt_ids", "chosen_ids", "rejected_ids", "chosen_mask", "rejected_mask")
"""The columns of a converted pair (``trainer.data``)."""


def collate(rows: list[dict[str, Any]], pad_token_id: int, max_length: int | None) -> dict[str, Any]:
    """A batch as ``DPOTrainer`` takes it: chosen sequences then rejected ones, padded on the right, with
    ``completion_mask`` 1 on the sampled tokens of each continuation (sequences cut at ``max_length``)."""
    import torch

    sequences, masks = [], []
    for side in ("chosen", "rejected"):
        for r in rows:
            sequences.append(r["prompt_ids"] + r[f"{side}_ids"])
            masks.append([0] * len(r["prompt_ids"]) + r[f"{side}_mask"])
    if max_length is not None:
        sequences, masks = [s[:max_length] for s in sequences], [m[:max_length] for m in masks]
    width = max(len(s) for s in sequences)
    return {
        "input_ids": torch.tensor([s + [pad_token_id] * (width - len(s)) for s in sequences]),
        "attention_mask": torch.tensor([[1] * len(s) + [0] * (width - len(s)) for s in sequences]),
        "completion_mask": torch.tensor([m + [0] * (width - len(m)) for m in masks]),
    }


def trainer_class() -> type:
    """TRL's ``DPOTrainer`` that takes rows of ids as they are (imported late)."""
    from trl import DPOTrainer

    class TokenDPOTrainer(DPOTrainer):
        def _prepare_dataset(self, dataset: Any, processing_class: Any, args: Any, dataset_name: str) -> Any:
            if "prompt_ids" in dataset.column_names:
                return dataset  # ids already: nothing to extract, template or tokenize
            return super()._prepare_dataset(dataset, processing_class, args, dataset_name)

        def _set_signature_columns_if_needed(self) -> None:
            if self._signature_columns is None:
                self._signature_columns = list(PAIR_KEYS)  # type: ignore[assignment]

    return TokenDPOTrainer


def build_trainer(dpo_config: Any, *, model: Any, tokenizer: Any, train_ds: Any, peft_config: Any) -> Any:
    """The DPO trainer of a job whose rows are pairs of token ids."""
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    cls = trainer_class()
    return cls(
        model=model,
        args=dpo_config,
        train_dataset=train_ds.select_columns(list(PAIR_KEYS)),
        processing_class=tokenizer,
        peft_config=peft_config,
        data_collator=lambda rows: collate(rows, pad, dpo_config.max_length),
    )

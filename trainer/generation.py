"""Sampling one assistant turn for many episodes at once with the trainer's current policy (multi-turn
environments, :mod:`trainer.environment`)."""

from __future__ import annotations

from typing import Any


def stop_ids(tokenizer: Any) -> set[int]:
    """The tokens that end a turn (end of sequence, padding)."""
    ids = {tokenizer.eos_token_id, tokenizer.pad_token_id}
    return {i for i in ids if isinstance(i, int)}


def generate_turn(
    trainer: Any, contexts: list[list[int]], budgets: list[int], temperature: float
) -> tuple[list[list[int]], list[list[float | None]]]:
    """Sample one turn per context (left-padded batch; greedy at temperature 0); each result is cut after its
    first stop token and at its own budget. With each, the log-probability the sampler drew every token with
    (:mod:`trainer.mismatch`; None at temperature 0, where nothing is drawn)."""
    from contextlib import nullcontext

    import torch

    from trainer.mismatch import SampledLogprobs, recording

    tokenizer = trainer.processing_class
    model = trainer.accelerator.unwrap_model(trainer.model)
    pad = tokenizer.pad_token_id
    width = max(len(c) for c in contexts)
    input_ids = torch.tensor([[pad] * (width - len(c)) + c for c in contexts], device=model.device)
    attention = torch.tensor([[0] * (width - len(c)) + [1] * len(c) for c in contexts], device=model.device)
    max_new = max(1, max(budgets))
    stops = stop_ids(tokenizer)
    # Temperature 0 decodes greedily (evaluations); anything else samples from the whole distribution, with
    # the settings the single-turn sampler sets (a model folder's repetition penalty is not the policy's).
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": temperature, "top_k": 0, "top_p": 1.0, "repetition_penalty": 1.0}
        if temperature > 0
        else {"do_sample": False}
    )
    recorder = SampledLogprobs()
    with torch.no_grad(), recording(model, recorder) if temperature > 0 else nullcontext():
        out = model.generate(
            input_ids=input_ids,
            attention_mask=attention,
            max_new_tokens=max_new,
            pad_token_id=pad,
            eos_token_id=list(stops),
            **sampling,
        )
    results: list[list[int]] = []
    for row, budget in zip(out[:, width:].tolist(), budgets, strict=True):
        ids: list[int] = []
        for token in row[: max(budget, 1)]:
            ids.append(int(token))
            if token in stops:
                break
        results.append(ids)
    return results, recorder.finish(results)

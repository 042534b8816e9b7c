"""Evaluation on the validation file during training, with the numbers OpenAI reports.

A :class:`Validator` scores the model on validation rows:

- reinforcement: each prompt answered once with greedy decoding (an episode played greedily, for
  multi-turn environments) and scored by the job's own reward functions -> ``reward_mean`` (and one
  ``rewards/<name>`` per reward function);
- supervised: the trainer's own evaluation loop -> ``loss`` and ``mean_token_accuracy``;
- dpo: the trainer's own evaluation loop -> ``loss``, and the share of pairs whose preferred answer the model
  finds more likely than the other (summed log-probabilities) -> ``preference_accuracy``.

``EventCallback`` (``trainer.callbacks``) runs it on ``eval_samples`` fixed rows every ``eval_interval`` steps
(``valid_*``), on every row at every checkpoint and before the first step (``full_valid_*``).
"""

from __future__ import annotations

import json
import logging
import random
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

from trainer.contract import TrainerSpec
from trainer.data import ITEM_COLUMN

if TYPE_CHECKING:
    from trainer.environment import EnvironmentSession

logger = logging.getLogger(__name__)

PRIMARY = {"reinforcement": ("reward_mean", True), "supervised": ("loss", False), "dpo": ("loss", False)}
"""The number that ranks checkpoints per method, and whether higher is better."""
GENERATION_BATCH = 32
"""Prompts generated for in one batch during evaluation."""


class Validator:
    """Scores the model on rows of the validation set (a ``datasets.Dataset`` in the method's TRL format)."""

    def __init__(
        self, score: Callable[[Any], dict[str, float]], dataset: Any, samples: int, seed: int, method: str
    ) -> None:
        self._score = score
        self.dataset = dataset
        order = list(range(len(dataset)))
        random.Random(seed).shuffle(order)
        self.sample = dataset.select(sorted(order[: max(1, min(samples, len(order)))]))
        """The fixed rows of the periodic evaluations (the same every time, so their curve is comparable)."""
        self.primary, self.higher_is_better = PRIMARY[method]

    def periodic(self) -> dict[str, float]:
        """``valid_*`` numbers on the fixed sample."""
        return {f"valid_{k}": v for k, v in self._score(self.sample).items()}

    def full(self) -> dict[str, float]:
        """``full_valid_*`` numbers on every validation row."""
        return {f"full_valid_{k}": v for k, v in self._score(self.dataset).items()}

    def better(self, value: float, than: float | None) -> bool:
        """Whether a checkpoint scoring ``value`` on the primary number beats one scoring ``than``."""
        if than is None:
            return True
        return value > than if self.higher_is_better else value < than


def build_validator(
    spec: TrainerSpec,
    trainer: Any,
    dataset: Any,
    reward_funcs: Sequence[Callable[..., list[float | None]]] = (),
    session: EnvironmentSession | None = None,
) -> Validator:
    """The validator of ``spec``'s method for ``trainer`` (the TRL trainer that is training the model)."""
    hp = spec.hyperparameters
    assert isinstance(hp.eval_samples, int)
    score: Callable[[Any], dict[str, float]]
    if spec.method == "reinforcement":
        max_new = int(getattr(hp, "max_completion_length", 64))
        if session is not None and session.multi_turn:

            def score(rows: Any) -> dict[str, float]:
                return _episode_rewards(trainer, session, rows, max_new)

        else:

            def score(rows: Any) -> dict[str, float]:
                return _greedy_rewards(trainer, rows, reward_funcs, max_new)

    elif spec.method == "dpo":

        def score(rows: Any) -> dict[str, float]:
            out = _evaluate_loop(trainer, rows)
            out["preference_accuracy"] = _preference_accuracy(trainer, rows)
            return out

    else:

        def score(rows: Any) -> dict[str, float]:
            return _evaluate_loop(trainer, rows)

    return Validator(score, dataset, hp.eval_samples, spec.seed, spec.method)


# ---- reinforcement ----------------------------------------------------------------------------------


def _policy(trainer: Any) -> Any:
    return trainer.accelerator.unwrap_model(trainer.model)


def greedy_completions(trainer: Any, prompts: list[Any], max_new_tokens: int) -> list[str]:
    """One greedy answer per chat prompt, decoded without special tokens."""
    import torch

    tokenizer = trainer.processing_class
    model = _policy(trainer)
    was_training = model.training
    model.eval()
    texts: list[str] = []
    side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    try:
        for start in range(0, len(prompts), GENERATION_BATCH):
            chunk = [
                tokenizer.apply_chat_template(p, add_generation_prompt=True, tokenize=False)
                if isinstance(p, list)
                else p
                for p in prompts[start : start + GENERATION_BATCH]
            ]
            enc = tokenizer(chunk, return_tensors="pt", padding=True, add_special_tokens=False).to(
                model.device
            )
            with torch.no_grad():
                out = model.generate(
                    **enc,
                    max_new_tokens=max_new_tokens,
                    do_sample=False,
                    pad_token_id=tokenizer.pad_token_id,
                    eos_token_id=tokenizer.eos_token_id,
                )
            texts += tokenizer.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    finally:
        tokenizer.padding_side = side
        if was_training:
            model.train()
    return texts


def _summed(per_func: dict[str, list[float | None]], n: int) -> dict[str, float]:
    """Mean of the rewards summed over reward functions (as GRPO sums them), and each function's mean."""
    totals = [sum(r[i] or 0.0 for r in per_func.values()) for i in range(n)]
    out = {"reward_mean": sum(totals) / max(n, 1)}
    for name, rewards in per_func.items():
        out[f"rewards/{name}"] = sum(r or 0.0 for r in rewards) / max(n, 1)
    return out


def _greedy_rewards(
    trainer: Any, rows: Any, reward_funcs: Sequence[Callable[..., list[float | None]]], max_new: int
) -> dict[str, float]:
    prompts = list(rows["prompt"])
    texts = greedy_completions(trainer, prompts, max_new)
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    columns = {ITEM_COLUMN: list(rows[ITEM_COLUMN])}
    per_func = {
        getattr(f, "__name__", f"reward_{i}"): list(f(prompts=prompts, completions=completions, **columns))
        for i, f in enumerate(reward_funcs)
    }
    return _summed(per_func, len(prompts))


def _episode_rewards(trainer: Any, session: EnvironmentSession, rows: Any, budget: int) -> dict[str, float]:
    tasks = []
    for prompt, raw in zip(rows["prompt"], rows[ITEM_COLUMN], strict=True):
        task = json.loads(raw) if isinstance(raw, str) else dict(raw or {})
        task.setdefault("messages", prompt)
        tasks.append(task)
    model = _policy(trainer)
    was_training = model.training
    model.eval()
    try:
        episodes = session.play(trainer, tasks, budget, temperature=0.0)
    finally:
        if was_training:
            model.train()
    rewards: list[float | None] = [None if e.error else e.reward for e in episodes]
    return _summed({"environment": rewards}, len(episodes))


# ---- supervised and dpo -----------------------------------------------------------------------------


def _evaluate_loop(trainer: Any, rows: Any) -> dict[str, float]:
    """The trainer's own evaluation loop (the same loss as training), its ``eval_`` prefix removed."""
    metrics = trainer.evaluate(eval_dataset=rows)
    keep = ("eval_loss", "eval_mean_token_accuracy")
    return {key[len("eval_") :]: float(metrics[key]) for key in keep if key in metrics}


def _preference_accuracy(trainer: Any, rows: Any) -> float:
    """Share of pairs whose preferred answer has the higher summed log-probability under the model."""
    import torch

    tokenizer = trainer.processing_class
    model = _policy(trainer)
    was_training = model.training
    model.eval()
    wins = 0
    try:
        for prompt, chosen, rejected in zip(rows["prompt"], rows["chosen"], rows["rejected"], strict=True):
            logps = [_answer_logp(model, tokenizer, prompt, answer, torch) for answer in (chosen, rejected)]
            wins += logps[0] > logps[1]
    finally:
        if was_training:
            model.train()
    return wins / max(len(rows), 1)


def _answer_logp(model: Any, tokenizer: Any, prompt: list[dict[str, Any]], answer: Any, torch: Any) -> float:
    """Summed log-probability of ``answer``'s tokens after ``prompt`` (both rendered by the chat template)."""
    context = tokenizer.apply_chat_template(prompt, add_generation_prompt=True, tokenize=False)
    full = tokenizer.apply_chat_template(list(prompt) + list(answer), tokenize=False)
    context_ids = tokenizer(context, add_special_tokens=False)["input_ids"]
    full_ids = tokenizer(full, add_special_tokens=False)["input_ids"]
    ids = torch.tensor([full_ids], device=model.device)
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, :-1].float()
    logps = torch.log_softmax(logits, dim=-1)
    targets = ids[0, 1:]
    picked = logps.gather(1, targets.unsqueeze(1)).squeeze(1)
    return float(picked[len(context_ids) - 1 :].sum())

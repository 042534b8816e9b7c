"""The built-in losses of Tinker's `forward_backward`, on one sequence's per-token log-probabilities.

Each loss takes the new log-probabilities of the target tokens (`logprobs`, with gradient) and the datum's
`loss_fn_inputs` as float tensors of the same length, and returns the per-token loss whose sum is the
datum's loss (Tinker sums over tokens and datums; nothing is averaged). The formulas are Tinker's:

- `cross_entropy`: `-weights * logprobs` (`weights` default 1).
- `importance_sampling`: `-exp(logprobs - sampling_logprobs) * advantages`.
- `ppo`: `-min(ratio * A, clip(ratio, clip_low_threshold, clip_high_threshold) * A)` (defaults 0.8, 1.2).
- `cispo`: `-stop_grad(clip(ratio, low, high)) * logprobs * A`.
- `dro`: `-(logprobs * A - beta / 2 * (logprobs - sampling_logprobs) ** 2)` (`beta` default 0.05).
- `gspo`: PPO on the sequence-level ratio `exp(mean(logprobs - sampling_logprobs))`.

The RL losses read the sampler's log-probabilities from the input `logprobs` and the advantages from
`advantages`. Losses Tinker names that need what a server of this kind does not keep (`stable_reinforce`
reads the sampler's recorded stability information; `custom` runs a traced graph) are refused by name.
"""

from __future__ import annotations

import math
from typing import Any

from trainer.contract import tinker_loss_error


class LossInputError(ValueError):
    """A loss was asked for that does not exist, or its inputs do not fit: the caller's error."""


def check_loss(name: str) -> None:
    """Refuse a loss name this server does not compute, naming the ones it does."""
    error = tinker_loss_error(name)
    if error is not None:
        raise LossInputError(error)


def _need(inputs: dict[str, Any], name: str, loss: str) -> Any:
    if name not in inputs:
        raise LossInputError(f"The loss '{loss}' needs the loss_fn_input '{name}'.")
    return inputs[name]


def _number(config: dict[str, Any], key: str, default: float) -> float:
    """A `loss_fn_config` value the loss reads as a number (`loss_fn_config_v2` may carry text)."""
    value = config.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise LossInputError(f"loss_fn_config '{key}' must be a finite number, not {value!r}.")
    return float(value)


def per_token_loss(name: str, logprobs: Any, inputs: dict[str, Any], config: dict[str, Any]) -> Any:
    """The per-token loss of one datum (a tensor shaped like `logprobs`)."""
    import torch

    check_loss(name)
    if name == "cross_entropy":
        weights = inputs.get("weights")
        return -(logprobs if weights is None else weights * logprobs)
    old = _need(inputs, "logprobs", name)
    adv = _need(inputs, "advantages", name)
    low = _number(config, "clip_low_threshold", 0.8)
    high = _number(config, "clip_high_threshold", 1.2)
    if name == "importance_sampling":
        return -torch.exp(logprobs - old) * adv
    if name == "ppo":
        ratio = torch.exp(logprobs - old)
        return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)
    if name == "cispo":
        ratio = torch.exp(logprobs - old)
        return -torch.clamp(ratio, low, high).detach() * logprobs * adv
    if name == "dro":
        beta = _number(config, "beta", 0.05)
        return -(logprobs * adv - beta / 2 * (logprobs - old) ** 2)
    # gspo: one ratio for the whole sequence, spread over its tokens
    ratio = torch.exp((logprobs - old).mean()).expand_as(logprobs)
    return -torch.minimum(ratio * adv, torch.clamp(ratio, low, high) * adv)

"""The losses of the Tinker API's `forward_backward`: which the trainer computes, which it refuses by name,
and the `loss_fn_inputs` each reads (what the gateway checks a request for before the training process
gets it)."""

from __future__ import annotations

TINKER_LOSSES = ("cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "gspo")
"""The built-in losses of Tinker's `forward_backward` that `trainer.tinker_losses` computes."""
TINKER_REFUSED_LOSSES = ("stable_reinforce", "custom")
"""Losses the Tinker SDK names that need what this server does not keep (the sampler's recorded stability
information; a traced loss graph run server-side): refused by name."""


def tinker_loss_error(name: str) -> str | None:
    """Why `name` is not a loss this server computes, or None when it is."""
    if name in TINKER_LOSSES:
        return None
    if name in TINKER_REFUSED_LOSSES:
        return f"The loss '{name}' is not supported by this server; use one of {list(TINKER_LOSSES)}."
    return f"Unknown loss function '{name}'; the built-in losses are {list(TINKER_LOSSES)}."


def tinker_required_inputs(name: str) -> tuple[str, ...]:
    """The `loss_fn_inputs` every datum of the loss `name` must carry (`weights` is optional): the target
    tokens, and for the reinforcement learning losses the sampler's `logprobs` and the `advantages`."""
    return ("target_tokens",) if name == "cross_entropy" else ("target_tokens", "logprobs", "advantages")

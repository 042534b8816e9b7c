"""Per-request sampling parameters and the per-row token sampler.

Rows of one batch may ask for different temperatures, nucleus sizes and seeds: each row owns a
``torch.Generator`` seeded from its request's seed, so a seeded request gives the same tokens whether it
runs alone or batched with others.
"""

from __future__ import annotations

import logging
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)


@dataclass
class SamplingParams:
    """How one request's choices are generated."""

    max_tokens: int
    """Upper bound on generated tokens per choice."""
    temperature: float = 1.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    """Nucleus size in (0, 1]."""
    seed: int | None = None
    """Seeds each choice's generator (choice ``i`` uses ``seed + i``); random when unset."""
    stop: list[str] = field(default_factory=list)
    """Strings that end a choice; they are trimmed from the output."""
    logprobs: bool = False
    """Report the chosen token's log-probability."""
    top_logprobs: int = 0
    """Also report this many most likely alternatives at each position."""
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens."""
    stop_token_ids: list[int] = field(default_factory=list)
    """Tokens that end a choice (even with ``ignore_eos``); kept in its token ids, not in its text."""

    def row_seed(self, index: int) -> int:
        """The seed of choice ``index``."""
        if self.seed is None:
            return random.getrandbits(62)
        return (self.seed + index) % (2**63)


@dataclass
class TokenLogprob:
    """Log-probability of one generated token and of its most likely alternatives."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]
    """``(token_id, logprob)`` pairs, most likely first."""


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (sampling runs on CPU copies of the logits)."""
    import torch

    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return gen


def sample_row(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator) -> int:
    """Pick the next token from one row of float32 CPU logits ``[vocab]``."""
    import torch

    if params.temperature <= 0.0:
        return int(torch.argmax(logits).item())
    probs = torch.softmax(logits / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_probs, sorted_idx = torch.sort(probs, descending=True)
        cumulative = torch.cumsum(sorted_probs, dim=-1)
        # keep the smallest prefix whose mass reaches top_p (always at least the top token)
        drop = (cumulative - sorted_probs) >= params.top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        choice = torch.multinomial(sorted_probs, 1, generator=generator)
        return int(sorted_idx[choice].item())
    return int(torch.multinomial(probs, 1, generator=generator).item())


def token_logprob(logits: torch.Tensor, token_id: int, top_n: int) -> TokenLogprob:
    """The log-probability of ``token_id`` under the unscaled distribution, and the ``top_n`` best."""
    import torch

    logprobs = torch.log_softmax(logits, dim=-1)
    top: list[tuple[int, float]] = []
    if top_n > 0:
        values, indices = torch.topk(logprobs, min(top_n, logprobs.shape[-1]))
        top = [(int(i), float(v)) for v, i in zip(values.tolist(), indices.tolist(), strict=True)]
    return TokenLogprob(token_id=token_id, logprob=float(logprobs[token_id].item()), top=top)

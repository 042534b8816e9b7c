"""What the gateway holds requests for a base model to before any engine sees them (its context length, the
longest token of its vocabulary), read from its settings and files, so that a request that cannot fit is
refused the same way whichever engine serves the model."""

from __future__ import annotations

import json
from dataclasses import dataclass

import orjson

from gateway.settings import Settings

DEFAULT_CONTEXT_LENGTH = 1_048_576
"""Context length of a base model with no `context_length` setting whose `config.json` the gateway cannot
read (the engines live elsewhere): generous, so only absurd `max_tokens` values are refused for it."""


@dataclass(frozen=True, slots=True)
class ModelLimits:
    """What the gateway holds requests for one base model to before any engine sees them, so that a request
    that cannot fit is refused the same way whichever engine serves the model."""

    context_length: int
    """Most tokens of prompt and completion in one request (`read_context_length`)."""
    longest_token_chars: int | None = None
    """Characters of the longest token of the model's vocabulary (`read_longest_token_chars`); None when the
    gateway cannot read the tokenizer."""

    @property
    def max_prompt_chars(self) -> int | None:
        """No prompt of more characters fits the context: each token stands for at most
        `longest_token_chars` of them (the bound the engines apply too, before tokenizing)."""
        if self.longest_token_chars is None:
            return None
        return self.context_length * self.longest_token_chars


def read_context_length(settings: Settings, base_model: str) -> int:
    """The context length of a base model: its `context_length` setting; else the `max_position_embeddings`
    of its `config.json`, held to `engine_max_model_len` when that is set (the engines `tunegate up` starts
    are started with it: vLLM's `--max-model-len`, the embedded engine's); else `engine_max_model_len`;
    else `DEFAULT_CONTEXT_LENGTH`."""
    entry = settings.base_models[base_model]
    if entry.context_length is not None:
        return entry.context_length
    try:
        config = json.loads((settings.base_model_path(base_model) / "config.json").read_text())
        value = config.get("max_position_embeddings")
    except (OSError, ValueError, AttributeError):
        value = None
    own = value if type(value) is int and value > 0 else None
    cap = settings.engine_max_model_len
    if own is not None and cap is not None:
        return min(own, cap)
    return own or cap or DEFAULT_CONTEXT_LENGTH


def read_longest_token_chars(settings: Settings, base_model: str) -> int | None:
    """Characters of the longest token in the `tokenizer.json` of a base model (its vocabulary and its added
    tokens, as written there: one character a byte for byte-level BPE), as vLLM measures it for its own
    bound; None when the file cannot be read here."""
    try:
        data = orjson.loads((settings.base_model_path(base_model) / "tokenizer.json").read_bytes())
        model = data["model"]
        vocab = model["vocab"]
        pieces = (
            list(vocab)
            if isinstance(vocab, dict)
            else [item[0] for item in vocab if isinstance(item, list) and item]
        )
        pieces += [t["content"] for t in data.get("added_tokens") or [] if isinstance(t, dict)]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    longest = max((len(p) for p in pieces if isinstance(p, str)), default=0)
    return longest or None


def read_limits(settings: Settings, base_model: str) -> ModelLimits:
    """The `ModelLimits` of a base model, read from its settings and files."""
    return ModelLimits(
        read_context_length(settings, base_model), read_longest_token_chars(settings, base_model)
    )

"""Prices: what tokens and training time cost, from the settings' price table (USD per million tokens and
per hour of the core training loop, per base model)."""

from __future__ import annotations

import logging
from typing import Any

from gateway.settings import Settings

logger = logging.getLogger(__name__)

MILLION = 1_000_000.0


def input_cost(settings: Settings, base_model: str, prompt_tokens: int) -> float:
    """USD for prompt tokens."""
    return prompt_tokens * settings.price_of(base_model).input_per_million / MILLION


def output_cost(settings: Settings, base_model: str, completion_tokens: int) -> float:
    """USD for completion tokens."""
    return completion_tokens * settings.price_of(base_model).output_per_million / MILLION


def training_tokens_cost(settings: Settings, base_model: str, trained_tokens: int) -> float:
    """USD for trained tokens."""
    return trained_tokens * settings.price_of(base_model).training_per_million / MILLION


def training_time_cost(settings: Settings, base_model: str, seconds: float) -> float:
    """USD for time in the core training loop."""
    return seconds / 3600.0 * settings.price_of(base_model).training_per_hour


def completion_cost(settings: Settings, base_model: str, prompt_tokens: int, completion_tokens: int) -> float:
    """USD for one completion's tokens."""
    return input_cost(settings, base_model, prompt_tokens) + output_cost(
        settings, base_model, completion_tokens
    )


def training_cost(settings: Settings, base_model: str, trained_tokens: int, seconds: float) -> float:
    """USD for training progress: trained tokens plus core-loop time."""
    return training_tokens_cost(settings, base_model, trained_tokens) + training_time_cost(
        settings, base_model, seconds
    )


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap upper-ish estimate of a request's prompt tokens (about four characters a token, plus a few
    tokens of chat template per message), without a tokenizer on the request path."""
    chars = 0
    extra = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            extra += 4
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, str):
                    chars += len(content)
                elif isinstance(content, list):
                    chars += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, dict))
                if m.get("tool_calls"):
                    chars += len(str(m["tool_calls"]))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        for p in prompt:
            chars += len(p) if isinstance(p, str) else (len(p) * 4 if isinstance(p, list) else 4)
    if body.get("tools"):
        chars += len(str(body["tools"]))
    return chars // 4 + extra + 1


def requested_max_tokens(body: dict[str, Any], default: int) -> int:
    """Completion tokens a request may produce: `max_completion_tokens` or `max_tokens` (else `default`),
    times `n`."""
    value = body.get("max_completion_tokens") or body.get("max_tokens") or default
    n = body.get("n") or 1
    try:
        return max(1, int(value)) * max(1, int(n))
    except (TypeError, ValueError):
        return default

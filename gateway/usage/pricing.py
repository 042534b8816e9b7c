"""Prices: what tokens and training time cost, from the settings' price table (USD per million tokens and
per hour of the core training loop, per base model), and what bytes kept in capture cost (per GB-month)."""

from __future__ import annotations

import logging

from gateway.settings import Settings

logger = logging.getLogger(__name__)

MILLION = 1_000_000.0
GB_MONTH_BYTE_SECONDS = 1e9 * 30 * 86_400
"""Byte-seconds in a GB-month (a GB kept 30 days)."""


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


def gb_months(byte_seconds: float) -> float:
    """Byte-seconds as GB-months."""
    return byte_seconds / GB_MONTH_BYTE_SECONDS


def capture_storage_cost(settings: Settings, byte_seconds: float) -> float:
    """USD for bytes kept in capture (`gateway.usage.storage`), per GB-month."""
    return gb_months(byte_seconds) * settings.capture_storage_per_gb_month

"""Settings of usage metering and billing: the gateway's usage buffer, the price table, and the meter events
sent to Stripe."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr


class ModelPrice(BaseModel):
    """Prices of one base model (and of every adapter on it), in USD."""

    input_per_million: float = 0.20
    """Per million prompt tokens."""
    output_per_million: float = 0.60
    """Per million completion tokens."""
    training_per_million: float = 3.00
    """Per million trained tokens."""
    training_per_hour: float = 0.0
    """Per hour of the core training loop (reinforcement fine-tuning is usually billed this way)."""


class MeteringSettings(BaseModel):
    """Usage metering and billing: how a gateway buffers and flushes usage rows, what each base model costs,
    and how the worker aggregates usage into Stripe meter events."""

    usage_buffer_rows: int = 100_000
    """Completion usage rows a gateway holds before a flush; when full, new rows are dropped (and counted)."""
    usage_flush_rows: int = 32
    """A flush starts as soon as this many usage rows are waiting. Small batches keep each write's burst of
    database work short (with one client, 500-row batches made the gateway's p99 1-2 ms worse than 32)."""
    usage_flush_interval_s: float = 1.0
    """Longest time a usage row waits in the gateway before it is written."""
    prices: dict[str, ModelPrice] = Field(default_factory=dict)
    """Price table per base model (JSON): `{"tiny-chat": {"input_per_million": 0.2, ...}}`; the key `*`
    prices every base model not named (unset: `ModelPrice`'s defaults)."""
    capture_storage_per_gb_month: float = 0.10
    """USD per GB-month (30 days) of bytes an organisation keeps in capture (its records' `stored_bytes`,
    metered in byte-seconds while they are kept)."""
    stripe_api_key: SecretStr | None = None
    """Stripe secret key. Unset: usage is aggregated into the outbox but nothing is sent."""
    stripe_api_base: str | None = None
    """Stripe API base URL (unset: Stripe's own); a local stand-in in tests."""
    stripe_max_retries: int = 3
    """Network retries of the Stripe SDK per meter event (429 and 5xx, with backoff)."""
    stripe_meter_input_tokens: str = "tunegate_input_tokens"
    """Stripe meter event name for prompt tokens."""
    stripe_meter_output_tokens: str = "tunegate_output_tokens"
    """Stripe meter event name for completion tokens."""
    stripe_meter_training_tokens: str = "tunegate_training_tokens"
    """Stripe meter event name for trained tokens."""
    stripe_meter_training_seconds: str = "tunegate_training_seconds"
    """Stripe meter event name for seconds of the core training loop."""
    stripe_meter_capture_storage: str = "tunegate_capture_byte_hours"
    """Stripe meter event name for the bytes kept in capture, in byte-hours."""
    billing_window_s: int = 3600
    """Width of the usage windows aggregated into one meter event per organisation and meter."""
    billing_interval_s: int = 60
    """How often the worker aggregates unbilled usage and sends pending meter events."""

    def price_of(self, base_model: str) -> ModelPrice:
        """Prices of `base_model` (those of `*`, or the defaults, when it has none of its own)."""
        return self.prices.get(base_model) or self.prices.get("*") or ModelPrice()

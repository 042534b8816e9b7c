"""Settings of the Tinker API: how long a Tinker training model holds a worker's training slot, how long
requests and ephemeral checkpoints are kept, and how large one request may be."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TinkerSettings(BaseModel):
    """The Tinker API: when a training model lets its slot go (idle, held too long, or others waiting), how
    long answered requests and sampler checkpoints live, how long a spent budget holds a loop, and the
    largest `forward_backward`."""

    tinker_idle_timeout_s: float = Field(default=300.0, gt=0)
    """A Tinker training model with no request for this long is saved and let go by its worker, freeing
    the training slot; its next request loads it again (`gateway.tinker.holder`)."""
    tinker_max_hold_s: float = Field(default=600.0, gt=0)
    """How long a worker keeps a Tinker training model on its training slot while other work (a queued job,
    another model) waits for one and the fair order puts it first: past it, the model is saved (adapter,
    optimizer and the gradients of a step not taken yet) once the request in hand is answered and lets the
    slot go; its next request waits its turn and loads that state. Counted from when the model was taken,
    busy or idle, optimizer steps included."""
    tinker_yield_idle_s: float = Field(default=60.0, gt=0)
    """A Tinker training model with no request for this long lets its slot go as soon as other work waits
    for one, as at `tinker_max_hold_s` (with nothing waiting, `tinker_idle_timeout_s` applies)."""
    tinker_request_retention_s: float = Field(default=86_400.0, gt=0)
    """How long an answered Tinker request (a future and its result) is kept for `retrieve_future`; a worker's
    cron deletes older ones (their data is dropped as soon as they are answered)."""
    tinker_ephemeral_ttl_s: float = Field(default=86_400.0, ge=3600)
    """How long a sampler checkpoint saved for a sampling client at once
    (`save_weights_and_get_sampling_client`) lives; then a worker's cron deletes it, its served model and its
    files. Named checkpoints live for the `ttl_seconds` they were saved with, or for good."""
    tinker_budget_pause_s: int = Field(default=600, ge=0)
    """How long the Tinker SDK holds a training loop whose organisation's monthly budget is spent (retrying,
    so that raising the budget lets it go on) before it raises `BillingError`."""
    tinker_max_numbers: int | None = Field(default=None, ge=1)
    """Most numbers one `forward_backward` request may decode to: its input tokens and every entry of its
    `loss_fn_inputs`, a sparse tensor counted at its dense size, checked on the declared sizes before
    anything is expanded; more is a 400. Unset: half of `max_request_body_bytes` (twice what a body of that
    size carries as dense 4-byte values)."""

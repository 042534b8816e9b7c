"""The shapes of Tinker's billing reports, as the official SDK (`tinker` 0.38) reads them
(`tinker.types.BillingUsageResponse`, `CurrentCheckpointStorageUsageResponse`), and of the Tinker-loop
estimate (`POST /v1/tinker/estimate`, in the family of `POST /v1/fine_tuning/jobs/estimate`)."""

from __future__ import annotations

from datetime import datetime
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from gateway.jobs.protocol import Assumption, BudgetState, CostRange
from gateway.protocol import OpenAIBaseModel


# ---------------------------------------------------------------------------------------------- usage events
class TrainingEvent(BaseModel):
    type: Literal["training"] = "training"
    token_count: int


class SamplingPrefillEvent(BaseModel):
    type: Literal["sampling_prefill"] = "sampling_prefill"
    cached: bool = False
    """tunegate has no prefill cache priced apart: every prompt token is full-rate."""
    token_count: int


class SamplingSampleEvent(BaseModel):
    type: Literal["sampling_sample"] = "sampling_sample"
    token_count: int


class CheckpointEvent(BaseModel):
    type: Literal["checkpoint"] = "checkpoint"
    count: int


EventInfo = Annotated[
    TrainingEvent | SamplingPrefillEvent | SamplingSampleEvent | CheckpointEvent, Field(discriminator="type")
]


class BillingUsageEvent(BaseModel):
    """One hour of one kind of usage on one base model (and session, where it is attributed)."""

    bucket_start: datetime
    bucket_end: datetime
    base_model: str | None = None
    user_id: str | None = None
    user_name: str | None = None
    session_id: str | None = None
    project_id: str | None = None
    estimated_cost_usd: float | None = None
    """`effective_rate_usd_per_million_tokens * token_count / 1e6` for token events; None for checkpoints."""
    effective_rate_usd_per_million_tokens: float | None = None
    effective_rate_usd_per_gigabyte_month: float | None = None
    event_info: EventInfo

    def token_count(self) -> int:
        return getattr(self.event_info, "token_count", 0)


class BillingUsageSession(BaseModel):
    user_metadata: dict[str, str] | None = None


class BillingUsageResponse(BaseModel):
    data: list[BillingUsageEvent]
    """Ordered by bucket, then by descending token count."""
    sessions: dict[str, BillingUsageSession]
    cost_data_through: datetime | None = None
    """Always None: no estimate here is priced from an invoice (all come from the price table)."""


# ---------------------------------------------------------------------------------------------- storage now
class CurrentCheckpointStorageUsageItem(BaseModel):
    project_id: str | None = None
    org_user_urn: str | None = None
    user_email: str | None = None
    user_name: str | None = None
    checkpoint_count: int
    size_bytes: int
    size_gigabytes: float
    estimated_monthly_cost_usd: float | None = None
    """None: tunegate has no storage price."""


class CurrentCheckpointStorageUsageResponse(BaseModel):
    effective_rate_usd_per_gigabyte_month: float | None = None
    data: list[CurrentCheckpointStorageUsageItem]


# ---------------------------------------------------------------------------------------------- the estimate
class LoopShape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class PassShape(LoopShape):
    """One kind of training pass of each step: its data and the input tokens of each datum (the length of
    its `model_input`, what a pass is metered on)."""

    datums_per_step: int = Field(ge=0, le=1_000_000)
    tokens_per_datum: int = Field(ge=0, le=10_000_000)


class SamplingShape(LoopShape):
    """The sampling of each step: `prompts_per_step` sample requests of `samples_per_prompt` samples each
    (the SDK's `num_samples`)."""

    prompts_per_step: int = Field(ge=0, le=1_000_000)
    samples_per_prompt: int = Field(default=1, ge=1, le=128)
    prompt_tokens: int = Field(ge=0, le=10_000_000)
    """Tokens of each prompt: metered once per request, however many samples it asks for."""
    max_tokens: int = Field(ge=1, le=10_000_000)
    """The `max_tokens` of the sampling parameters: what a sample generates at most."""
    completion_tokens: int | None = Field(default=None, ge=0, le=10_000_000)
    """What a sample is expected to generate (at most `max_tokens`); None: `max_tokens`."""


class TinkerEstimateRequest(LoopShape):
    """A Tinker training loop's shape. Unknown fields are refused (400 naming them), so a misspelt part of
    the loop is not silently left out."""

    base_model: str
    steps: int = Field(ge=1, le=10_000_000)
    forward_backward: PassShape | None = None
    forward: PassShape | None = None
    """Forward-only passes (`forward`), e.g. log-probabilities of a reference; billed as training too."""
    sampling: SamplingShape | None = None


class TinkerTokens(OpenAIBaseModel):
    """Tokens of the whole loop by billing event type; each a range (only sampled tokens can vary)."""

    training: CostRange
    sampling_prefill: CostRange
    sampling_sample: CostRange


class TinkerRates(OpenAIBaseModel):
    """USD per million tokens of each event type, from the organisation's price table."""

    training: float
    sampling_prefill: float
    sampling_sample: float


class TinkerEstimate(OpenAIBaseModel):
    """`POST /v1/tinker/estimate`: what a Tinker loop of this shape would cost."""

    object: Literal["tinker.estimate"] = "tinker.estimate"
    base_model: str
    steps: int
    tokens: TinkerTokens
    rates_usd_per_million_tokens: TinkerRates
    cost: CostRange
    """USD: low with every sample stopping at once, expected at `completion_tokens`, high at `max_tokens`."""
    cost_per_step: CostRange
    currency: Literal["usd"] = "usd"
    budget: BudgetState
    allowed: bool
    """Whether the expected cost fits what the organisation's monthly budget has left."""
    refusal: str | None = None
    assumptions: list[Assumption]

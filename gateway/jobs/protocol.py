"""Fine-tuning job shapes: the create request, the job, its events and checkpoints (OpenAI's shapes)."""

from __future__ import annotations

from functools import cached_property
from typing import Annotated, Any, Literal

from pydantic import Field

from gateway.jobs import guards
from gateway.jobs.method import JobMethod
from gateway.jobs.store import CheckpointRow, EventRow, JobRow
from gateway.jobs.validation import hyperparameters_param, parse_method
from gateway.protocol import OpenAIBaseModel
from gateway.timeutil import ts

MAX_COST_USD = 1e6
"""Largest `max_cost` a create may give (USD): more is a typo, not a limit."""
JOB_STATES = ("validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused")
TERMINAL_STATES = ("succeeded", "failed", "cancelled")


class JobCreate(OpenAIBaseModel):
    """`POST /v1/fine_tuning/jobs`. Field checks beyond types live in `jobs.validation`."""

    model: str
    training_file: str | None = None
    """Required unless `capture` gives the training data."""
    validation_file: str | None = None
    suffix: str | None = None
    seed: int | None = None
    metadata: dict[str, Any] | None = None
    hyperparameters: dict[str, Any] | None = None
    """Legacy: the hyperparameters of a supervised job, or of `method` when it gives none."""
    capture: dict[str, Any] | None = None
    """tunegate: train on captured episodes instead of a file: the selection of `POST /v1/episodes/export`
    (`gateway.capture.protocol.ExportRequest`), exported as a training file when the job is made."""
    method: dict[str, Any] | None = None
    """As the client wrote it; `job_method` is it typed."""
    integrations: list[dict[str, Any]] | None = None
    max_cost: Annotated[float, Field(strict=True, gt=0, le=MAX_COST_USD, allow_inf_nan=False)] | None = None
    """tunegate: the most the job may cost (USD); it pauses, with a checkpoint, once its cost reaches this."""
    guards: Any = None
    """tunegate: overrides of the job's guards (`gateway.jobs.guards.resolve` checks them)."""

    @cached_property
    def job_method(self) -> JobMethod:
        """The typed method (`gateway.jobs.method`); a 400 naming the request's field when it is not one."""
        return parse_method(self.method, self.hyperparameters, captured=self.capture is not None)

    @property
    def hyperparameters_param(self) -> str:
        """Where the request gave the hyperparameters (errors name it)."""
        return hyperparameters_param(self.method, self.job_method.type)


class JobError(OpenAIBaseModel):
    code: str
    message: str
    param: str | None = None


class FineTuningJob(OpenAIBaseModel):
    id: str
    object: Literal["fine_tuning.job"] = "fine_tuning.job"
    created_at: int
    error: JobError | None = None
    fine_tuned_model: str | None = None
    finished_at: int | None = None
    hyperparameters: dict[str, Any]
    model: str
    organization_id: str
    result_files: list[str] = Field(default_factory=list)
    status: str
    trained_tokens: int | None = None
    training_file: str
    validation_file: str | None = None
    seed: int
    estimated_finish: int | None = None
    integrations: list[dict[str, Any]] | None = None
    metadata: dict[str, str] | None = None
    method: dict[str, Any]

    @classmethod
    def from_row(cls, row: JobRow) -> FineTuningJob:
        method = row.method.stored()
        hp = method[row.method.type]["hyperparameters"]
        legacy = {k: hp[k] for k in ("n_epochs", "batch_size", "learning_rate_multiplier") if k in hp}
        job = cls(
            id=row.id,
            created_at=ts(row.created_at) or 0,
            error=JobError(**row.error) if row.error else None,
            fine_tuned_model=row.fine_tuned_model,
            finished_at=ts(row.finished_at),
            hyperparameters=legacy,
            model=row.model,
            organization_id=row.organization_id,
            result_files=row.result_files or [],
            status=row.status,
            trained_tokens=row.trained_tokens,
            training_file=row.training_file,
            validation_file=row.validation_file,
            seed=row.seed,
            estimated_finish=ts(row.estimated_finish),
            integrations=row.integrations,
            metadata=row.metadata,
            method=method,
        )
        if row.max_cost_usd is not None:  # an extension field (extra="allow"), only on jobs that set it
            job.max_cost = row.max_cost_usd  # type: ignore[attr-defined]
        if row.estimated_cost_usd is not None:  # the expected cost estimated when it was queued
            job.estimated_cost = round(row.estimated_cost_usd, 6)  # type: ignore[attr-defined]
        job.guards = guards.resolve(None, row.guards, method=row.method.type)  # type: ignore[attr-defined]
        return job


class CostRange(OpenAIBaseModel):
    """A quantity the estimate can only bound: its least, its expected and its most value."""

    low: float
    expected: float
    high: float


class TokenEstimate(OpenAIBaseModel):
    """Tokens of a job by what they are for (each a `CostRange` of token counts)."""

    trained: CostRange
    """Tokens the trainer trains on (what `trained_tokens` counts, and what is billed per token)."""
    evaluated: CostRange
    """Tokens of the validation file's examples run at evaluations (not billed per token; compute time)."""
    sampled: CostRange
    """Completion tokens generated by reinforcement rollouts (part of `trained` too: GRPO trains on them)."""
    judged: CostRange
    """Tokens of model graders' calls (prompt and answer), billed as chat completions of their model."""


class BudgetState(OpenAIBaseModel):
    monthly_budget_usd: float | None = None
    month_to_date_usd: float
    left_usd: float | None = None
    """What the monthly budget has left (None: the organisation has no budget)."""
    api_key_monthly_spend_limit_usd: float | None = None
    """The calling key's monthly spend limit (None: it has none)."""
    api_key_month_to_date_usd: float | None = None
    """What the calling key spent this month (its completions and its jobs)."""
    api_key_left_usd: float | None = None
    """What the key's spend limit has left (None: it has none)."""


class Assumption(OpenAIBaseModel):
    """One thing the estimate assumed, and the value it assumed."""

    name: str
    value: Any = None
    detail: str


class JobEstimate(OpenAIBaseModel):
    """`POST /v1/fine_tuning/jobs/estimate`: what a job create with the same body would cost."""

    object: Literal["fine_tuning.job.estimate"] = "fine_tuning.job.estimate"
    model: str
    method: str
    hyperparameters: dict[str, Any]
    """As the job would resolve them (every `"auto"` replaced)."""
    steps: int
    examples: int
    """Training examples in the training file."""
    tokens: TokenEstimate
    compute_seconds: CostRange
    cost: CostRange
    """USD, from the price table of the base model (and of the graders' models)."""
    currency: Literal["usd"] = "usd"
    budget: BudgetState
    allowed: bool
    """Whether a create with this body would be let start by the organisation's monthly budget."""
    refusal: str | None = None
    """Why it would not (the create's 429 message)."""
    max_cost: float | None = None
    guards: dict[str, Any] | None = None
    """The job's guards, resolved as the create would resolve them (`gateway.jobs.guards`)."""
    assumptions: list[Assumption]


class JobEvent(OpenAIBaseModel):
    id: str
    object: Literal["fine_tuning.job.event"] = "fine_tuning.job.event"
    created_at: int
    level: str
    message: str
    type: str
    data: dict[str, Any] | None = None

    @classmethod
    def from_row(cls, row: EventRow) -> JobEvent:
        return cls(
            id=row.id,
            created_at=ts(row.created_at) or 0,
            level=row.level,
            message=row.message,
            type=row.type,
            data=row.data,
        )


class JobCheckpoint(OpenAIBaseModel):
    id: str
    object: Literal["fine_tuning.job.checkpoint"] = "fine_tuning.job.checkpoint"
    created_at: int
    fine_tuned_model_checkpoint: str
    fine_tuning_job_id: str
    step_number: int
    metrics: dict[str, Any]

    @classmethod
    def from_row(cls, row: CheckpointRow) -> JobCheckpoint:
        return cls(
            id=row.id,
            created_at=ts(row.created_at) or 0,
            fine_tuned_model_checkpoint=row.fine_tuned_model_checkpoint,
            fine_tuning_job_id=row.job_id,
            step_number=row.step_number,
            metrics=row.metrics or {},
        )

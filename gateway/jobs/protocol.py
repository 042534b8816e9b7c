"""Fine-tuning job shapes: the create request, the job, its events and checkpoints (OpenAI's shapes)."""

from __future__ import annotations

from functools import cached_property
from typing import Any, Literal

from pydantic import Field

from gateway.jobs.method import JobMethod
from gateway.jobs.store import CheckpointRow, EventRow, JobRow
from gateway.jobs.validation import hyperparameters_param, parse_method
from gateway.protocol import OpenAIBaseModel
from gateway.timeutil import ts

JOB_STATES = ("validating_files", "queued", "running", "succeeded", "failed", "cancelled", "paused")
TERMINAL_STATES = ("succeeded", "failed", "cancelled")


class JobCreate(OpenAIBaseModel):
    """`POST /v1/fine_tuning/jobs`. Field checks beyond types live in `jobs.validation`."""

    model: str
    training_file: str
    validation_file: str | None = None
    suffix: str | None = None
    seed: int | None = None
    metadata: dict[str, Any] | None = None
    hyperparameters: dict[str, Any] | None = None
    """Legacy: the hyperparameters of a supervised job, or of `method` when it gives none."""
    method: dict[str, Any] | None = None
    """As the client wrote it; `job_method` is it typed."""
    integrations: list[dict[str, Any]] | None = None

    @cached_property
    def job_method(self) -> JobMethod:
        """The typed method (`gateway.jobs.method`); a 400 naming the request's field when it is not one."""
        return parse_method(self.method, self.hyperparameters)

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
        return cls(
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

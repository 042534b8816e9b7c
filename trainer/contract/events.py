"""The trainer's events: one JSON object per stdout line, emitted by the trainer and parsed by the worker."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter


class _Event(BaseModel):
    model_config = ConfigDict(extra="forbid")


class MessageEvent(_Event):
    """A human-readable milestone (``data``: numbers that go with it)."""

    type: Literal["message"] = "message"
    level: Literal["info", "warn", "error"] = "info"
    message: str
    step: int | None = None
    data: dict[str, Any] | None = None


class MetricsEvent(_Event):
    """The numbers of one step (``train_loss``, ``reward_mean``, ``valid_*``...); step 0: before training."""

    type: Literal["metrics"] = "metrics"
    step: int
    total_steps: int
    data: dict[str, Any]


class CheckpointEvent(_Event):
    """A resumable checkpoint (also loadable as a LoRA adapter) was written."""

    type: Literal["checkpoint"] = "checkpoint"
    step: int
    path: str
    metrics: dict[str, Any]


class ResultEvent(_Event):
    """The job finished; the final adapter is at ``adapter_path``."""

    type: Literal["result"] = "result"
    adapter_path: str
    trained_tokens: int
    steps: int
    metrics: dict[str, Any]


class StoppedEvent(_Event):
    """The job stopped on SIGTERM after saving ``checkpoint``."""

    type: Literal["stopped"] = "stopped"
    step: int
    checkpoint: str | None = None


class ErrorEvent(_Event):
    """The job failed; ``message`` is one line without a traceback."""

    type: Literal["error"] = "error"
    code: str
    message: str


TrainerEvent = Annotated[
    MessageEvent | MetricsEvent | CheckpointEvent | ResultEvent | StoppedEvent | ErrorEvent,
    Field(discriminator="type"),
]
"""One line of the trainer's stdout."""

EVENT = TypeAdapter(TrainerEvent)
"""Parses and dumps :data:`TrainerEvent` objects."""

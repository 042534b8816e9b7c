"""Request and response shapes of the scoring endpoints."""

from __future__ import annotations

from typing import Any

from pydantic import Field, field_validator

from gateway.protocol import OpenAIBaseModel


class GraderRunRequest(OpenAIBaseModel):
    """`POST /v1/fine_tuning/alpha/graders/run`."""

    grader: dict[str, Any]
    """An OpenAI grader (string_check, text_similarity, score_model, label_model, python, multi)."""
    model_sample: str
    """The model output to score (`{{ sample.output_text }}`; `output_json` when it parses as JSON)."""
    item: dict[str, Any] | None = None
    """The dataset row the grader's `{{ item.* }}` templates read."""


class GraderValidateRequest(OpenAIBaseModel):
    """`POST /v1/fine_tuning/alpha/graders/validate`."""

    grader: dict[str, Any]
    """The grader to check."""


class GraderValidateResponse(OpenAIBaseModel):
    """The grader, echoed when it is valid."""

    grader: dict[str, Any]


class EnvironmentRunRequest(OpenAIBaseModel):
    """`POST /v1/fine_tuning/alpha/environments/run`: score a completion, or play an episode, with an
    uploaded environment package."""

    file_id: str
    """A file of purpose `environment` owned by the caller's organisation."""
    task: dict[str, Any]
    """One task row (OpenAI RFT format: `messages` plus the fields the environment reads)."""
    config: dict[str, Any] | None = None
    """Overrides of the package's default config."""
    completion: str | None = None
    """The assistant's reply to score (single-turn), or its first turn (multi-turn: one `step`; a
    `<tool_call>{...}</tool_call>` block in it is a tool call the environment runs)."""
    model: str | None = None
    """Instead of `completion`: a model the caller may chat with (a base model, or a fine-tuned model or
    checkpoint of its organisation), which plays the whole episode through the gateway's chat route."""
    max_turns: int | None = Field(default=None, ge=1, le=64)
    """Turn cap of a played episode (the package's own cap applies too)."""

    @field_validator("task")
    @classmethod
    def _task_is_a_row(cls, task: dict[str, Any]) -> dict[str, Any]:
        """A task is an OpenAI RFT row: `messages` (chat messages, each with a string `role`) or `prompt`."""
        messages = task.get("messages")
        if messages is None and isinstance(task.get("prompt"), str):
            return task
        if not isinstance(messages, list) or not messages:
            raise ValueError("a task needs 'messages' (a non-empty list of messages) or 'prompt' (a string)")
        for i, message in enumerate(messages):
            if not isinstance(message, dict) or not isinstance(message.get("role"), str):
                raise ValueError(f"messages[{i}] must be a chat message: an object with a string 'role'")
        return task


class EnvironmentRunResponse(OpenAIBaseModel):
    """The outcome: `reward` is null when the environment failed (`error` says why)."""

    reward: float | None
    info: dict[str, Any] = Field(default_factory=dict)
    messages: list[dict[str, Any]] | None = None
    error: str | None = None
    turns: int = 0
    stop_reason: str | None = None
    kind: str | None = None

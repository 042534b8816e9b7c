"""Result types that cross the sandbox boundary.

Everything here is a plain dataclass of JSON-friendly values so that it can be sent over the JSON-lines
channel between the caller and the sandboxed environment process. Failures are data: a reward or a step
that raised carries ``error`` (a one-line message) instead of raising in the caller.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

Message = dict[str, Any]
"""One chat message in OpenAI's shape (``role``, ``content``, optional ``tool_calls``/``tool_call_id``)."""


class StopReason(StrEnum):
    """Why an episode ended."""

    DONE = "done"
    """The environment said the episode is over (``done=True``)."""
    MAX_TURNS = "max_turns"
    """The turn budget (``max_turns``) ran out before the environment finished."""
    ERROR = "error"
    """The environment (or the model call) raised; the message is in ``error``."""
    TIMEOUT = "timeout"
    """The sandbox did not answer within its wall-clock limit."""


@dataclass
class StepResult:
    """What a multi-turn environment returns after each assistant message."""

    observation: list[Message] = field(default_factory=list)
    """Messages appended to the conversation before the model's next turn (``user`` or ``tool`` roles)."""
    reward: float = 0.0
    """Reward earned by this step; an episode's reward is the sum over its steps."""
    done: bool = False
    """True when the episode is over."""
    info: dict[str, Any] = field(default_factory=dict)
    """Free-form JSON-serialisable details (logged, never used for training)."""
    error: str | None = None
    """Set when the step raised; the episode then ends with reward 0."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> StepResult:
        return cls(
            observation=list(data.get("observation") or []),
            reward=float(data.get("reward") or 0.0),
            done=bool(data.get("done")),
            info=dict(data.get("info") or {}),
            error=data.get("error"),
        )


@dataclass
class RewardResult:
    """The score of one completion (single-turn), or the error that stopped it from being scored."""

    reward: float | None
    """The reward, or None when the reward function raised."""
    error: str | None = None
    """``"ExceptionType: message"`` when the reward function raised, else None."""

    def to_dict(self) -> dict[str, Any]:
        return {"reward": self.reward, "error": self.error}


@dataclass
class EpisodeResult:
    """A finished episode: the whole conversation and its total reward."""

    messages: list[Message]
    """The conversation: the first observation, then the model's and the environment's turns."""
    reward: float | None
    """Total reward (sum of step rewards, or the single-turn reward); None when the episode errored."""
    turns: int
    """Number of assistant turns played."""
    stop_reason: StopReason
    """Why the episode ended."""
    error: str | None = None
    """The error message when ``stop_reason`` is ``error`` or ``timeout``."""
    info: dict[str, Any] = field(default_factory=dict)
    """The ``info`` of the last step."""

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        data["stop_reason"] = str(self.stop_reason)
        return data


def error_text(exc: BaseException) -> str:
    """One-line description of an exception, safe to send over the channel."""
    detail = str(exc)
    text = f"{type(exc).__name__}: {detail}" if detail else type(exc).__name__
    return text[:2000]

"""Shapes of the episodes API: the requests (`EpisodeCreate`, `RewardCreate`, `Feedback`) and the objects it
answers (`episode`, `episode.reward`, `episode.deleted`), built from `gateway.capture.episodes_store` rows."""

from __future__ import annotations

import math
from typing import Any, Literal

from pydantic import Field, field_validator

from gateway.capture.episodes_store import CallRow, EpisodeRow, RewardRow
from gateway.protocol import OpenAIBaseModel
from gateway.timeutil import ts

MAX_ID_CHARS = 256
ID_PATTERN = r"^[!-.0-~](?:[ -.0-~]*[!-.0-~])?$"
"""A client's episode id: printable ASCII but `/`, no space at either end (it goes in URL paths and in the
`X-Episode-Id` header, which drops such spaces)."""
DEFAULT_IDLE_TIMEOUT_S = 900
MAX_IDLE_TIMEOUT_S = 86_400
DEFAULT_KEY_TTL_S = 86_400
MIN_KEY_TTL_S = 60
MAX_KEY_TTL_S = 604_800
MAX_REWARD_ABS = 1e6
"""Largest |value| of a reward."""
MAX_REWARD_NAME_CHARS = 64
MAX_SOURCE_CHARS = 256
MAX_COMMENT_CHARS = 1024
MAX_UNIX_S = 253_402_300_799
"""The last second of year 9999: the latest time a filter takes (PostgreSQL's timestamps end soon after)."""


# ---- requests ---------------------------------------------------------------------------------------------
class EpisodeCreate(OpenAIBaseModel):
    """`POST /v1/episodes`."""

    id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS, pattern=ID_PATTERN)
    """The client's own id for it (unique in the organisation); else `ep_` and a random one."""
    metadata: dict[str, Any] | None = None
    """OpenAI's `metadata` (checked by `gateway.capture.protocol.check_metadata`)."""
    parent_episode_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    idle_timeout_s: int = Field(default=DEFAULT_IDLE_TIMEOUT_S, ge=1, le=MAX_IDLE_TIMEOUT_S)
    """Without a call for this long, the episode is `abandoned` (or `closed`, see `on_idle`)."""
    on_idle: Literal["abandon", "close"] = "abandon"
    key_ttl_s: int = Field(default=DEFAULT_KEY_TTL_S, ge=MIN_KEY_TTL_S, le=MAX_KEY_TTL_S)
    """How long the episode key works."""


class RewardTarget(OpenAIBaseModel):
    """What a reward is for: the episode, one completion of it, or the sampled tokens `start` (included) to
    `end` (excluded) of one completion. Which fields each type needs is checked by the service, which
    knows the completion."""

    type: Literal["episode", "completion", "span"]
    completion_id: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    start: int | None = Field(default=None, ge=0)
    end: int | None = Field(default=None, ge=1)


class RewardCreate(OpenAIBaseModel):
    """`POST /v1/episodes/{id}/rewards`."""

    name: str = Field(min_length=1, max_length=MAX_REWARD_NAME_CHARS)
    value: float
    """A finite number, |value| at most `MAX_REWARD_ABS` (no string, no boolean)."""
    target: RewardTarget | None = None
    """The episode when not given."""
    source: str | None = Field(default=None, max_length=MAX_SOURCE_CHARS)
    idempotency_key: str | None = Field(default=None, min_length=1, max_length=MAX_ID_CHARS)
    """A second post with the same key in the episode answers the first reward (also the
    `Idempotency-Key` header)."""

    @field_validator("value", mode="before")
    @classmethod
    def _finite_number(cls, value: Any) -> float:
        # pydantic would take "1.5", true and NaN as floats: a reward is a JSON number, finite and bounded.
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise ValueError("expected a number")
        if not math.isfinite(value) or abs(value) > MAX_REWARD_ABS:
            raise ValueError(f"expected a finite number from -{MAX_REWARD_ABS:g} to {MAX_REWARD_ABS:g}")
        return float(value)


class Feedback(OpenAIBaseModel):
    """`POST /v1/chat/completions/{id}/feedback`: thumbs up (1) or down (-1), with an optional comment."""

    thumbs: Literal["up", "down"]
    comment: str | None = Field(default=None, max_length=MAX_COMMENT_CHARS)


# ---- objects ----------------------------------------------------------------------------------------------
class Reward(OpenAIBaseModel):
    id: str
    object: Literal["episode.reward"] = "episode.reward"
    episode_id: str | None
    """None for thumbs on a completion outside any episode."""
    name: str
    value: float
    target: dict[str, Any]
    source: str | None
    idempotency_key: str | None
    comment: str | None = None
    """The comment of thumbs feedback."""
    created_at: int

    @classmethod
    def from_row(cls, row: RewardRow) -> Reward:
        target: dict[str, Any] = {"type": "episode"}
        if row.span_start is not None:
            target = {
                "type": "span",
                "completion_id": row.completion_id,
                "start": row.span_start,
                "end": row.span_end,
            }
        elif row.completion_id is not None:
            target = {"type": "completion", "completion_id": row.completion_id}
        return cls(
            id=row.id,
            episode_id=row.episode_id,
            name=row.name,
            value=row.value,
            target=target,
            source=row.source,
            idempotency_key=row.idempotency_key,
            comment=row.comment,
            created_at=ts(row.created_at) or 0,
        )


class EpisodeCall(OpenAIBaseModel):
    """One call of an episode: where it sits in the episode's token sequence, and how it went."""

    id: str
    created: int
    model: str
    served_version: str
    finish_reason: str | None
    usage: dict[str, Any] | None
    previous_id: str | None
    prompt_prefix_tokens: int
    segment_break: dict[str, Any] | None
    latency_ms: int

    @classmethod
    def from_row(cls, row: CallRow) -> EpisodeCall:
        created = row.created if isinstance(row.created, int) else ts(row.created_at) or 0
        return cls(
            id=row.id,
            created=created,
            model=row.model,
            served_version=row.served_version,
            finish_reason=row.finish_reason,
            usage=row.usage,
            previous_id=row.previous_id,
            prompt_prefix_tokens=row.prompt_prefix_tokens,
            segment_break=row.segment_break,
            latency_ms=row.latency_ms,
        )


class _EpisodeBase(OpenAIBaseModel):
    id: str
    object: Literal["episode"] = "episode"
    created_at: int
    state: Literal["open", "closed", "abandoned"]
    metadata: dict[str, str]
    parent_episode_id: str | None
    idle_timeout_s: int
    on_idle: Literal["abandon", "close"]
    last_call_at: int | None
    closed_at: int | None

    @staticmethod
    def fields_of(row: EpisodeRow) -> dict[str, Any]:
        return {
            "id": row.id,
            "created_at": ts(row.created_at) or 0,
            "state": row.state,
            "metadata": row.metadata,
            "parent_episode_id": row.parent_episode_id,
            "idle_timeout_s": row.idle_timeout_s,
            "on_idle": row.on_idle,
            "last_call_at": ts(row.last_call_at),
            "closed_at": ts(row.closed_at),
        }


class Episode(_EpisodeBase):
    """An episode as listed and as closed: `calls` is how many."""

    calls: int

    @classmethod
    def from_row(cls, row: EpisodeRow) -> Episode:
        return cls(**cls.fields_of(row), calls=row.calls)


class EpisodeCreated(Episode):
    """`POST /v1/episodes`: the episode, and its key (shown this once)."""

    key: str
    key_expires_at: int


class EpisodeDetail(_EpisodeBase):
    """`GET /v1/episodes/{id}`: the episode with its calls, in order, and its rewards."""

    calls: list[EpisodeCall]
    rewards: list[Reward]


class EpisodeDeleted(OpenAIBaseModel):
    id: str
    object: Literal["episode.deleted"] = "episode.deleted"
    deleted: bool = True

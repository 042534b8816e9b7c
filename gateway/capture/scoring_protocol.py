"""Shapes of `POST /v1/episodes/score` (`gateway.capture.scoring`): which episodes (the selection of
`POST /v1/episodes/export`), one scorer (a grader, an environment package, or a judge model that ranks the
episodes of one group together), the reward's name, and what was scored."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.capture.episodes_protocol import MAX_REWARD_NAME_CHARS
from gateway.protocol import OpenAIBaseModel

MAX_SCORE_EPISODES = 200
"""The most episodes one call scores; more matching a filter without a `limit` is a 400."""
MAX_GROUP_EPISODES = 16
"""The most episodes a group judge reads in one prompt."""
MAX_JUDGE_RETRIES = 5


class EnvironmentScorer(OpenAIBaseModel):
    """An uploaded environment package, as a reinforcement job names it: `{"file_id", "config"}`."""

    file_id: str = Field(min_length=1, max_length=256)
    """A file of purpose `environment` of the caller's organisation."""
    config: dict[str, Any] | None = None
    """Overrides of the package's default config."""


class GroupJudge(OpenAIBaseModel):
    """A model that reads the episodes of one group (those sharing the `group_by` metadata value) in one
    prompt and scores each in [0, 1], relative to the others (RULER's way)."""

    model: str = Field(min_length=1, max_length=256)
    """A model the organisation may chat with; its calls are chats of the caller's key, metered and billed."""
    group_by: str = Field(min_length=1, max_length=64)
    """The metadata key whose value makes a group (an episode without it is an error of its own)."""
    rubric: str | None = Field(default=None, max_length=8000)
    """What a good episode does; the judge's prompt states it."""
    method: Literal["answer", "logprobs"] = "answer"
    """`answer`: the judge answers every score at once, as JSON (`response_format` `json_object`), read
    leniently, asked again when it does not parse; `logprobs`: one call per episode, same listing, asked for a
    single digit 0-9 whose probability-weighted mean / 9 is the score (always readable where the model
    returns `top_logprobs`: fit for small judges)."""
    max_retries: int = Field(default=2, ge=0, le=MAX_JUDGE_RETRIES)
    """`answer`: how many more times the judge is asked when its answer does not parse."""
    temperature: float = Field(default=0.0, ge=0.0, le=2.0)
    max_tokens: int = Field(default=512, ge=16, le=4096)
    """`answer`: the judge's answer cap."""


class ScoreRequest(OpenAIBaseModel):
    """`POST /v1/episodes/score`."""

    name: str = Field(min_length=1, max_length=MAX_REWARD_NAME_CHARS)
    """The name of the rewards posted."""
    grader: dict[str, Any] | None = None
    """An OpenAI grader, as `graders/run` takes it: each episode's last answer is `sample.output_text`,
    `item` its metadata with `messages` (the conversation the last call answered) and `episode_id`."""
    environment: EnvironmentScorer | None = None
    """A single-turn environment package: its `reward(task, completion)` of each episode's last answer, the
    task being the episode's metadata with `messages` (its first call's)."""
    group_judge: GroupJudge | None = None
    on_error: Literal["fail", "skip"] = "fail"
    """`fail`: an episode that cannot be scored fails the call (400) and nothing is posted; `skip`: the
    others are posted and the response lists the errors."""
    # The selection of `POST /v1/episodes/export` (`gateway.capture.protocol.ExportRequest`).
    episode_ids: list[str] | None = Field(default=None, max_length=MAX_SCORE_EPISODES)
    metadata: dict[str, str] | None = None
    state: Literal["open", "closed", "abandoned"] | None = None
    model: str | None = None
    created_after: int | None = None
    created_before: int | None = None
    limit: int | None = Field(default=None, ge=1, le=MAX_SCORE_EPISODES)
    """Score the oldest `limit` episodes that match; without it, more than `MAX_SCORE_EPISODES` matching is
    a 400."""


class ScoreError(OpenAIBaseModel):
    code: str
    message: str


class EpisodeScore(OpenAIBaseModel):
    """One episode's outcome: its score and the reward that holds it, or why it has none."""

    object: Literal["episode.score"] = "episode.score"
    episode_id: str
    value: float | None = None
    """The reward's value: the new score, or the one posted before under the same scorer."""
    reward_id: str | None = None
    status: Literal["posted", "already_scored", "error"]
    """`already_scored`: this scorer's reward was posted before (it counts once: `value` is that reward's)."""
    error: ScoreError | None = None


class ScoreCounts(OpenAIBaseModel):
    selected: int = 0
    posted: int = 0
    already_scored: int = 0
    errored: int = 0


class ScoreResponse(OpenAIBaseModel):
    object: Literal["episode.scoring"] = "episode.scoring"
    name: str
    scorer: dict[str, Any]
    """`type` (`grader`, `environment`, `group_judge`), the rewards' `source`, and the `idempotency_key`
    prefix every reward of this scorer and name carries."""
    counts: ScoreCounts
    data: list[EpisodeScore]
    usage: dict[str, int] | None = None
    """A group judge's: its chat calls and their tokens (metered and billed as the organisation's chats)."""

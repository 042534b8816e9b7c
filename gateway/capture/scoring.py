"""Scoring captured episodes on the server (`POST /v1/episodes/score`): old episodes scored again under a new
grader, an environment package's scorer, or a judge model ranking the attempts at one task.

- **Which episodes**: the selection of `POST /v1/episodes/export` (`gateway.capture.export_service`):
  `episode_ids` (another organisation's or unknown ones: 404), or the list's filters, oldest first, at most
  `MAX_SCORE_EPISODES` a call.
- **What is scored**: an episode as its calls left it (`gateway.capture.sequences.rebuild`): its last call's
  conversation and answer, its first call's messages, and its metadata (over that of its first call, as the
  export reads it).
  - `grader`: any grader `graders/run` takes, run by `gateway.evals.grading.grade_item` (the code that
    grades eval items and reinforcement rewards): python graders in the sandbox, model graders through the
    gateway's chat route with the caller's key (`gateway.serving.calls.GatewayModels`). `sample` is the
    last answer; `item` the metadata, with `messages` and `episode_id`.
  - `environment`: a single-turn package (as a reinforcement job names it: `file_id`, `config`), unpacked
    and started once in the sandbox, every episode's last answer sent in one `reward_batch`: its
    `reward(task, completion)`, the task being the metadata with the first call's `messages`.
  - `group_judge`: `gateway.capture.scoring_judge`, one group (`group_by` metadata value) at a time.
- **Rewards**: each score is posted by `gateway.capture.episodes.post_reward` as an episode reward named
  `name`, its `source` naming the scorer (`grader:<type>`, `environment:<file_id>`, `judge:<model>`), its
  idempotency key `score:` and a digest of the name and the scorer. So the same scorer run again counts
  once (an episode it scored already is not scored again: `already_scored`, with the value posted then),
  and a new grader, config, rubric or name adds rewards of its own.
- **Failures**: everything is scored before anything is posted. With `on_error` `fail` (the default) one
  episode that cannot be scored (a grader error, a non-finite score, an environment error, a judge whose
  answer does not parse) fails the call with a 400 naming it, and nothing is posted; with `skip` the others
  are posted and the response lists the errors. A refusal of a model call itself (rate limit, budget) is the
  request's answer, nothing posted.

Size: over 450 lines, and left whole: the three scorers share the selection, the posting and the error
rules above (the judge's prompt and parsing are apart, in `scoring_judge`).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from envsdk.graders import make_sample, model_fields
from gateway.capture import episodes, episodes_store, export_service, store
from gateway.capture.episodes_protocol import MAX_REWARD_ABS, RewardCreate
from gateway.capture.episodes_store import EpisodeRow
from gateway.capture.protocol import ExportRequest
from gateway.capture.scoring_judge import Judge, JudgeFailed, Trajectory
from gateway.capture.scoring_protocol import (
    MAX_GROUP_EPISODES,
    MAX_SCORE_EPISODES,
    EpisodeScore,
    ScoreCounts,
    ScoreError,
    ScoreRequest,
    ScoreResponse,
)
from gateway.capture.sequences import rebuild
from gateway.capture.store import CapturedRow
from gateway.deps import Caller, Resources
from gateway.errors import MAX_MESSAGE_CHARS, InvalidRequest, NotFound, not_found
from gateway.evals.grading import grade_item
from gateway.files import store as files_store
from gateway.graders import packages
from gateway.graders.checks import check_grader
from gateway.serving.calls import GatewayModels, check_models
from gateway.settings import Settings

SCORERS = ("grader", "environment", "group_judge")


@dataclass
class View:
    """An episode as a scorer reads it."""

    id: str
    metadata: dict[str, str]
    first_messages: list[Any]
    """The messages of its first call (the task as the agent was given it)."""
    messages: list[Any]
    """The messages its last call answered."""
    answer: dict[str, Any] | None
    """The last call's assistant message (None: the episode has no call with an answer)."""
    earlier: dict[str, tuple[str, float]] = field(default_factory=dict)
    """Its rewards by idempotency key: `(reward id, value)`."""

    @property
    def answer_text(self) -> str:
        content = (self.answer or {}).get("content")
        if isinstance(content, list):
            return "".join(str(p.get("text")) for p in content if isinstance(p, dict) and "text" in p)
        return content if isinstance(content, str) else ""

    def conversation(self) -> list[Any]:
        return [*self.messages, self.answer] if self.answer is not None else list(self.messages)


Outcome = float | ScoreError


# ---- the request ------------------------------------------------------------------------------------------
def _scorer(body: ScoreRequest) -> str:
    given = [name for name in SCORERS if getattr(body, name) is not None]
    if len(given) != 1:
        raise InvalidRequest(
            "Give exactly one scorer: 'grader', 'environment' or 'group_judge'"
            + (f" (got {', '.join(given)})." if given else "."),
            param=given[1] if len(given) > 1 else "grader",
            code="invalid_scorer",
        )
    return given[0]


def _describe(body: ScoreRequest, kind: str) -> tuple[str, str]:
    """The rewards' source, and the idempotency key of this scorer and name (the same in every episode)."""
    if kind == "grader":
        spec: Any = body.grader
        source = f"grader:{(body.grader or {}).get('type')}"
    elif kind == "environment":
        assert body.environment is not None
        spec = body.environment.model_dump()
        source = f"environment:{body.environment.file_id}"
    else:
        assert body.group_judge is not None
        spec = body.group_judge.model_dump()
        source = f"judge:{body.group_judge.model}"
    canonical = json.dumps({"name": body.name, kind: spec}, sort_keys=True, separators=(",", ":"))
    return source[:256], "score:" + hashlib.sha256(canonical.encode()).hexdigest()[:40]


async def _environment_archive(res: Resources, org_id: str, file_id: str) -> Path:
    row = await files_store.get(res.pool, org_id=org_id, file_id=file_id)
    if row is None:
        raise not_found("file", file_id, param="environment.file_id")
    if row.purpose != "environment":
        raise InvalidRequest(
            f"File '{file_id}' has purpose '{row.purpose}'; expected 'environment'.",
            param="environment.file_id",
            code="invalid_file_purpose",
        )
    return res.blobs.path(row.blob_key)


async def _selected(res: Resources, org_id: str, body: ScoreRequest) -> list[EpisodeRow]:
    limit = body.limit if body.limit is not None else MAX_SCORE_EPISODES + 1
    selection = ExportRequest(
        episode_ids=body.episode_ids,
        metadata=body.metadata,
        state=body.state,
        model=body.model,
        created_after=body.created_after,
        created_before=body.created_before,
        limit=limit,
    )
    found = await export_service._selected_episodes(res, org_id, selection)
    if len(found) > MAX_SCORE_EPISODES:
        raise InvalidRequest(
            f"More than {MAX_SCORE_EPISODES} episodes match; narrow the filters, or set a 'limit' to score "
            "the oldest ones.",
            param="limit",
            code="too_many_episodes",
        )
    return found


def _answer(response: dict[str, Any]) -> dict[str, Any] | None:
    """A call's first choice as an assistant message (a text completion's `text` as its content)."""
    choices = response.get("choices")
    choice = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(choice, dict):
        return None
    message = choice.get("message")
    if isinstance(message, dict):
        return message
    text = choice.get("text")
    return {"role": "assistant", "content": text} if isinstance(text, str) else None


def _messages(row: CapturedRow, turn_messages: list[Any]) -> list[Any]:
    """A call's messages (a text completion's string prompt as one user message)."""
    prompt = row.request.get("prompt")
    if not turn_messages and isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    return turn_messages


async def _view(res: Resources, org_id: str, episode: EpisodeRow) -> View:
    async with res.pool.acquire() as conn:
        records = await store.episode_records(conn, org_id=org_id, episode_id=episode.id)
        rewards = await episodes_store.rewards(
            conn, org_id=org_id, episode_id=episode.id, after=None, limit=None, descending=False
        )
    metadata = {**(records[0].metadata if records else {}), **episode.metadata}
    earlier = {r.idempotency_key: (r.id, r.value) for r in rewards if r.idempotency_key is not None}
    if not records:
        return View(episode.id, metadata, [], [], None, earlier)
    turns = rebuild(records)
    first, last = records[0], records[-1]
    return View(
        episode.id,
        metadata,
        _messages(first, turns[first.id].messages),
        _messages(last, turns[last.id].messages),
        _answer(last.response),
        earlier,
    )


# ---- the scorers ------------------------------------------------------------------------------------------
def _error(code: str, message: str) -> ScoreError:
    return ScoreError(code=code, message=message[:MAX_MESSAGE_CHARS])


def _checked(value: Any) -> Outcome:
    """A score as a reward takes it: a finite number of at most `MAX_REWARD_ABS`."""
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return _error("invalid_score", f"the scorer returned {value!r}, not a finite number")
    if abs(value) > MAX_REWARD_ABS:
        return _error("invalid_score", f"the score {value!r} is beyond ±{MAX_REWARD_ABS:g}")
    return float(value)


def _grade_all(
    settings: Settings, key: str, grader: dict[str, Any], name: str, views: list[View]
) -> list[Outcome]:
    """Each episode's score by `grader` (blocking: a sandbox thread), the model graders' calls through the
    gateway with the caller's key."""
    criterion = {"name": name, **grader}
    out: list[Outcome] = []
    with GatewayModels(settings, key) as models, packages.python_graders(settings) as python:
        inference = models.inference() if model_fields(grader) else None
        for view in views:
            tools = (view.answer or {}).get("tool_calls")
            sample = make_sample(view.answer_text, tools if isinstance(tools, list) else None)
            item = {**view.metadata, "messages": view.messages, "episode_id": view.id}
            results, _ = grade_item(
                [criterion],
                sample,
                item,
                inference=inference,
                python=python,
                max_text_chars=settings.grader_max_text_chars,
            )
            result = results[0]
            if "error" in result:
                out.append(_error(str(result["error"]["code"]), str(result["error"]["message"])))
            else:
                out.append(_checked(result["score"]))
    models.raise_refusal()
    return out


def _environment_all(
    settings: Settings, archive: Path, config: dict[str, Any] | None, views: list[View]
) -> tuple[str, list[Outcome]]:
    """The package's kind, and each episode's `reward(task, last answer)` from one `reward_batch` in its
    sandbox (blocking: a sandbox thread); a package that is not single-turn scores nothing."""
    from envsdk.errors import EnvSDKError, SandboxError
    from envsdk.sandbox import owned_workdir

    with owned_workdir("score") as workdir:  # removed at the next start if this process dies first
        try:
            sandbox = packages.start(settings, archive, workdir, config)
        except EnvSDKError as exc:
            failed = _error("environment_error", f"the environment did not start: {exc.code}: {exc.message}")
            return "", [failed] * len(views)
        try:
            kind = str(sandbox.info.get("kind"))
            if kind != "single_turn":
                return kind, []
            items = [
                {"task": {**v.metadata, "messages": v.first_messages}, "completion": v.answer_text}
                for v in views
            ]
            try:
                results = sandbox.reward_batch(items)
            except SandboxError as exc:
                failed = _error("environment_error", f"{exc.code}: {exc.message}")
                return kind, [failed] * len(views)
        finally:
            sandbox.close()
    out: list[Outcome] = []
    for i in range(len(views)):
        result = results[i] if isinstance(results, list) and i < len(results) else None
        if not isinstance(result, dict):
            out.append(_error("environment_error", "the environment answered no result for this episode"))
        elif result.get("error") is not None or result.get("reward") is None:
            out.append(_error("environment_error", str(result.get("error") or "no reward")))
        else:
            out.append(_checked(result.get("reward")))
    return kind, out


async def _judge_all(
    res: Resources, who: Caller, body: ScoreRequest, views: list[View], key: str
) -> tuple[dict[str, Outcome], dict[str, int]]:
    """Each episode's score by the group judge, one group at a time; the judge's calls and tokens."""
    spec = body.group_judge
    assert spec is not None
    groups: dict[str, list[View]] = defaultdict(list)
    out: dict[str, Outcome] = {}
    for view in views:
        value = view.metadata.get(spec.group_by)
        if value is None:
            out[view.id] = _error("no_group", f"the episode has no metadata '{spec.group_by}' to group it by")
        elif view.answer is None:
            out[view.id] = _error("no_answer", "the episode has no captured answer to judge")
        else:
            groups[value].append(view)
    async with Judge(res.settings.internal_gateway_url(), who.key, spec) as judge:
        for group, members in groups.items():
            if all(key in v.earlier for v in members):
                continue  # every episode of it has this judge's reward already
            if len(members) > MAX_GROUP_EPISODES:
                failed = _error(
                    "group_too_large",
                    f"the group '{group}' has {len(members)} episodes; a judge reads at most "
                    f"{MAX_GROUP_EPISODES} at once (narrow the selection)",
                )
                out |= dict.fromkeys((v.id for v in members), failed)
                continue
            trajectories = [Trajectory(v.id, v.conversation()) for v in members]
            try:
                scores = await judge.score(group, trajectories)
            except JudgeFailed as exc:
                out |= dict.fromkeys((v.id for v in members), _error(exc.code, exc.message))
                continue
            for view, score in zip(members, scores, strict=True):
                out[view.id] = _checked(score)
    usage = judge.usage
    return out, {
        "calls": usage.calls,
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
    }


def _status(earlier: bool) -> Literal["posted", "already_scored"]:
    return "already_scored" if earlier else "posted"


# ---- the route --------------------------------------------------------------------------------------------
async def score(res: Resources, who: Caller, body: ScoreRequest) -> ScoreResponse:
    """Score the selected episodes and post each score as a reward (see the module's docstring)."""
    principal = who.principal
    org_id = principal.organization_id
    kind = _scorer(body)
    archive = None
    if body.grader is not None:
        await check_grader(res, org_id, body.grader, "grader")
        await check_models(res, principal, model_fields(body.grader))
    elif body.environment is not None:
        archive = await _environment_archive(res, org_id, body.environment.file_id)
    elif body.group_judge is not None:
        await check_models(res, principal, [(body.group_judge.model, "group_judge.model")])
    source, key = _describe(body, kind)
    views = [await _view(res, org_id, episode) for episode in await _selected(res, org_id, body)]

    outcomes: dict[str, Outcome] = {}
    usage: dict[str, int] | None = None
    fresh = [v for v in views if key not in v.earlier]
    for view in fresh:
        if view.answer is None and kind != "group_judge":
            outcomes[view.id] = _error("no_answer", "the episode has no captured answer to score")
    todo = [v for v in fresh if v.id not in outcomes]
    if todo and body.grader is not None:
        scored = await res.offload.thread(
            org_id, _grade_all, res.settings, who.key, body.grader, body.name, todo
        )
        outcomes |= dict(zip((v.id for v in todo), scored, strict=True))
    elif todo and body.environment is not None:
        assert archive is not None
        config = body.environment.config
        env_kind, scored = await res.offload.thread(
            org_id, _environment_all, res.settings, archive, config, todo
        )
        if env_kind and env_kind != "single_turn":
            raise InvalidRequest(
                f"Environment '{body.environment.file_id}' is {env_kind}: captured episodes are scored by "
                "single-turn environments' reward(task, completion) only.",
                param="environment.file_id",
                code="unsupported_environment",
            )
        outcomes |= dict(zip((v.id for v in todo), scored, strict=True))
    elif body.group_judge is not None:  # every episode of a group is read, scored before or not
        judged, usage = await _judge_all(res, who, body, views, key)
        outcomes |= judged

    failed = [(v.id, o) for v in views if isinstance(o := outcomes.get(v.id), ScoreError)]
    if failed and body.on_error == "fail":
        episode_id, error = failed[0]
        raise InvalidRequest(
            f"Episode '{episode_id}' could not be scored ({error.code}: {error.message}); "
            f"{len(failed)} of {len(views)} episodes failed and nothing was posted "
            "(on_error 'skip' posts the others).",
            param=kind,
            code=error.code,
        )
    data: list[EpisodeScore] = []
    for view in views:
        outcome = outcomes.get(view.id)
        if isinstance(outcome, ScoreError):
            data.append(EpisodeScore(episode_id=view.id, status="error", error=outcome))
        elif outcome is None:  # scored by this scorer before
            if key in view.earlier:
                reward_id, value = view.earlier[key]
                data.append(
                    EpisodeScore(
                        episode_id=view.id, value=value, reward_id=reward_id, status="already_scored"
                    )
                )
        else:
            reward_body = RewardCreate(name=body.name, value=outcome, source=source, idempotency_key=key)
            try:
                reward = await episodes.post_reward(res, principal, view.id, reward_body, None)
            except NotFound:  # deleted while it was scored
                gone = _error("episode_deleted", "the episode was deleted while it was scored")
                data.append(EpisodeScore(episode_id=view.id, status="error", error=gone))
                continue
            status = _status(key in view.earlier)
            data.append(
                EpisodeScore(episode_id=view.id, value=reward.value, reward_id=reward.id, status=status)
            )
    counts = ScoreCounts(
        selected=len(views),
        posted=sum(d.status == "posted" for d in data),
        already_scored=sum(d.status == "already_scored" for d in data),
        errored=sum(d.status == "error" for d in data),
    )
    described = {"type": kind, "source": source, "idempotency_key": key}
    return ScoreResponse(name=body.name, scorer=described, counts=counts, data=data, usage=usage)

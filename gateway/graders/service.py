"""Scoring: OpenAI graders and uploaded environments, run off the event loop.

* `run_grader` -- `envsdk.graders.grade`: graders that only compute (`string_check`, `text_similarity`)
  in the CPU pool, the others on a sandbox thread (`gateway.offload`): `python` graders run in the sandbox
  (`envsdk.python_grader`), never in the gateway's process; model graders (`score_model`, `label_model`)
  call the gateway's own chat route with the caller's key (`gateway.serving.calls`), never an engine.
  Texts over `grader_max_text_chars` are refused before any scoring.
* `validate` -- `gateway.graders.checks.check_grader`; a bad grader is a 400 whose `param` names the field.
* `run_environment` -- unpacks the caller's environment package (the same caps as its upload check) and
  runs it in the sandbox: scores a literal completion, or plays one episode with a model, whose turns are
  asked of the gateway's chat route with the caller's key too.

So a model a request names must be one the caller may use: it is looked up as the chat route looks it up
before any work (an unknown model and another organisation's answer the same 404 `model_not_found`), and
each of its calls is rate-limited, held to the budget and metered as a chat of the caller; a call the
gateway refuses (429 over a rate limit or the budget) is the request's own answer.

Each run holds one of the organisation's slots (`gateway.offload`): one tenant's calls never take the
threads or the pool that other tenants' requests need.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path
from typing import Any

from envsdk.graders import (
    GraderError,
    check_texts,
    computes_only,
    grade,
    grade_within,
    make_sample,
    model_fields,
    parse_tool_calls,
)
from gateway.deps import Caller, Resources
from gateway.errors import MAX_MESSAGE_CHARS, InvalidRequest, not_found
from gateway.files import store as files_store
from gateway.graders import packages
from gateway.graders.checks import check_grader
from gateway.graders.protocol import (
    EnvironmentRunRequest,
    EnvironmentRunResponse,
    GraderRunRequest,
    GraderValidateResponse,
)
from gateway.serving.calls import GatewayModels, check_models
from gateway.settings import Settings

logger = logging.getLogger(__name__)

POLICY_MAX_TOKENS = 256
"""Tokens per model turn when a served model plays an episode."""


async def validate(res: Resources, org_id: str, grader: dict[str, Any]) -> GraderValidateResponse:
    """The grader back when it is valid; else a 400 naming the field."""
    await check_grader(res, org_id, grader)
    return GraderValidateResponse(grader=grader)


def _grade_sync(settings: Settings, key: str, body: GraderRunRequest) -> dict[str, Any]:
    with GatewayModels(settings, key) as models, packages.python_graders(settings) as python:
        inference = models.inference() if model_fields(body.grader) else None
        sample = make_sample(body.model_sample)
        result = grade(body.grader, sample, body.item or {}, inference=inference, python=python)
    models.raise_refusal()
    return result.to_response()


def _grade_within_sync(settings: Settings, key: str, body: GraderRunRequest) -> dict[str, Any]:
    """`_grade_sync`, once the texts the grader compares are known to be within the cap."""
    check_texts(body.grader, body.model_sample, body.item, max_text_chars=settings.grader_max_text_chars)
    return _grade_sync(settings, key, body)


async def run_grader(res: Resources, who: Caller, body: GraderRunRequest) -> dict[str, Any]:
    """OpenAI's `GraderRunResponse` for one sample."""
    org_id = who.principal.organization_id
    await check_grader(res, org_id, body.grader)
    most = res.settings.grader_max_text_chars
    if len(body.model_sample) > most:
        raise InvalidRequest(
            f"model_sample is {len(body.model_sample)} characters; graders read at most {most}.",
            param="model_sample",
            code="string_above_max_length",
        )
    await check_models(res, who.principal, model_fields(body.grader))
    offload = res.offload
    try:
        if computes_only(body.grader):
            graded = await offload.cpu(org_id, grade_within, body.grader, body.model_sample, body.item, most)
            return graded.to_response()
        return await offload.thread(org_id, _grade_within_sync, res.settings, who.key, body)
    except GraderError as exc:
        raise InvalidRequest(exc.message, param=exc.param, code=exc.code) from None


# -- environments ----------------------------------------------------------------------------------------


def _assistant(completion: str) -> dict[str, Any]:
    calls = parse_tool_calls(completion)
    message: dict[str, Any] = {
        "role": "assistant",
        "content": completion.split("<tool_call>", 1)[0].strip() if calls else completion,
    }
    if calls:
        message["tool_calls"] = [{"id": f"call_{i}", **call} for i, call in enumerate(calls)]
    return message


def _first_turn(sandbox: Any, task: dict[str, Any], completion: str) -> EnvironmentRunResponse:
    """Multi-turn with a literal completion: `reset`, then one `step` answering it."""
    from envsdk.errors import SandboxError
    from envsdk.rollout import reward_of

    try:
        opened = sandbox.reset(task)
        assistant = _assistant(completion)
        step = sandbox.step(opened["episode_id"], assistant)
    except SandboxError as exc:
        return EnvironmentRunResponse(reward=None, error=f"{exc.code}: {exc.message}", stop_reason="error")
    messages = [*opened.get("observation", []), assistant, *(step.get("observation") or [])]
    if not step.get("done"):
        sandbox.call("close_episode", {"episode_id": opened["episode_id"]})
    return EnvironmentRunResponse(
        reward=None if step.get("error") else reward_of(step.get("reward") or 0.0),
        info=step.get("info") or {},
        messages=messages,
        error=step.get("error"),
        turns=1,
        stop_reason="error" if step.get("error") else ("done" if step.get("done") else "first_turn"),
    )


def _run_environment_sync(
    settings: Settings, archive: Path, body: EnvironmentRunRequest, models: GatewayModels
) -> EnvironmentRunResponse:
    from envsdk.errors import EnvSDKError
    from envsdk.rollout import run_episode, run_single_turn
    from envsdk.sandbox import owned_workdir

    with owned_workdir("run") as workdir:  # removed at the next start if this process dies first
        try:
            sandbox = packages.start(settings, archive, workdir, body.config)
        except EnvSDKError as exc:
            error = f"{exc.code}: {exc.message}"
            return EnvironmentRunResponse(reward=None, error=error, stop_reason="error")
        try:
            kind = str(sandbox.info.get("kind"))
            if body.completion is not None:
                if kind == "single_turn":
                    result = run_single_turn(sandbox, body.task, completion=body.completion)
                else:
                    return _first_turn(sandbox, body.task, body.completion).model_copy(update={"kind": kind})
            else:
                policy = models.policy(str(body.model), max_tokens=POLICY_MAX_TOKENS)
                if kind == "single_turn":
                    result = run_single_turn(sandbox, body.task, policy)
                else:
                    turns = min(body.max_turns or sandbox.limits.max_turns, sandbox.limits.max_turns)
                    result = run_episode(sandbox, body.task, policy, max_turns=turns)
        finally:
            sandbox.close()
    data = result.to_dict()
    return EnvironmentRunResponse(
        reward=data["reward"],
        info=data.get("info") or {},
        messages=data["messages"],
        error=data.get("error"),
        turns=data["turns"],
        stop_reason=data["stop_reason"],
        kind=kind,
    )


def _run_environment_checked(
    settings: Settings, archive: Path, body: EnvironmentRunRequest, key: str
) -> EnvironmentRunResponse:
    """`_run_environment_sync`, with a malformed answer from the package (untrusted code: a reward that is
    not a number, an episode without an id, messages that are not messages) as an error result of the run,
    never a failure of the request; a model turn the gateway refused is the request's answer."""
    with GatewayModels(settings, key) as models:
        try:
            result = _run_environment_sync(settings, archive, body, models)
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            logger.info("environment %s answered with something malformed", body.file_id, exc_info=True)
            error = f"protocol_error: the environment's answer is malformed ({type(exc).__name__}: {exc})"
            result = EnvironmentRunResponse(reward=None, error=error[:MAX_MESSAGE_CHARS], stop_reason="error")
        except Exception as exc:  # a single-turn episode's model call that failed ends up here
            import openai

            models.raise_refusal()
            if not isinstance(exc, openai.APIError):
                raise
            error = f"policy failed: {type(exc).__name__}: {exc}"
            result = EnvironmentRunResponse(reward=None, error=error[:MAX_MESSAGE_CHARS], stop_reason="error")
    models.raise_refusal()
    return result


async def run_environment(res: Resources, who: Caller, body: EnvironmentRunRequest) -> EnvironmentRunResponse:
    """Score `completion` (or let `model` play) with the caller's environment package."""
    org_id = who.principal.organization_id
    res.offload.admit(org_id)
    row = await files_store.get(res.pool, org_id=org_id, file_id=body.file_id)
    if row is None:
        raise not_found("file", body.file_id, param="file_id")
    if row.purpose != "environment":
        raise InvalidRequest(
            f"File '{body.file_id}' has purpose '{row.purpose}'; expected 'environment'.",
            param="file_id",
            code="invalid_file_purpose",
        )
    if (body.completion is None) == (body.model is None):
        raise InvalidRequest("Give exactly one of 'completion' or 'model'.", param="completion")
    if body.model is not None:
        await check_models(res, who.principal, [(body.model, "model")])
    archive = res.blobs.path(row.blob_key)
    run = functools.partial(_run_environment_checked, res.settings, archive, body, who.key)
    return await res.offload.thread(org_id, run)

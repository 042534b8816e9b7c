"""Scoring: OpenAI graders and uploaded environments, run off the event loop.

* `run_grader` -- `envsdk.graders.grade`: graders that only compute (`string_check`, `text_similarity`)
  in the CPU pool; the others on a sandbox thread (`gateway.offload`): model graders (`score_model`,
  `label_model`) call the engine that serves the named base model (`settings.base_models[...].upstreams`),
  `python` graders run in the sandbox (`envsdk.python_grader`), never in the gateway's process. Texts over
  `grader_max_text_chars` are refused before any scoring.
* `validate` -- `gateway.graders.checks.check_grader`; a bad grader is a 400 whose `param` names the field.
* `run_environment` -- unpacks the caller's environment package (the same caps as its upload check) and
  runs it in the sandbox: scores a literal completion, or plays one episode against a served base model.

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
    parse_tool_calls,
)
from gateway.deps import Resources
from gateway.errors import MAX_MESSAGE_CHARS, InvalidRequest, not_found
from gateway.files import store as files_store
from gateway.graders.checks import check_grader
from gateway.graders.protocol import (
    EnvironmentRunRequest,
    EnvironmentRunResponse,
    GraderRunRequest,
    GraderValidateResponse,
)
from gateway.offload import offload_of
from gateway.settings import Settings

logger = logging.getLogger(__name__)

POLICY_MAX_TOKENS = 256
"""Tokens per model turn when a served model plays an episode."""


async def validate(res: Resources, org_id: str, grader: dict[str, Any]) -> GraderValidateResponse:
    """The grader back when it is valid; else a 400 naming the field."""
    await check_grader(res, org_id, grader)
    return GraderValidateResponse(grader=grader)


def _models(grader: dict[str, Any]) -> list[str]:
    subs = grader.get("graders")
    values = subs.values() if isinstance(subs, dict) else subs if isinstance(subs, list) else []
    names = [str(grader["model"])] if isinstance(grader.get("model"), str) else []
    return names + [m for s in values if isinstance(s, dict) for m in _models(s)]


def _upstream(settings: Settings, model: str | None) -> str | None:
    """The first engine serving ``model`` (a base model); else the first engine of any base model."""
    if model in settings.base_models and settings.base_models[model].upstreams:
        return settings.base_models[model].upstreams[0].rstrip("/")
    return next((m.upstreams[0].rstrip("/") for m in settings.base_models.values() if m.upstreams), None)


def _grade_sync(settings: Settings, body: GraderRunRequest) -> dict[str, Any]:
    from envsdk.inference_client import InferenceClient
    from envsdk.python_grader import PythonGraders

    models = _models(body.grader)
    upstream = _upstream(settings, models[0]) if models else None
    inference = InferenceClient(f"{upstream}/v1") if upstream else None
    try:
        with PythonGraders(
            allow_unsandboxed=settings.allow_unsandboxed_environments, maxima=settings.sandbox_maxima()
        ) as python:
            sample = make_sample(body.model_sample)
            result = grade(body.grader, sample, body.item or {}, inference=inference, python=python)
    finally:
        if inference is not None:
            inference.close()
    return result.to_response()


def _grade_within_sync(settings: Settings, body: GraderRunRequest) -> dict[str, Any]:
    """`_grade_sync`, once the texts the grader compares are known to be within the cap."""
    check_texts(body.grader, body.model_sample, body.item, max_text_chars=settings.grader_max_text_chars)
    return _grade_sync(settings, body)


async def run_grader(res: Resources, org_id: str, body: GraderRunRequest) -> dict[str, Any]:
    """OpenAI's `GraderRunResponse` for one sample."""
    await check_grader(res, org_id, body.grader)
    most = res.settings.grader_max_text_chars
    if len(body.model_sample) > most:
        raise InvalidRequest(
            f"model_sample is {len(body.model_sample)} characters; graders read at most {most}.",
            param="model_sample",
            code="string_above_max_length",
        )
    offload = offload_of(res)
    try:
        if computes_only(body.grader):
            graded = await offload.cpu(org_id, grade_within, body.grader, body.model_sample, body.item, most)
            return graded.to_response()
        return await offload.thread(org_id, _grade_within_sync, res.settings, body)
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
    settings: Settings, archive: Path, body: EnvironmentRunRequest, upstream: str | None
) -> EnvironmentRunResponse:
    from envsdk.archive import safe_extract
    from envsdk.errors import EnvSDKError
    from envsdk.rollout import openai_policy, run_episode, run_single_turn
    from envsdk.sandbox import Sandbox, owned_workdir

    with owned_workdir("run") as workdir:  # removed at the next start if this process dies first
        workdir.chmod(0o755)
        package = workdir / "package"
        try:
            safe_extract(
                archive,
                package,
                max_entries=settings.environment_max_entries,
                max_total_bytes=settings.environment_max_unpacked_bytes,
                max_ratio=settings.environment_max_ratio,
            )
            sandbox = Sandbox(
                package,
                config=body.config,
                maxima=settings.sandbox_maxima(),
                allow_unsandboxed=settings.allow_unsandboxed_environments,
            )
            sandbox.start()
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
                import openai

                client = openai.OpenAI(base_url=f"{upstream}/v1", api_key="tunegate", max_retries=0)
                policy = openai_policy(client, str(body.model), max_tokens=POLICY_MAX_TOKENS)
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
    settings: Settings, archive: Path, body: EnvironmentRunRequest, upstream: str | None
) -> EnvironmentRunResponse:
    """`_run_environment_sync`, with a malformed answer from the package (untrusted code: a reward that is
    not a number, an episode without an id, messages that are not messages) as an error result of the run,
    never a failure of the request."""
    try:
        return _run_environment_sync(settings, archive, body, upstream)
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        logger.info("environment %s answered with something malformed", body.file_id, exc_info=True)
        error = f"protocol_error: the environment's answer is malformed ({type(exc).__name__}: {exc})"
        return EnvironmentRunResponse(reward=None, error=error[:MAX_MESSAGE_CHARS], stop_reason="error")


async def run_environment(res: Resources, org_id: str, body: EnvironmentRunRequest) -> EnvironmentRunResponse:
    """Score `completion` (or let `model` play) with the caller's environment package."""
    offload_of(res).admit(org_id)
    row = await files_store.get(res.pool, org_id=org_id, file_id=body.file_id)
    if row is None:
        raise not_found("file", body.file_id, param="file_id")
    if row["purpose"] != "environment":
        raise InvalidRequest(
            f"File '{body.file_id}' has purpose '{row['purpose']}'; expected 'environment'.",
            param="file_id",
            code="invalid_file_purpose",
        )
    if (body.completion is None) == (body.model is None):
        raise InvalidRequest("Give exactly one of 'completion' or 'model'.", param="completion")
    upstream = None
    if body.model is not None:
        upstream = _upstream(res.settings, body.model)
        if body.model not in res.settings.base_models or upstream is None:
            raise InvalidRequest(
                f"Model '{body.model}' is not a base model served by this gateway.", param="model"
            )
    archive = res.blobs.path(row["blob_key"])
    run = functools.partial(_run_environment_checked, res.settings, archive, body, upstream)
    return await offload_of(res).thread(org_id, run)

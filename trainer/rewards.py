"""Reward functions for GRPO: an OpenAI grader wrapped in TRL's reward-function signature, and the
environment package's reward (``trainer.environment``).

TRL calls ``reward(prompts, completions, completion_ids, trainer_state, log_extra, log_metric,
**dataset_columns) -> list[float]``. Each completion becomes a grader ``sample`` and its dataset row (the
original JSON row, kept in ``ITEM_COLUMN``) the grader's ``item``. Grading failures score 0 and are counted
in the ``grader_error_rate`` metric, so a broken template shows up in the job's events instead of silently
flattening the rewards. ``python`` graders run in the sandbox (``envsdk.python_grader``), one process per
grader source for the whole job. Model graders call ``spec.inference_base_url``: under tunegate the gateway's
own chat route, with a key the worker minted for the job's organisation (``INFERENCE_KEY_ENV``), so each call
is checked, limited, held to the budget and metered like the organisation's own requests.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from envsdk.graders import GraderError, GradeResult, grade, make_sample, model_fields, validate_grader
from envsdk.inference_client import InferenceClient
from envsdk.manifest import Maxima
from envsdk.python_grader import PythonGraders
from trainer.contract import INFERENCE_KEY_ENV, TrainerSpec
from trainer.data import ITEM_COLUMN
from trainer.errors import TrainerError

if TYPE_CHECKING:
    from trainer.environment import EnvironmentSession

logger = logging.getLogger(__name__)

RewardFunc = Callable[..., list[float | None]]


def completion_sample(completion: Any) -> dict[str, Any]:
    """A grader ``sample`` from one TRL completion (a list of messages, or text)."""
    if isinstance(completion, str):
        return make_sample(completion)
    messages = completion if isinstance(completion, list) else [completion]
    text = "".join(str(m.get("content") or "") for m in messages if isinstance(m, dict))
    tools = [tc for m in messages if isinstance(m, dict) for tc in (m.get("tool_calls") or [])]
    sample = make_sample(text)
    if tools:
        sample["output_tools"] = [
            {"type": "function", "function": tc.get("function", tc)} if isinstance(tc, dict) else tc
            for tc in tools
        ]
    return sample


def inference_api_key(spec: TrainerSpec) -> str | None:
    """The key model graders call ``inference_base_url`` with: ``INFERENCE_KEY_ENV`` when set (the worker
    passes the job's key that way, so it is in no file), else the spec's ``inference_api_key``."""
    return os.environ.get(INFERENCE_KEY_ENV) or spec.inference_api_key


def grader_reward_name(grader: dict[str, Any]) -> str:
    """The name TRL logs this reward under (``rewards/<name>/mean``)."""
    name = str(grader.get("name") or grader.get("type") or "grader")
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", name) or "grader"


def build_grader_reward(spec: TrainerSpec) -> RewardFunc:
    """Check ``spec.grader`` and wrap it as a TRL reward function."""
    grader = spec.grader
    if grader is None:
        raise TrainerError("invalid_spec", "reinforcement with a grader needs spec.grader")
    try:
        validate_grader(grader)
    except GraderError as exc:
        where = f" ({exc.param})" if exc.param else ""
        raise TrainerError("grader_error", f"invalid grader{where}: {exc.message}") from None
    inference: InferenceClient | None = None
    if model_fields(grader):
        if not spec.inference_base_url:
            raise TrainerError("grader_error", "model graders need inference_base_url in the spec")
        inference = InferenceClient(spec.inference_base_url, inference_api_key(spec))
    pool = ThreadPoolExecutor(max_workers=8, thread_name_prefix="grader") if inference else None
    python = PythonGraders(
        allow_unsandboxed=spec.allow_unsandboxed, maxima=Maxima.from_dict(spec.sandbox_maxima)
    )
    atexit.register(python.close)  # stops the python graders' sandboxes and deletes their folders

    def reward(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
        items_json = kwargs.get(ITEM_COLUMN) or ["{}"] * len(completions)
        items = [json.loads(x) if isinstance(x, str) else dict(x or {}) for x in items_json]
        samples = [completion_sample(c) for c in completions]

        def one(i: int) -> GradeResult:
            return grade(grader, samples[i], items[i], inference=inference, python=python)

        results = list(pool.map(one, range(len(samples)))) if pool else [one(i) for i in range(len(samples))]
        failed = [r for r in results if r.failed]
        if failed:
            logger.warning(
                "%d of %d samples failed grading, e.g. %s", len(failed), len(results), failed[0].details
            )
        log_metric = kwargs.get("log_metric")
        if callable(log_metric):
            log_metric("grader_error_rate", len(failed) / max(len(results), 1))
        return [r.reward for r in results]

    reward.__name__ = grader_reward_name(grader)
    return reward


def build_reward_funcs(spec: TrainerSpec, session: EnvironmentSession | None = None) -> list[RewardFunc]:
    """All reward functions of a reinforcement job (the environment's first, then the grader).

    ``session`` is the job's running environment (required when ``spec.environment`` is set).
    """
    funcs: list[RewardFunc] = []
    if spec.environment is not None:
        if session is None:
            raise TrainerError("invalid_spec", "an environment job needs its environment session")
        funcs.append(session.episode_reward_func() if session.multi_turn else session.reward_func())
    if spec.grader is not None:
        funcs.append(build_grader_reward(spec))
    return funcs

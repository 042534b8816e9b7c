"""Checks of a job create: the method and its hyperparameters, and the training rows per method.

Hyperparameters are the training contract's own models (`trainer.contract`): their ranges, their defaults and
how `"auto"` is resolved are defined there once. `"auto"` is resolved here, from the training and validation
files' sizes and the base model's measured defaults, so the job object shows the values training will use.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from envsdk.graders import GraderError, validate_grader
from gateway.errors import InvalidRequest, validation_failure, validation_text
from gateway.files.validation import read_rows
from gateway.jobs.method import METHOD, EnvironmentRef, JobMethod
from trainer.contract import (
    METHODS,
    REQUEST,
    AnyHyperparameters,
    DataSummary,
    model_defaults,
    resolve,
)

_SUFFIX = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


def hyperparameters_param(method: dict[str, Any] | None, kind: str) -> str:
    """Where the request gave the hyperparameters: `method.<type>.hyperparameters`, or the legacy top-level
    `hyperparameters` when it gave no method (errors name the field where the client wrote it)."""
    return "hyperparameters" if method is None else f"method.{kind}.hyperparameters"


def check_servable_rank(hyperparameters: BaseModel, param: str, max_rank: int) -> None:
    """A job trains only an adapter its model can be served with: a `lora_r` above the engines' largest rank
    (`engine_max_lora_rank`) is refused at create, not after training, when serving would refuse it."""
    rank = getattr(hyperparameters, "lora_r", None)
    if isinstance(rank, int):
        refuse_unservable_rank(rank, max_rank, field="lora_r", param=f"{param}.lora_r")


def refuse_unservable_rank(rank: int, max_rank: int, *, field: str, param: str) -> None:
    """400 for a LoRA rank above `max_rank` (`engine_max_lora_rank`), the request's `field` at `param`: a job
    or a Tinker model would train an adapter that serving refuses (`adapter_rank_too_large`)."""
    if rank > max_rank:
        raise InvalidRequest(
            f"A {field} of {rank} is above the largest adapter rank this server serves ({max_rank}): "
            f"the fine-tuned model could not be used. Choose a {field} of at most that.",
            param=param,
            code="invalid_value",
        )


def check_suffix(suffix: str | None) -> None:
    if suffix is not None and not _SUFFIX.match(suffix):
        raise InvalidRequest(
            "suffix must be 1 to 64 characters of letters, digits, '.', '_' or '-'.", param="suffix"
        )


def check_metadata(metadata: dict[str, Any] | None) -> None:
    if metadata is None:
        return
    if len(metadata) > 16:
        raise InvalidRequest("metadata may have at most 16 keys.", param="metadata")
    for k, v in metadata.items():
        if len(k) > 64:
            raise InvalidRequest(
                f"metadata key '{k[:20]}...' is longer than 64 characters.", param="metadata"
            )
        if not isinstance(v, str) or len(v) > 512:
            raise InvalidRequest(
                f"metadata['{k}'] must be a string of at most 512 characters.", param="metadata"
            )


def _hyperparameter_error(exc: ValidationError, kind: str, param: str) -> InvalidRequest:
    """The first problem of a hyperparameters object, with `param` naming the field."""
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else ""
    where = f"{param}.{name}" if name else param
    if error["type"] == "extra_forbidden":
        return InvalidRequest(f"Unknown hyperparameter '{name}' for method '{kind}'.", param=where)
    if error["type"] == "model_type":
        return InvalidRequest("hyperparameters must be an object.", param=param)
    # A union with "auto" reports each branch; the number's own complaint is the one that helps.
    message = error["msg"].removeprefix("Value error, ")
    return InvalidRequest(f"{name}: {message} (or 'auto').", param=where)


def check_hyperparameters(kind: str, given: Any, param: str) -> BaseModel:
    """`given` checked against `kind`'s hyperparameter model (unknown names and NaN refused)."""
    try:
        return REQUEST[kind].model_validate(given if given is not None else {})
    except ValidationError as exc:
        raise _hyperparameter_error(exc, kind, param) from None


def check_grader(grader: Any, param: str) -> None:
    """The grader's shape checked by the same code that will run it (sub-graders of `multi` too). Python
    sources are not parsed here: the services check sizes and parse them off the event loop afterwards
    (`gateway.graders.checks.check_grader`)."""
    try:
        validate_grader(grader, param=param, parse_sources=False)
    except GraderError as exc:
        raise InvalidRequest(exc.message, param=exc.param or param, code=exc.code) from None


def parse_method(
    method: dict[str, Any] | None, legacy: dict[str, Any] | None, *, captured: bool = False
) -> JobMethod:
    """The typed method of a create (legacy top-level `hyperparameters` mean supervised), each problem a 400
    naming the request's field. The hyperparameters are all set (those not given `"auto"`), as stored.
    `captured`: the job trains on captured episodes, whose rewards are posted already: a reinforcement
    method then takes neither a grader nor an environment."""
    if method is None:
        hp = check_hyperparameters("supervised", legacy or {}, "hyperparameters")
        return METHOD.validate_python({"type": "supervised", "supervised": {"hyperparameters": _all_set(hp)}})
    if not isinstance(method, dict):
        raise InvalidRequest("method must be an object.", param="method")
    kind = method.get("type")
    if kind not in METHODS:
        raise InvalidRequest("method.type must be supervised, dpo or reinforcement.", param="method.type")
    body = method.get(kind) or {}
    if not isinstance(body, dict):
        raise InvalidRequest(f"method.{kind} must be an object.", param=f"method.{kind}")
    hp = check_hyperparameters(
        kind, body.get("hyperparameters") or legacy or {}, f"method.{kind}.hyperparameters"
    )
    typed: dict[str, Any] = {"hyperparameters": _all_set(hp)}
    if kind == "reinforcement" and captured:
        if body.get("grader") is not None or body.get("environment") is not None:
            raise InvalidRequest(
                "A reinforcement job from captured episodes trains on the rewards already posted for them: "
                "give no grader or environment.",
                param="method.reinforcement.grader"
                if body.get("grader") is not None
                else "method.reinforcement.environment",
            )
    elif kind == "reinforcement":
        grader, env = body.get("grader"), body.get("environment")
        if (grader is None) == (env is None):
            raise InvalidRequest(
                "A reinforcement method needs exactly one of 'grader' or 'environment'.",
                param="method.reinforcement.grader",
            )
        if grader is not None:
            check_grader(grader, "method.reinforcement.grader")
            typed["grader"] = grader
        else:
            typed["environment"] = _environment(env)
    return METHOD.validate_python({"type": kind, kind: typed})


def _all_set(hyperparameters: BaseModel) -> BaseModel:
    """The hyperparameters with every field set (`"auto"` where not given): stored and shown whole."""
    return type(hyperparameters).model_validate(hyperparameters.model_dump())


def _environment(env: Any) -> EnvironmentRef:
    if not isinstance(env, dict) or not isinstance(env.get("file_id"), str):
        raise InvalidRequest(
            "environment must be {'file_id': <file of purpose environment>, 'config': {...}}.",
            param="method.reinforcement.environment.file_id",
        )
    if not isinstance(env.get("config", {}), dict):
        raise InvalidRequest(
            "environment.config must be an object.", param="method.reinforcement.environment.config"
        )
    return EnvironmentRef(file_id=env["file_id"], config=env.get("config", {}))


# ---- training rows --------------------------------------------------------------------------------


class RowError(Exception):
    """A training row that does not fit its method's format."""

    def __init__(self, line: int, message: str) -> None:
        super().__init__(f"Line {line}: {message}")
        self.line = line


def _check_messages(messages: Any, line: int, where: str) -> list[dict[str, Any]]:
    if not isinstance(messages, list) or not messages:
        raise RowError(line, f"'{where}' must be a non-empty list of messages.")
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or m.get("role") not in _ROLES:
            raise RowError(line, f"{where}[{i}] must be a message with a role among {sorted(_ROLES)}.")
        content = m.get("content")
        if content is not None and not isinstance(content, str | list):
            raise RowError(line, f"{where}[{i}].content must be a string, a list of parts or null.")
        if content is None and not m.get("tool_calls") and m.get("role") != "assistant":
            raise RowError(line, f"{where}[{i}] has no content.")
    return messages


def _check_token_row(row: dict[str, Any], line: int) -> int:
    """A supervised row of token ids (`input_ids`, `completion_mask`: what a capture export writes); returns
    a rough size in characters (4 a token)."""
    ids, mask = row.get("input_ids"), row.get("completion_mask")
    if not isinstance(ids, list) or len(ids) < 2 or not all(type(i) is int and i >= 0 for i in ids):
        raise RowError(line, "'input_ids' must be a list of at least 2 token ids (non-negative integers).")
    if not isinstance(mask, list) or len(mask) != len(ids) or any(m not in (0, 1) for m in mask):
        raise RowError(line, "'completion_mask' must be a list of 0 and 1, one for each of 'input_ids'.")
    if not any(mask[1:]):
        raise RowError(line, "'completion_mask' marks no token to train on (after the first).")
    return 4 * len(ids)


def _ids(value: Any, line: int, name: str, least: int = 1) -> list[int]:
    if not isinstance(value, list) or len(value) < least or not all(type(i) is int and i >= 0 for i in value):
        raise RowError(
            line, f"'{name}' must be a list of at least {least} token ids (non-negative integers)."
        )
    return value


def _mask(value: Any, ids: list[int], line: int, name: str, of: str) -> list[int]:
    if not isinstance(value, list) or len(value) != len(ids) or any(m not in (0, 1) for m in value):
        raise RowError(line, f"'{name}' must be a list of 0 and 1, one for each of '{of}'.")
    return value


def _check_pair_row(row: dict[str, Any], line: int) -> int:
    """A preference pair of token ids (`prompt_ids`, `chosen_ids`, `rejected_ids` and their masks: what a
    dpo job from captured episodes trains on)."""
    prompt = _ids(row.get("prompt_ids"), line, "prompt_ids")
    size = len(prompt)
    for side in ("chosen", "rejected"):
        ids = _ids(row.get(f"{side}_ids"), line, f"{side}_ids")
        mask = row.get(f"{side}_mask", [1] * len(ids))
        if not any(_mask(mask, ids, line, f"{side}_mask", f"{side}_ids")):
            raise RowError(line, f"'{side}_mask' marks no token to train on.")
        size += len(ids)
    return 4 * size


def _check_episode_row(row: dict[str, Any], line: int) -> int:
    """A logged episode's sample (a capture export's, with the sampler's `logprobs` and the sample's
    `advantage`): what a reinforcement job from captured episodes trains on offline."""
    size = _check_token_row(row, line)
    logprobs = row.get("logprobs")
    if not isinstance(logprobs, list) or len(logprobs) != len(row["input_ids"]):
        raise RowError(
            line, "'logprobs' must be a list of the sampler's logprobs, one for each of 'input_ids'."
        )
    for lp in logprobs:
        if lp is not None and (
            isinstance(lp, bool) or not isinstance(lp, int | float) or not math.isfinite(lp) or lp > 0
        ):
            raise RowError(line, "'logprobs' holds a value that is not a log-probability (a number <= 0).")
    if not any(lp is not None for lp, m in zip(logprobs, row["completion_mask"], strict=True) if m):
        raise RowError(line, "'logprobs' holds no logprob of a sampled token.")
    advantage = row.get("advantage")
    if isinstance(advantage, bool) or not isinstance(advantage, int | float) or not math.isfinite(advantage):
        raise RowError(line, "'advantage' must be a finite number.")
    return size


def check_row(kind: str, row: dict[str, Any], line: int) -> int:
    """Check one row against its method's format; returns a rough size in characters (for estimates)."""
    if kind == "supervised" and "input_ids" in row:
        return _check_token_row(row, line)
    if kind == "dpo" and "prompt_ids" in row:
        return _check_pair_row(row, line)
    if kind == "reinforcement" and "input_ids" in row:
        return _check_episode_row(row, line)
    if kind == "supervised":
        msgs = _check_messages(row.get("messages"), line, "messages")
        if not any(m["role"] == "assistant" for m in msgs):
            raise RowError(line, "a supervised example needs at least one assistant message.")
    elif kind == "dpo":
        inp = row.get("input")
        if not isinstance(inp, dict):
            raise RowError(line, "a DPO example needs 'input': {'messages': [...]}.")
        msgs = _check_messages(inp.get("messages"), line, "input.messages")
        for key in ("preferred_output", "non_preferred_output"):
            out = _check_messages(row.get(key), line, key)
            if out[-1]["role"] != "assistant":
                raise RowError(line, f"'{key}' must end with an assistant message.")
            msgs = msgs + out
    else:
        msgs = _check_messages(row.get("messages"), line, "messages")
        if msgs[-1]["role"] != "user":
            raise RowError(line, "a reinforcement example's messages must end with a user message.")
    return sum(len(str(m.get("content") or "")) for m in msgs)


@dataclass
class DatasetSummary:
    rows: int
    chars: int


def check_training_file(path: Path, kind: str, *, max_line_bytes: int) -> DatasetSummary:
    """Every row of a training file against the method's format (run in a thread)."""
    rows = chars = 0
    tokens = None
    for line, row in read_rows(path, max_line_bytes=max_line_bytes):
        chars += check_row(kind, row, line)
        rows += 1
        of_ids = "input_ids" in row or "prompt_ids" in row
        if tokens is None:
            tokens = of_ids
        elif tokens != of_ids:
            raise RowError(line, "rows of token ids ('input_ids') and rows of messages cannot share a file.")
    if rows == 0:
        raise RowError(1, "the file has no examples.")
    return DatasetSummary(rows, chars)


DERIVED_FROM = {"learning_rate": "learning_rate_multiplier", "learning_rate_multiplier": "learning_rate"}
"""Hyperparameters that `"auto"` computes from another one the request gives: a resolved value out of its
range is the given one's fault, and the error names that one."""


def _resolved_error(exc: ValidationError, method: JobMethod, prefix: str) -> InvalidRequest:
    """The 400 for a resolved value its model refuses. `param` names the field the client can change: the
    one it gave, when the refused value was computed from it (a `learning_rate_multiplier` so large that
    the learning rate it gives passes 1)."""
    error = exc.errors()[0]
    name = str(error["loc"][0]) if error["loc"] else ""
    given = method.hyperparameters.model_dump()
    source = DERIVED_FROM.get(name)
    if source is not None and given.get(name) == "auto" and isinstance(given.get(source), int | float):
        value, resolved = float(given[source]), float(error["input"])
        rule = validation_text(str(error["msg"])).removeprefix("input ")  # "should be less than ..."
        return InvalidRequest(
            f"A {source} of {value:g} gives this model a {name} of {resolved:g}, which {rule}.",
            param=f"{prefix}.{source}",
            code="invalid_value",
        )
    return validation_failure(exc.errors(), root=prefix)


def resolve_hyperparameters(
    method: JobMethod,
    param: str,
    summary: DatasetSummary,
    validation: DatasetSummary | None,
    model_path: Path,
) -> AnyHyperparameters:
    """Every `"auto"` replaced by the number training will use (`trainer.contract.resolve`); `param`: where
    the request gave the hyperparameters (`hyperparameters_param`)."""
    data = DataSummary(rows=summary.rows, validation_rows=validation.rows if validation else None)
    try:
        return resolve(method.type, method.hyperparameters, data, model_defaults(model_path))
    except ValidationError as exc:  # a resolved value out of its range (a ValueError too: caught first)
        raise _resolved_error(exc, method, param) from None
    except ValueError as exc:
        name, _, message = str(exc).partition(": ")
        raise InvalidRequest(f"{name}: {message}.", param=f"{param}.{name}") from None

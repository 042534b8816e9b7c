"""Checks of a job create: method and hyperparameters (with OpenAI's ranges), and training rows per method.

Hyperparameters left as `"auto"` are resolved here from the training file's size, so the job object shows
the values training will use. Learning rates are `learning_rate_multiplier x BASE_LEARNING_RATE[method]`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from envsdk.graders import GraderError, validate_grader
from gateway.errors import InvalidRequest
from gateway.files.validation import read_rows

METHODS = ("supervised", "dpo", "reinforcement")

BASE_LEARNING_RATE = {"supervised": 2e-4, "dpo": 5e-5, "reinforcement": 1e-5}
"""LoRA learning rate that a `learning_rate_multiplier` of 1 means, per method."""

# (min, max, integer?) of each numeric hyperparameter; None = unbounded on that side.
_RANGES: dict[str, tuple[float | None, float | None, bool]] = {
    "batch_size": (1, 256, True),
    "learning_rate_multiplier": (0, 10_000, False),
    "n_epochs": (1, 50, True),
    "beta": (0, 2, False),
    "compute_multiplier": (0.00001, 10, False),
    "eval_interval": (1, None, True),
    "eval_samples": (1, None, True),
    # extensions (reinforcement)
    "num_generations": (2, 64, True),
    "max_completion_length": (1, 32_768, True),
    "temperature": (0, 2, False),
    "kl_beta": (0, 10, False),
    "max_steps": (1, 1_000_000, True),
    "checkpoint_every": (1, 1_000_000, True),
    "lora_r": (1, 256, True),
    "lora_alpha": (1, 1024, True),
}
_ALLOWED = {
    "supervised": {
        "batch_size",
        "learning_rate_multiplier",
        "n_epochs",
        "max_steps",
        "checkpoint_every",
        "lora_r",
        "lora_alpha",
    },
    "dpo": {
        "batch_size",
        "learning_rate_multiplier",
        "n_epochs",
        "beta",
        "max_steps",
        "checkpoint_every",
        "lora_r",
        "lora_alpha",
    },
    "reinforcement": {
        "batch_size",
        "learning_rate_multiplier",
        "n_epochs",
        "reasoning_effort",
        "compute_multiplier",
        "eval_interval",
        "eval_samples",
        "num_generations",
        "max_completion_length",
        "temperature",
        "kl_beta",
        "max_steps",
        "checkpoint_every",
        "lora_r",
        "lora_alpha",
    },
}
_EXCLUSIVE_ZERO = {"learning_rate_multiplier", "beta", "compute_multiplier"}
_SUFFIX = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
_ROLES = {"system", "developer", "user", "assistant", "tool", "function"}


@dataclass
class MethodSpec:
    """A create's method, normalised: its type, the hyperparameters as given, and its reward source."""

    type: str
    hyperparameters: dict[str, Any]
    grader: dict[str, Any] | None = None
    environment: dict[str, Any] | None = None


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


def _check_hyperparameters(kind: str, hp: dict[str, Any], param: str) -> dict[str, Any]:
    if not isinstance(hp, dict):
        raise InvalidRequest("hyperparameters must be an object.", param=param)
    out: dict[str, Any] = {}
    for key, value in hp.items():
        p = f"{param}.{key}"
        if key not in _ALLOWED[kind]:
            raise InvalidRequest(f"Unknown hyperparameter '{key}' for method '{kind}'.", param=p)
        if key == "reasoning_effort":
            if value not in ("default", "low", "medium", "high"):
                raise InvalidRequest("reasoning_effort must be default, low, medium or high.", param=p)
            out[key] = value
            continue
        if value == "auto" or value is None:
            out[key] = "auto"
            continue
        lo, hi, integer = _RANGES[key]
        if isinstance(value, bool) or not isinstance(value, int | float) or (integer and int(value) != value):
            raise InvalidRequest(
                f"{key} must be {'an integer' if integer else 'a number'} or 'auto'.", param=p
            )
        if (lo is not None and (value < lo or (key in _EXCLUSIVE_ZERO and value <= lo))) or (
            hi is not None and value > hi
        ):
            bounds = f"between {lo} and {hi}" if hi is not None else f"at least {lo}"
            raise InvalidRequest(f"{key} must be {bounds}; got {value}.", param=p)
        out[key] = int(value) if integer else float(value)
    return out


def check_grader(grader: Any, param: str) -> None:
    """The grader checked by the same code that will run it (sub-graders of `multi` too)."""
    try:
        validate_grader(grader, param=param)
    except GraderError as exc:
        raise InvalidRequest(exc.message, param=exc.param or param, code=exc.code) from None


def normalise_method(method: dict[str, Any] | None, legacy: dict[str, Any] | None) -> MethodSpec:
    """The method of a create; legacy top-level `hyperparameters` mean supervised."""
    if method is None:
        return MethodSpec("supervised", _check_hyperparameters("supervised", legacy or {}, "hyperparameters"))
    if not isinstance(method, dict):
        raise InvalidRequest("method must be an object.", param="method")
    kind = method.get("type")
    if kind not in METHODS:
        raise InvalidRequest("method.type must be supervised, dpo or reinforcement.", param="method.type")
    body = method.get(kind) or {}
    if not isinstance(body, dict):
        raise InvalidRequest(f"method.{kind} must be an object.", param=f"method.{kind}")
    hp = _check_hyperparameters(
        kind, body.get("hyperparameters") or legacy or {}, f"method.{kind}.hyperparameters"
    )
    spec = MethodSpec(kind, hp)
    if kind == "reinforcement":
        grader, env = body.get("grader"), body.get("environment")
        if (grader is None) == (env is None):
            raise InvalidRequest(
                "A reinforcement method needs exactly one of 'grader' or 'environment'.",
                param="method.reinforcement.grader",
            )
        if grader is not None:
            check_grader(grader, "method.reinforcement.grader")
            spec.grader = grader
        else:
            if not isinstance(env, dict) or not isinstance(env.get("file_id"), str):
                raise InvalidRequest(
                    "environment must be {'file_id': <file of purpose environment>, 'config': {...}}.",
                    param="method.reinforcement.environment.file_id",
                )
            config = env.get("config", {})
            if not isinstance(config, dict):
                raise InvalidRequest(
                    "environment.config must be an object.", param="method.reinforcement.environment.config"
                )
            spec.environment = {"file_id": env["file_id"], "config": config}
    return spec


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


def check_row(kind: str, row: dict[str, Any], line: int) -> int:
    """Check one row against its method's format; returns a rough size in characters (for estimates)."""
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
    for line, row in read_rows(path, max_line_bytes=max_line_bytes):
        chars += check_row(kind, row, line)
        rows += 1
    if rows == 0:
        raise RowError(1, "the file has no examples.")
    return DatasetSummary(rows, chars)


def resolve_hyperparameters(spec: MethodSpec, summary: DatasetSummary) -> dict[str, Any]:
    """Replace every `"auto"` (and every omitted core value) by the number training will use."""
    hp = dict(spec.hyperparameters)

    def pick(key: str, value: Any) -> None:
        if hp.get(key, "auto") == "auto":
            hp[key] = value

    pick("batch_size", max(1, min(8, summary.rows // 4 or 1)))
    pick("n_epochs", max(1, min(10, math.ceil(64 / max(summary.rows, 1)))))
    pick("learning_rate_multiplier", 1.0)
    if spec.type == "dpo":
        pick("beta", 0.1)
    if spec.type == "reinforcement":
        pick("num_generations", 4)
        pick("max_completion_length", 64)
        pick("temperature", 1.0)
        pick("kl_beta", 0.0)
        pick("reasoning_effort", "default")
        pick("compute_multiplier", 1.0)
    steps = math.ceil(summary.rows / hp["batch_size"]) * hp["n_epochs"]
    if isinstance(hp.get("max_steps"), int):
        steps = min(steps, hp["max_steps"])
    else:
        hp.pop("max_steps", None)
    pick("checkpoint_every", max(1, math.ceil(steps / 4)))
    pick("lora_r", 8)
    pick("lora_alpha", 16)
    hp["learning_rate"] = hp["learning_rate_multiplier"] * BASE_LEARNING_RATE[spec.type]
    hp["total_steps"] = steps
    return hp

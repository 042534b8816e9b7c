"""What validating and scoring graders share: the error of a bad grader, the result of grading one sample
(``GradeResult``), the failure that becomes an error flag on it (``GradeFailure``), the ``sample`` namespace
and its tool calls, the ``{{ ... }}`` templates, and the model graders' token caps.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

FORMULA_FUNCTIONS: dict[str, Any] = {
    "min": min,
    "max": max,
    "abs": abs,
    "round": round,
    "sqrt": math.sqrt,
    "log": math.log,
    "exp": math.exp,
    "floor": math.floor,
    "ceil": math.ceil,
    "pow": math.pow,
    "clip": lambda x, lo, hi: max(lo, min(hi, x)),
}
"""Functions a ``multi`` grader's ``calculate_output`` may call."""
MODEL_GRADER_DEFAULT_MAX_TOKENS = 256
"""Tokens a model grader's reply may have when its ``sampling_params`` name no cap (a score or a label, and
some words around it)."""
MODEL_GRADER_MAX_TOKENS = 4096
"""The largest cap a model grader may ask for; more is refused by ``validate_grader``."""
MAX_TOKENS_FIELDS = ("max_completion_tokens", "max_completions_tokens", "max_tokens")
"""Names a model grader's token cap may have in ``sampling_params`` (OpenAI's graders spell it
``max_completions_tokens``); each is sent as ``max_completion_tokens``."""

ERROR_FLAGS = (
    "formula_parse_error",
    "invalid_variable_error",
    "other_error",
    "sample_parse_error",
    "truncated_observation_error",
    "unresponsive_reward_error",
    "model_grader_parse_error",
    "model_grader_refusal_error",
    "model_grader_server_error",
    "python_grader_runtime_error",
    "python_grader_server_error",
)
"""Boolean flags of OpenAI's ``metadata.errors`` (the ``*_details``/``*_type`` companions are strings)."""


class GraderError(ValueError):
    """A grader definition that cannot be used.

    ``param`` is the JSON path of the offending field (e.g. ``grader.graders.a.operation``) and ``code`` a
    stable machine-readable reason: ``invalid_grader``, ``unsupported_metric``.
    """

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_grader") -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


@dataclass
class GradeResult:
    """The outcome of grading one sample (the shape of OpenAI's ``GraderRunResponse``)."""

    reward: float
    """The grader's score (0.0 when grading failed)."""
    sub_rewards: dict[str, float] = field(default_factory=dict)
    """Scores of a ``multi`` grader's sub-graders, by name; empty for the other types."""
    errors: dict[str, Any] = field(default_factory=dict)
    """OpenAI ``metadata.errors``: every flag of ``ERROR_FLAGS`` (bool) plus ``*_details`` strings."""
    name: str = ""
    """The grader's name."""
    type: str = ""
    """The grader's type."""
    execution_time: float = 0.0
    """Seconds spent grading."""
    token_usage: dict[str, dict[str, int]] = field(default_factory=dict)
    """Model-grader token usage by model name: ``{"prompt_tokens", "completion_tokens", "total_tokens"}``."""
    details: str | None = None
    """A human-readable reason when an error flag is set."""

    @property
    def failed(self) -> bool:
        """Whether any error flag is set."""
        return any(self.errors.get(flag) for flag in ERROR_FLAGS)

    def to_response(self, sampled_model_name: str | None = None) -> dict[str, Any]:
        """Render as OpenAI's ``GraderRunResponse`` JSON."""
        return {
            "reward": self.reward,
            "sub_rewards": self.sub_rewards,
            "model_grader_token_usage_per_model": self.token_usage,
            "metadata": {
                "name": self.name,
                "type": self.type,
                "execution_time": self.execution_time,
                "scores": dict(self.sub_rewards) if self.sub_rewards else {self.name: self.reward},
                "token_usage": _total_usage(self.token_usage),
                "sampled_model_name": sampled_model_name,
                "errors": self.errors,
                "details": self.details,
            },
        }


class GradeFailure(Exception):
    """Raised inside grading; becomes an error flag on the result."""

    def __init__(self, flag: str, details: str = "") -> None:
        super().__init__(details or flag)
        self.flag = flag
        self.details = details


def make_sample(output_text: str, output_tools: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """Build the ``sample`` namespace from a model's output text (``output_json`` parsed when it is JSON)."""
    try:
        output_json = json.loads(output_text)
    except (ValueError, TypeError):
        output_json = None
    if output_tools is None:
        output_tools = parse_tool_calls(output_text)
    return {"output_text": output_text, "output_json": output_json, "output_tools": output_tools}


TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"


def enclosed(text: str, opening: str, closing: str) -> list[str]:
    """What stands between each ``opening`` and the first ``closing`` after it, stripped, left to right.

    What ``re.findall(r"OPEN\\s*(.*?)\\s*CLOSE", text, re.DOTALL)`` finds, in one pass: that pattern tries
    the rest of the text from every opening that is never closed, so a text of many openings (a model
    sample, a template) takes time in the square of its length.
    """
    found: list[str] = []
    pos = 0
    while (start := text.find(opening, pos)) >= 0:
        end = text.find(closing, start + len(opening))
        if end < 0:
            break
        found.append(text[start + len(opening) : end].strip())
        pos = end + len(closing)
    return found


def parse_tool_calls(text: str) -> list[dict[str, Any]]:
    """Tool calls written as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (Qwen style)."""
    calls = []
    for body in enclosed(text, TOOL_CALL_OPEN, TOOL_CALL_CLOSE):
        try:
            data = json.loads(body)
        except ValueError:
            continue
        if isinstance(data, dict) and "name" in data:
            args = data.get("arguments", {})
            calls.append(
                {
                    "type": "function",
                    "function": {
                        "name": data["name"],
                        "arguments": args if isinstance(args, str) else json.dumps(args),
                    },
                }
            )
    return calls


# -- templates -------------------------------------------------------------------------------------------

_TEMPLATE_RE = re.compile(r"\{\{\s*(sample|item)((?:\.[A-Za-z0-9_\-]+|\[\s*-?\d+\s*\])*)\s*\}\}")
_PATH_PART_RE = re.compile(r"\.([A-Za-z0-9_\-]+)|\[\s*(-?\d+)\s*\]")


def render_template(template: str, sample: dict[str, Any], item: dict[str, Any]) -> str:
    """Replace every ``{{ sample.x }}`` / ``{{ item.x.y }}`` in ``template``; a missing name is an error."""

    def lookup(match: re.Match[str]) -> str:
        value: Any = sample if match.group(1) == "sample" else item
        for key, index in _PATH_PART_RE.findall(match.group(2)):
            try:
                value = value[int(index)] if index else value[key]
            except (KeyError, IndexError, TypeError):
                raise GradeFailure(
                    "invalid_variable_error", f"{match.group(0).strip('{} ')} is not defined"
                ) from None
        if isinstance(value, str):
            return value
        return json.dumps(value)

    return _TEMPLATE_RE.sub(lookup, template)


def literal_chars(template: str) -> int:
    """Characters of ``template`` outside its ``{{ ... }}`` variables: the least its rendering can hold."""
    return len(_TEMPLATE_RE.sub("", template))


def sub_graders(grader: dict[str, Any], param: str) -> dict[str, dict[str, Any]]:
    """A multi grader's sub-graders by name (``graders`` may be a dict or a list of named graders)."""
    subs = grader.get("graders")
    if isinstance(subs, dict):
        return dict(subs)
    if isinstance(subs, list):
        out: dict[str, dict[str, Any]] = {}
        for i, sub in enumerate(subs):
            name = sub.get("name") if isinstance(sub, dict) else None
            if not isinstance(name, str) or not name.isidentifier():
                raise GraderError(
                    "each sub-grader in a list needs an identifier name", f"{param}.graders[{i}].name"
                )
            out[name] = sub
        return out
    raise GraderError("graders must be an object or a list", f"{param}.graders")


def _total_usage(per_model: dict[str, dict[str, int]]) -> dict[str, int]:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for usage in per_model.values():
        for key in total:
            total[key] += usage.get(key, 0)
    return total

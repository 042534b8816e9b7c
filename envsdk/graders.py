"""OpenAI graders in pure Python: the reward side of reinforcement fine-tuning.

The same two functions serve the trainer (as a TRL reward function, see ``trainer.rewards``) and the
gateway's ``/v1/fine_tuning/alpha/graders/{validate,run}`` endpoints (the gateway may import only envsdk),
so this module imports no torch and loads its scoring libraries only when a grader needs them:

- ``validate_grader(grader)`` checks a grader's JSON and raises ``GraderError(message, param, code)``.
- ``grade(grader, sample, item, inference=..., python=...)`` scores one model sample against one dataset row
  and returns a ``GradeResult``; failures while grading are reported as data in ``errors`` (OpenAI's
  ``metadata.errors`` names) with a reward of 0, never raised.

Grader types: ``string_check`` (eq, ne, like, ilike), ``text_similarity`` (fuzzy_match, bleu, gleu,
rouge_1..rouge_5, rouge_l; cosine and meteor are refused: they need embeddings or corpora that are not
available offline), ``multi`` (``calculate_output`` evaluated by ``simpleeval`` over the sub-grader names),
``score_model`` and ``label_model`` (chat completions on ``InferenceClient``), and ``python`` (the
source's ``grade(sample, item)`` run in the sandbox by ``envsdk.python_grader``; never in this process --
a crash or a timeout there is ``python_grader_runtime_error``, reward 0).

Model graders ask for at most ``MODEL_GRADER_DEFAULT_MAX_TOKENS`` tokens unless their ``sampling_params``
name ``max_completion_tokens`` (OpenAI's ``max_completions_tokens``, or ``max_tokens``); a grader that asks
for more than ``MODEL_GRADER_MAX_TOKENS`` is invalid. ``model_fields(grader)`` lists the models a grader
calls with the path of each field, so a server can check that the caller may use them before grading.

Templates: ``{{ item.a.b }}``, ``{{ item.list[0] }}``, ``{{ sample.output_text }}``,
``{{ sample.output_json }}``, ``{{ sample.output_tools }}``; non-string values render as JSON.
"""

from __future__ import annotations

import ast
import json
import logging
import math
import re
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envsdk.inference_client import InferenceError
from envsdk.python_grader import PythonGraders, oversize, source_problem

if TYPE_CHECKING:
    from envsdk.inference_client import InferenceClient

logger = logging.getLogger(__name__)

GRADER_TYPES = ("string_check", "text_similarity", "multi", "python", "score_model", "label_model")
STRING_CHECK_OPERATIONS = ("eq", "ne", "like", "ilike")
SIMILARITY_METRICS = (
    "fuzzy_match",
    "bleu",
    "gleu",
    "rouge_1",
    "rouge_2",
    "rouge_3",
    "rouge_4",
    "rouge_5",
    "rouge_l",
)
REFUSED_METRICS = {
    "cosine": "needs an embeddings model, which is not available offline",
    "meteor": "needs the WordNet corpus, which is not available offline",
}
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
MAX_FORMULA_CHARS = 1000
"""Longest ``calculate_output`` of a ``multi`` grader."""
CPU_TYPES = frozenset({"string_check", "text_similarity"})
"""Grader types that only compute (no model, no sandbox): see ``computes_only``."""
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


class _GradeFailure(Exception):
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
                raise _GradeFailure(
                    "invalid_variable_error", f"{match.group(0).strip('{} ')} is not defined"
                ) from None
        if isinstance(value, str):
            return value
        return json.dumps(value)

    return _TEMPLATE_RE.sub(lookup, template)


def literal_chars(template: str) -> int:
    """Characters of ``template`` outside its ``{{ ... }}`` variables: the least its rendering can hold."""
    return len(_TEMPLATE_RE.sub("", template))


# -- validation ------------------------------------------------------------------------------------------


def _too_long(what: str, size: int, most: int, unit: str, param: str) -> GraderError:
    return GraderError(
        f"{what} is {size} {unit}; at most {most} are allowed", param, code="string_above_max_length"
    )


def validate_grader(
    grader: dict[str, Any],
    *,
    param: str = "grader",
    max_source_bytes: int | None = None,
    max_text_chars: int | None = None,
    parse_sources: bool = True,
) -> None:
    """Check a grader definition; raise ``GraderError`` naming the first bad field.

    Sizes are checked before any parsing: a python grader's ``source`` against ``max_source_bytes``, the
    literal text of a ``string_check`` or ``text_similarity`` template against ``max_text_chars`` (None:
    no cap; a process that serves many callers sets both). ``parse_sources=False`` leaves the parse of
    python sources to the caller (see ``python_sources`` and ``envsdk.python_grader.source_problems``).
    """
    caps = {"max_source_bytes": max_source_bytes, "max_text_chars": max_text_chars}
    if not isinstance(grader, dict):
        raise GraderError("grader must be an object", param)
    gtype = grader.get("type")
    if gtype not in GRADER_TYPES:
        raise GraderError(
            f"unknown grader type {gtype!r}; expected one of {', '.join(GRADER_TYPES)}", f"{param}.type"
        )
    if "name" in grader and not isinstance(grader["name"], str):
        raise GraderError("name must be a string", f"{param}.name")
    if gtype in ("string_check", "text_similarity"):
        _require_str(grader, ("input", "reference"), param)
        for key in ("input", "reference"):
            if max_text_chars is not None and len(grader[key]) > max_text_chars:
                size = literal_chars(grader[key])
                if size > max_text_chars:
                    what = f"{key} (without its variables)"
                    raise _too_long(what, size, max_text_chars, "characters", f"{param}.{key}")
    if gtype == "string_check":
        if grader.get("operation") not in STRING_CHECK_OPERATIONS:
            raise GraderError(
                f"operation must be one of {', '.join(STRING_CHECK_OPERATIONS)}", f"{param}.operation"
            )
    elif gtype == "text_similarity":
        metric = grader.get("evaluation_metric")
        if metric in REFUSED_METRICS:
            raise GraderError(
                f"evaluation_metric {metric!r} is not supported: it {REFUSED_METRICS[metric]}",
                f"{param}.evaluation_metric",
                code="unsupported_metric",
            )
        if metric not in SIMILARITY_METRICS:
            raise GraderError(
                f"evaluation_metric must be one of {', '.join(SIMILARITY_METRICS)}",
                f"{param}.evaluation_metric",
            )
    elif gtype == "python":
        source = grader.get("source")
        source_size = oversize(source, max_source_bytes) if isinstance(source, str) else None
        if source_size is not None:
            raise _too_long("source", source_size, int(max_source_bytes or 0), "bytes", f"{param}.source")
        problem = source_problem(source, parse=parse_sources)
        if problem is not None:
            raise GraderError(problem, f"{param}.source")
    elif gtype in ("score_model", "label_model"):
        _require_str(grader, ("model",), param)
        messages = grader.get("input")
        if not isinstance(messages, list) or not messages:
            raise GraderError("input must be a non-empty list of messages", f"{param}.input")
        for i, msg in enumerate(messages):
            if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or "content" not in msg:
                raise GraderError("each input message needs a role and content", f"{param}.input[{i}]")
        _check_sampling(grader.get("sampling_params"), f"{param}.sampling_params")
        if gtype == "score_model":
            rng = grader.get("range", [0, 1])
            if (
                not isinstance(rng, list | tuple)
                or len(rng) != 2
                or not all(isinstance(x, int | float) for x in rng)
                or rng[0] >= rng[1]
            ):
                raise GraderError("range must be [low, high] with low < high", f"{param}.range")
        else:
            labels, passing = grader.get("labels"), grader.get("passing_labels")
            if not isinstance(labels, list) or not labels or not all(isinstance(x, str) for x in labels):
                raise GraderError("labels must be a non-empty list of strings", f"{param}.labels")
            if (
                not isinstance(passing, list)
                or not passing
                or not all(isinstance(x, str) for x in passing)
                or not set(passing) <= set(labels)
            ):
                raise GraderError(
                    "passing_labels must be a non-empty subset of labels", f"{param}.passing_labels"
                )
    elif gtype == "multi":
        subs = _sub_graders(grader, param)
        if not subs:
            raise GraderError("graders must name at least one sub-grader", f"{param}.graders")
        for name, sub in subs.items():
            if isinstance(sub, dict) and sub.get("type") == "multi":
                raise GraderError("multi graders cannot be nested", f"{param}.graders.{name}.type")
            validate_grader(sub, param=f"{param}.graders.{name}", parse_sources=parse_sources, **caps)
        formula = grader.get("calculate_output")
        if not isinstance(formula, str) or not formula.strip():
            raise GraderError("calculate_output must be a formula", f"{param}.calculate_output")
        _check_formula(formula, set(subs), f"{param}.calculate_output")


def _require_str(grader: dict[str, Any], keys: tuple[str, ...], param: str) -> None:
    for key in keys:
        if not isinstance(grader.get(key), str):
            raise GraderError(f"{key} must be a string", f"{param}.{key}")


def _check_sampling(params: Any, param: str) -> None:
    """A model grader's ``sampling_params``: an object whose token cap is an integer from 1 to
    ``MODEL_GRADER_MAX_TOKENS``."""
    if params is None:
        return
    if not isinstance(params, dict):
        raise GraderError("sampling_params must be an object", param)
    for name in MAX_TOKENS_FIELDS:
        value = params.get(name)
        if value is None:
            continue
        if type(value) is not int or not 1 <= value <= MODEL_GRADER_MAX_TOKENS:
            raise GraderError(
                f"{name} must be an integer from 1 to {MODEL_GRADER_MAX_TOKENS}", f"{param}.{name}"
            )


def model_sampling(params: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling parameters a model grader sends: its own, with the token cap as ``max_completion_tokens``
    (``MODEL_GRADER_DEFAULT_MAX_TOKENS`` when it names none, never more than ``MODEL_GRADER_MAX_TOKENS``)."""
    out = dict(params or {})
    caps = [out.pop(name) for name in MAX_TOKENS_FIELDS if name in out]
    given = [c for c in caps if type(c) is int and c >= 1]
    cap = given[0] if given else MODEL_GRADER_DEFAULT_MAX_TOKENS
    out["max_completion_tokens"] = min(cap, MODEL_GRADER_MAX_TOKENS)
    return out


def model_fields(grader: dict[str, Any], *, param: str = "grader") -> list[tuple[str, str]]:
    """``(model, path of its field)`` for every model a grader calls (sub-graders of ``multi`` too), in the
    ``param`` spelling of ``validate_grader``: ``grader.model``, ``grader.graders.judge.model``."""
    out: list[tuple[str, str]] = []
    if grader.get("type") in ("score_model", "label_model") and isinstance(grader.get("model"), str):
        out.append((grader["model"], f"{param}.model"))
    if grader.get("type") == "multi":
        try:
            subs = _sub_graders(grader, param)
        except GraderError:
            subs = {}
        for name, sub in subs.items():
            if isinstance(sub, dict):
                out.extend(model_fields(sub, param=f"{param}.graders.{name}"))
    return out


def _sub_graders(grader: dict[str, Any], param: str) -> dict[str, dict[str, Any]]:
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


def python_sources(grader: Any, param: str = "grader") -> list[tuple[str, Any]]:
    """``(param, source)`` of every python grader in ``grader`` (itself, or a ``multi``'s sub-graders), named
    as ``validate_grader`` names them; a malformed grader yields what can be found (validation reports it)."""
    if not isinstance(grader, dict):
        return []
    if grader.get("type") == "python":
        return [(f"{param}.source", grader.get("source"))]
    if grader.get("type") != "multi":
        return []
    try:
        subs = _sub_graders(grader, param)
    except GraderError:
        return []
    return [
        (f"{param}.graders.{name}.source", sub.get("source"))
        for name, sub in subs.items()
        if isinstance(sub, dict) and sub.get("type") == "python"
    ]


def computes_only(grader: dict[str, Any]) -> bool:
    """Whether grading with (a valid) ``grader`` is computation alone: every grader in it is of
    ``CPU_TYPES``, so it calls no model and starts no sandbox."""
    if grader.get("type") == "multi":
        return all(sub.get("type") in CPU_TYPES for sub in _sub_graders(grader, "grader").values())
    return grader.get("type") in CPU_TYPES


def check_texts(
    grader: dict[str, Any],
    sample: dict[str, Any] | str,
    item: dict[str, Any] | None,
    *,
    max_text_chars: int,
    param: str = "grader",
) -> None:
    """Raise ``GraderError`` (``string_above_max_length``) naming the field when a (valid) ``grader``'s
    ``string_check`` or ``text_similarity`` text, its templates filled in from ``sample`` and ``item``, is
    longer than ``max_text_chars``: what grading would refuse, told before any scoring."""
    if isinstance(sample, str):
        sample = make_sample(sample)
    graders = (
        {f"{param}.graders.{name}": sub for name, sub in _sub_graders(grader, param).items()}
        if grader.get("type") == "multi"
        else {param: grader}
    )
    for where, sub in graders.items():
        if sub.get("type") not in CPU_TYPES:
            continue
        for key in ("input", "reference"):
            try:
                size = len(render_template(str(sub[key]), sample, item or {}))
            except _GradeFailure:
                continue  # a missing variable: grading reports it
            if size > max_text_chars:
                what = f"{key} (with its variables filled in)"
                raise _too_long(what, size, max_text_chars, "characters", f"{where}.{key}")


_FORMULA_NODES = (
    ast.Expression,
    ast.BinOp,
    ast.UnaryOp,
    ast.BoolOp,
    ast.Compare,
    ast.IfExp,
    ast.Call,
    ast.Name,
    ast.Load,
    ast.Constant,
    ast.operator,
    ast.unaryop,
    ast.boolop,
    ast.cmpop,
)


def _check_formula(formula: str, names: set[str], param: str) -> None:
    """Allow arithmetic over sub-grader names and ``FORMULA_FUNCTIONS`` only (no attributes, subscripts),
    in at most ``MAX_FORMULA_CHARS`` characters (checked before the parse)."""
    if len(formula) > MAX_FORMULA_CHARS:
        raise _too_long("calculate_output", len(formula), MAX_FORMULA_CHARS, "characters", param)
    try:
        tree = ast.parse(formula, mode="eval")
    except SyntaxError as exc:
        raise GraderError(f"calculate_output is not a valid formula: {exc.msg}", param) from None
    except (RecursionError, MemoryError, ValueError) as exc:
        raise GraderError(f"calculate_output is not a valid formula: {type(exc).__name__}", param) from None
    for node in ast.walk(tree):
        if not isinstance(node, _FORMULA_NODES):
            raise GraderError(f"calculate_output may not use {type(node).__name__}", param)
        if isinstance(node, ast.Constant) and not isinstance(node.value, int | float):
            raise GraderError("calculate_output may only use numeric constants", param)
        if isinstance(node, ast.Call) and not (
            isinstance(node.func, ast.Name) and node.func.id in FORMULA_FUNCTIONS and not node.keywords
        ):
            raise GraderError(f"calculate_output may only call {', '.join(FORMULA_FUNCTIONS)}", param)
        if isinstance(node, ast.Name) and node.id not in names and node.id not in FORMULA_FUNCTIONS:
            raise GraderError(f"calculate_output uses unknown name {node.id!r}", param)


def evaluate_formula(formula: str, values: dict[str, float]) -> float:
    """Evaluate a checked ``calculate_output`` with ``simpleeval`` (never ``eval``)."""
    from simpleeval import SimpleEval

    _check_formula(formula, set(values), "calculate_output")
    evaluator = SimpleEval(names=dict(values), functions=dict(FORMULA_FUNCTIONS))
    result = evaluator.eval(formula)
    return float(result)


# -- grading ---------------------------------------------------------------------------------------------


def grade(
    grader: dict[str, Any],
    sample: dict[str, Any] | str,
    item: dict[str, Any] | None = None,
    *,
    inference: InferenceClient | None = None,
    python: PythonGraders | None = None,
    max_text_chars: int | None = None,
) -> GradeResult:
    """Score one sample (a ``make_sample`` dict, or the output text) against one dataset row ``item``.

    ``max_text_chars`` (None: no cap) bounds each text a ``string_check`` or ``text_similarity`` compares
    once its templates are filled in; a longer one is an ``other_error`` of this sample, reward 0.

    The grader should have passed ``validate_grader``; problems met while grading (a missing template
    variable, a failing formula, an unreachable model grader, a python grader that raised) set the matching
    error flag, reward 0. ``python`` keeps the sandboxes of python graders between calls; without it each
    python grader starts (and stops) a sandbox for this one call.
    """
    own_python = python is None and _uses_python(grader)
    if own_python:
        python = PythonGraders()
    try:
        return _grade(grader, sample, item, inference, python, max_text_chars)
    finally:
        if own_python and python is not None:
            python.close()


def grade_within(
    grader: dict[str, Any], sample: dict[str, Any] | str, item: dict[str, Any] | None, max_text_chars: int
) -> GradeResult:
    """``check_texts``, then ``grade``: a text over the cap is refused (``GraderError``), not scored. For a
    grader that ``computes_only`` (a module-level function, so a process pool can run it)."""
    check_texts(grader, sample, item, max_text_chars=max_text_chars)
    return grade(grader, sample, item, max_text_chars=max_text_chars)


def _uses_python(grader: dict[str, Any]) -> bool:
    if grader.get("type") == "python":
        return True
    subs = grader.get("graders")
    values = subs.values() if isinstance(subs, dict) else subs if isinstance(subs, list) else []
    return any(isinstance(s, dict) and s.get("type") == "python" for s in values)


def _grade(
    grader: dict[str, Any],
    sample: dict[str, Any] | str,
    item: dict[str, Any] | None,
    inference: InferenceClient | None,
    python: PythonGraders | None,
    max_text_chars: int | None = None,
) -> GradeResult:
    if isinstance(sample, str):
        sample = make_sample(sample)
    item = item or {}
    started = time.perf_counter()
    result = GradeResult(
        reward=0.0, errors=_empty_errors(), name=str(grader.get("name", "")), type=str(grader.get("type", ""))
    )
    try:
        if grader.get("type") == "multi":
            result.reward = _grade_multi(grader, sample, item, inference, python, result, max_text_chars)
        else:
            result.reward = _grade_one(grader, sample, item, inference, python, result, max_text_chars)
    except _GradeFailure as exc:
        result.reward = 0.0
        result.errors[exc.flag] = True
        if exc.details and exc.flag in ("model_grader_server_error", "python_grader_runtime_error"):
            result.errors[f"{exc.flag}_details"] = exc.details
        result.details = exc.details or exc.flag
    except GraderError as exc:
        result.reward = 0.0
        result.errors["other_error"] = True
        result.details = exc.message
    except Exception as exc:  # a bug or an odd input must not stop training: flag it and score 0
        logger.warning("grader %r failed: %s", result.name, exc, exc_info=True)
        result.reward = 0.0
        result.errors["other_error"] = True
        result.details = f"{type(exc).__name__}: {exc}"
    result.execution_time = time.perf_counter() - started
    return result


def _empty_errors() -> dict[str, Any]:
    errors: dict[str, Any] = {flag: False for flag in ERROR_FLAGS}
    errors["model_grader_server_error_details"] = None
    errors["python_grader_runtime_error_details"] = None
    errors["python_grader_server_error_type"] = None
    return errors


def _grade_multi(
    grader: dict[str, Any],
    sample: dict[str, Any],
    item: dict[str, Any],
    inference: InferenceClient | None,
    python: PythonGraders | None,
    result: GradeResult,
    max_text_chars: int | None,
) -> float:
    values: dict[str, float] = {}
    for name, sub in _sub_graders(grader, "grader").items():
        values[name] = _grade_one(sub, sample, item, inference, python, result, max_text_chars)
    result.sub_rewards = dict(values)
    try:
        return evaluate_formula(str(grader.get("calculate_output", "")), values)
    except GraderError as exc:
        raise _GradeFailure("formula_parse_error", exc.message) from None
    except Exception as exc:  # division by zero, math domain errors, ...
        raise _GradeFailure("formula_parse_error", f"{type(exc).__name__}: {exc}") from None


def _grade_one(
    grader: dict[str, Any],
    sample: dict[str, Any],
    item: dict[str, Any],
    inference: InferenceClient | None,
    python: PythonGraders | None,
    result: GradeResult,
    max_text_chars: int | None = None,
) -> float:
    gtype = grader.get("type")
    if gtype == "string_check":
        return _string_check(grader, sample, item, max_text_chars)
    if gtype == "text_similarity":
        return _text_similarity(grader, sample, item, max_text_chars)
    if gtype in ("score_model", "label_model"):
        return _model_grade(grader, sample, item, inference, result)
    if gtype == "python":
        return _python_grade(grader, sample, item, python)
    raise GraderError(f"unknown grader type {gtype!r}", "grader.type")


def _texts(
    grader: dict[str, Any], sample: dict[str, Any], item: dict[str, Any], max_text_chars: int | None
) -> tuple[str, str]:
    """The grader's ``input`` and ``reference`` rendered, each at most ``max_text_chars`` long."""
    texts = (
        render_template(str(grader["input"]), sample, item),
        render_template(str(grader["reference"]), sample, item),
    )
    for key, text in zip(("input", "reference"), texts, strict=True):
        if max_text_chars is not None and len(text) > max_text_chars:
            raise _GradeFailure(
                "other_error", f"{key} is {len(text)} characters; at most {max_text_chars} are compared"
            )
    return texts


def _string_check(
    grader: dict[str, Any], sample: dict[str, Any], item: dict[str, Any], max_text_chars: int | None
) -> float:
    value, reference = _texts(grader, sample, item, max_text_chars)
    op = grader["operation"]
    if op == "eq":
        return float(value == reference)
    if op == "ne":
        return float(value != reference)
    if op == "like":
        return float(reference in value)
    if op == "ilike":
        return float(reference.lower() in value.lower())
    raise GraderError(f"unknown operation {op!r}", "grader.operation")


def _text_similarity(
    grader: dict[str, Any], sample: dict[str, Any], item: dict[str, Any], max_text_chars: int | None
) -> float:
    hypothesis, reference = _texts(grader, sample, item, max_text_chars)
    metric = grader["evaluation_metric"]
    if metric == "fuzzy_match":
        from rapidfuzz import fuzz

        return float(fuzz.ratio(hypothesis, reference)) / 100.0
    if metric == "bleu":
        import sacrebleu

        return float(sacrebleu.sentence_bleu(hypothesis, [reference]).score) / 100.0
    if metric == "gleu":
        from nltk.translate.gleu_score import sentence_gleu

        return float(sentence_gleu([reference.split()], hypothesis.split()))
    if metric.startswith("rouge_"):
        from rouge_score import rouge_scorer

        kind = "rougeL" if metric == "rouge_l" else f"rouge{metric[-1]}"
        scorer = rouge_scorer.RougeScorer([kind], use_stemmer=False)
        return float(scorer.score(reference, hypothesis)[kind].fmeasure)
    raise GraderError(f"evaluation_metric {metric!r} is not supported", "grader.evaluation_metric")


def _python_grade(
    grader: dict[str, Any], sample: dict[str, Any], item: dict[str, Any], python: PythonGraders | None
) -> float:
    """Run the source's ``grade(sample, item)`` in its sandbox."""
    if python is None:
        raise _GradeFailure("python_grader_server_error", "no sandbox is available for python graders")
    try:
        runner = python.get(str(grader.get("source", "")))
    except ValueError as exc:
        raise GraderError(str(exc), "grader.source") from None
    reward, error = runner.grade(sample, item)
    if reward is None:
        raise _GradeFailure("python_grader_runtime_error", error or "grade() failed")
    return reward


def _render_messages(
    messages: list[dict[str, Any]], sample: dict[str, Any], item: dict[str, Any]
) -> list[dict[str, str]]:
    """Render a model grader's input messages; content parts (``input_text``/``text``) are joined."""
    out = []
    for msg in messages:
        content = msg.get("content", "")
        if isinstance(content, list):
            parts = [p.get("text", "") if isinstance(p, dict) else str(p) for p in content]
            content = "\n".join(parts)
        elif isinstance(content, dict):
            content = content.get("text", "")
        out.append({"role": str(msg["role"]), "content": render_template(str(content), sample, item)})
    return out


_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?:[eE][-+]?\d+)?")


def parse_score(text: str) -> float:
    """Read a score from a grader model's reply: JSON ``{"result"|"score"|...: x}`` or the first number."""
    stripped = text.strip()
    try:
        data = json.loads(stripped)
    except ValueError:
        data = None
    if isinstance(data, int | float) and not isinstance(data, bool):
        return float(data)
    if isinstance(data, dict):
        for key in ("result", "score", "reward", "value"):
            if isinstance(data.get(key), int | float) and not isinstance(data.get(key), bool):
                return float(data[key])
    match = _NUMBER_RE.search(stripped)
    if match is None:
        raise _GradeFailure(
            "model_grader_parse_error", f"no number in the grader model's reply: {stripped[:200]!r}"
        )
    return float(match.group(0))


def _model_grade(
    grader: dict[str, Any],
    sample: dict[str, Any],
    item: dict[str, Any],
    inference: InferenceClient | None,
    result: GradeResult,
) -> float:
    if inference is None:
        raise _GradeFailure(
            "model_grader_server_error", "no inference endpoint is configured for model graders"
        )
    messages = _render_messages(list(grader["input"]), sample, item)
    model = str(grader["model"])
    sampling = grader.get("sampling_params")
    params = model_sampling(sampling if isinstance(sampling, dict) else None)
    try:
        reply = inference.chat(model, messages, **params)
    except InferenceError as exc:
        if exc.refusal:
            raise _GradeFailure("model_grader_refusal_error", str(exc)) from None
        raise _GradeFailure("model_grader_server_error", str(exc)) from None
    usage = result.token_usage.setdefault(
        model, {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    )
    for key in usage:
        usage[key] += int(reply.usage.get(key, 0))
    if grader["type"] == "label_model":
        return _parse_label(reply.text, list(grader["labels"]), list(grader["passing_labels"]))
    low, high = grader.get("range", [0, 1])
    return min(max(parse_score(reply.text), float(low)), float(high))


def _parse_label(text: str, labels: list[str], passing: list[str]) -> float:
    """1.0 when the reply names a passing label; an exact reply wins over the first label mentioned."""
    reply = text.strip().strip("\"'`. ").lower()
    chosen = next((label for label in labels if label.lower() == reply), None)
    if chosen is None:
        found = [(reply.find(label.lower()), label) for label in labels if label.lower() in reply]
        if not found:
            raise _GradeFailure(
                "model_grader_parse_error", f"reply names none of the labels: {text.strip()[:200]!r}"
            )
        chosen = min(found)[1]
    return float(chosen in passing)


def _total_usage(per_model: dict[str, dict[str, int]]) -> dict[str, int]:
    total = {"prompt_tokens": 0, "completion_tokens": 0, "total_tokens": 0}
    for usage in per_model.values():
        for key in total:
            total[key] += usage.get(key, 0)
    return total

"""Validating graders: ``validate_grader`` checks a grader's JSON and raises ``GraderError(message, param,
code)`` naming the first bad field, sizes (``max_source_bytes``, ``max_text_chars``, ``MAX_FORMULA_CHARS``)
before any parsing. ``check_texts`` tells, before scoring, that a sample's filled-in text is over its cap;
``model_fields``, ``python_sources`` and ``computes_only`` read what a grader will call.
"""

from __future__ import annotations

import ast
from typing import Any

from envsdk.graders.core import (
    FORMULA_FUNCTIONS,
    MAX_TOKENS_FIELDS,
    MODEL_GRADER_MAX_TOKENS,
    GradeFailure,
    GraderError,
    literal_chars,
    make_sample,
    render_template,
    sub_graders,
)
from envsdk.python_grader import oversize, source_problem

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
MAX_FORMULA_CHARS = 1000
"""Longest ``calculate_output`` of a ``multi`` grader."""
CPU_TYPES = frozenset({"string_check", "text_similarity"})
"""Grader types that only compute (no model, no sandbox): see ``computes_only``."""


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
        subs = sub_graders(grader, param)
        if not subs:
            raise GraderError("graders must name at least one sub-grader", f"{param}.graders")
        for name, sub in subs.items():
            if isinstance(sub, dict) and sub.get("type") == "multi":
                raise GraderError("multi graders cannot be nested", f"{param}.graders.{name}.type")
            validate_grader(sub, param=f"{param}.graders.{name}", parse_sources=parse_sources, **caps)
        formula = grader.get("calculate_output")
        if not isinstance(formula, str) or not formula.strip():
            raise GraderError("calculate_output must be a formula", f"{param}.calculate_output")
        check_formula(formula, set(subs), f"{param}.calculate_output")


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


def model_fields(grader: dict[str, Any], *, param: str = "grader") -> list[tuple[str, str]]:
    """``(model, path of its field)`` for every model a grader calls (sub-graders of ``multi`` too), in the
    ``param`` spelling of ``validate_grader``: ``grader.model``, ``grader.graders.judge.model``."""
    out: list[tuple[str, str]] = []
    if grader.get("type") in ("score_model", "label_model") and isinstance(grader.get("model"), str):
        out.append((grader["model"], f"{param}.model"))
    if grader.get("type") == "multi":
        try:
            subs = sub_graders(grader, param)
        except GraderError:
            subs = {}
        for name, sub in subs.items():
            if isinstance(sub, dict):
                out.extend(model_fields(sub, param=f"{param}.graders.{name}"))
    return out


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
        subs = sub_graders(grader, param)
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
        return all(sub.get("type") in CPU_TYPES for sub in sub_graders(grader, "grader").values())
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
        {f"{param}.graders.{name}": sub for name, sub in sub_graders(grader, param).items()}
        if grader.get("type") == "multi"
        else {param: grader}
    )
    for where, sub in graders.items():
        if sub.get("type") not in CPU_TYPES:
            continue
        for key in ("input", "reference"):
            try:
                size = len(render_template(str(sub[key]), sample, item or {}))
            except GradeFailure:
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


def check_formula(formula: str, names: set[str], param: str) -> None:
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

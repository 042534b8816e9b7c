"""Running graders: ``grade(grader, sample, item, inference=..., python=...)`` scores one model sample
against one dataset row and returns a ``GradeResult``; failures while grading are reported as data in
``errors`` (OpenAI's ``metadata.errors`` names) with a reward of 0, never raised. The scoring libraries load
only when a grader needs them.
"""

from __future__ import annotations

import json
import logging
import re
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from envsdk.graders.core import (
    ERROR_FLAGS,
    FORMULA_FUNCTIONS,
    MAX_TOKENS_FIELDS,
    MODEL_GRADER_DEFAULT_MAX_TOKENS,
    MODEL_GRADER_MAX_TOKENS,
    GradeFailure,
    GraderError,
    GradeResult,
    make_sample,
    render_template,
    sub_graders,
)
from envsdk.graders.validation import check_formula, check_texts
from envsdk.inference_client import InferenceError
from envsdk.python_grader import PythonGraders

if TYPE_CHECKING:
    from envsdk.inference_client import InferenceClient

logger = logging.getLogger(__name__)


def model_sampling(params: dict[str, Any] | None) -> dict[str, Any]:
    """The sampling parameters a model grader sends: its own, with the token cap as ``max_completion_tokens``
    (``MODEL_GRADER_DEFAULT_MAX_TOKENS`` when it names none, never more than ``MODEL_GRADER_MAX_TOKENS``)."""
    out = dict(params or {})
    caps = [out.pop(name) for name in MAX_TOKENS_FIELDS if name in out]
    given = [c for c in caps if type(c) is int and c >= 1]
    cap = given[0] if given else MODEL_GRADER_DEFAULT_MAX_TOKENS
    out["max_completion_tokens"] = min(cap, MODEL_GRADER_MAX_TOKENS)
    return out


def evaluate_formula(formula: str, values: dict[str, float]) -> float:
    """Evaluate a checked ``calculate_output`` with ``simpleeval`` (never ``eval``)."""
    from simpleeval import SimpleEval

    check_formula(formula, set(values), "calculate_output")
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


@dataclass(slots=True)
class _Grading:
    """One sample being graded: what each of its graders reads, and the result they write to."""

    sample: dict[str, Any]
    item: dict[str, Any]
    inference: InferenceClient | None
    python: PythonGraders | None
    result: GradeResult
    max_text_chars: int | None


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
    g = _Grading(sample, item, inference, python, result, max_text_chars)
    try:
        if grader.get("type") == "multi":
            result.reward = _grade_multi(grader, g)
        else:
            result.reward = _grade_one(grader, g)
    except GradeFailure as exc:
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


def _grade_multi(grader: dict[str, Any], g: _Grading) -> float:
    values: dict[str, float] = {}
    for name, sub in sub_graders(grader, "grader").items():
        values[name] = _grade_one(sub, g)
    g.result.sub_rewards = dict(values)
    try:
        return evaluate_formula(str(grader.get("calculate_output", "")), values)
    except GraderError as exc:
        raise GradeFailure("formula_parse_error", exc.message) from None
    except Exception as exc:  # division by zero, math domain errors, ...
        raise GradeFailure("formula_parse_error", f"{type(exc).__name__}: {exc}") from None


def _grade_one(grader: dict[str, Any], g: _Grading) -> float:
    gtype = grader.get("type")
    if gtype == "string_check":
        return _string_check(grader, g.sample, g.item, g.max_text_chars)
    if gtype == "text_similarity":
        return _text_similarity(grader, g.sample, g.item, g.max_text_chars)
    if gtype in ("score_model", "label_model"):
        return _model_grade(grader, g.sample, g.item, g.inference, g.result)
    if gtype == "python":
        return _python_grade(grader, g.sample, g.item, g.python)
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
            raise GradeFailure(
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
        raise GradeFailure("python_grader_server_error", "no sandbox is available for python graders")
    try:
        runner = python.get(str(grader.get("source", "")))
    except ValueError as exc:
        raise GraderError(str(exc), "grader.source") from None
    reward, error = runner.grade(sample, item)
    if reward is None:
        raise GradeFailure("python_grader_runtime_error", error or "grade() failed")
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
        raise GradeFailure(
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
        raise GradeFailure(
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
            raise GradeFailure("model_grader_refusal_error", str(exc)) from None
        raise GradeFailure("model_grader_server_error", str(exc)) from None
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
            raise GradeFailure(
                "model_grader_parse_error", f"reply names none of the labels: {text.strip()[:200]!r}"
            )
        chosen = min(found)[1]
    return float(chosen in passing)

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

The code is in three modules, and every public name is importable from here: ``envsdk.graders.validation``
(checking a grader before any use), ``envsdk.graders.scoring`` (grading a sample) and what both share,
``envsdk.graders.core`` (the error, the result, samples and templates).
"""

from __future__ import annotations

from envsdk.graders.core import (
    ERROR_FLAGS,
    FORMULA_FUNCTIONS,
    MAX_TOKENS_FIELDS,
    MODEL_GRADER_DEFAULT_MAX_TOKENS,
    MODEL_GRADER_MAX_TOKENS,
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    GraderError,
    GradeResult,
    enclosed,
    literal_chars,
    make_sample,
    parse_tool_calls,
    render_template,
)
from envsdk.graders.scoring import evaluate_formula, grade, grade_within, model_sampling, parse_score
from envsdk.graders.validation import (
    CPU_TYPES,
    GRADER_TYPES,
    MAX_FORMULA_CHARS,
    REFUSED_METRICS,
    SIMILARITY_METRICS,
    STRING_CHECK_OPERATIONS,
    check_texts,
    computes_only,
    model_fields,
    python_sources,
    validate_grader,
)

__all__ = [
    "CPU_TYPES",
    "ERROR_FLAGS",
    "FORMULA_FUNCTIONS",
    "GRADER_TYPES",
    "MAX_FORMULA_CHARS",
    "MAX_TOKENS_FIELDS",
    "MODEL_GRADER_DEFAULT_MAX_TOKENS",
    "MODEL_GRADER_MAX_TOKENS",
    "REFUSED_METRICS",
    "SIMILARITY_METRICS",
    "STRING_CHECK_OPERATIONS",
    "TOOL_CALL_CLOSE",
    "TOOL_CALL_OPEN",
    "GradeResult",
    "GraderError",
    "check_texts",
    "computes_only",
    "enclosed",
    "evaluate_formula",
    "grade",
    "grade_within",
    "literal_chars",
    "make_sample",
    "model_fields",
    "model_sampling",
    "parse_score",
    "parse_tool_calls",
    "python_sources",
    "render_template",
    "validate_grader",
]

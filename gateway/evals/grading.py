"""Grading one output item with an eval's criteria, and adding items up into a run's summary.

`grade_item` runs `envsdk.graders.grade` (the code reinforcement fine-tuning rewards with) once per
criterion, so a run's scores are what a direct `grade` of the same sample gives; a criterion passes when its
score reaches `pass_threshold` and it reported no error. `Summary` adds items up into OpenAI's
`result_counts`, `per_testing_criteria_results` and `per_model_usage`; the worker seeds it from the items
an earlier attempt already wrote, so a resumed run counts each item once.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from envsdk.graders import ERROR_FLAGS, grade
from gateway.evals.datasource import pass_threshold

if TYPE_CHECKING:
    from envsdk.inference_client import InferenceClient
    from envsdk.python_grader import PythonGraders

USAGE_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens")


def grade_item(
    criteria: list[dict[str, Any]],
    sample: dict[str, Any],
    item: dict[str, Any],
    *,
    inference: InferenceClient | None,
    python: PythonGraders | None,
    max_text_chars: int | None = None,
) -> tuple[list[dict[str, Any]], dict[str, dict[str, int]]]:
    """Each criterion's result (`name`, `type`, `score`, `passed`, `sample`, and `error` when it could not
    grade), and the model graders' token usage by model. Blocking: run it in a thread. A text longer than
    `max_text_chars` (the settings' `grader_max_text_chars`) is an error of its criterion, not compared."""
    results: list[dict[str, Any]] = []
    usage: dict[str, dict[str, int]] = {}
    for criterion in criteria:
        graded = grade(
            criterion, sample, item, inference=inference, python=python, max_text_chars=max_text_chars
        )
        result: dict[str, Any] = {
            "name": criterion["name"],
            "type": criterion["type"],
            "score": graded.reward,
            "passed": not graded.failed and graded.reward >= pass_threshold(criterion),
            "sample": None,
        }
        if graded.sub_rewards:
            result["sub_rewards"] = graded.sub_rewards
        if graded.failed:
            flag = next(f for f in ERROR_FLAGS if graded.errors.get(f))
            result["error"] = {"code": flag, "message": graded.details or flag}
        results.append(result)
        for model, tokens in graded.token_usage.items():
            add_usage(usage, model, tokens, invocations=1)
    return results, usage


def add_usage(
    usage: dict[str, dict[str, int]], model: str, tokens: dict[str, Any], *, invocations: int
) -> None:
    """Add one call's tokens to a by-model tally (`invocation_count` plus `USAGE_KEYS`)."""
    entry = usage.setdefault(model, {"invocation_count": 0, **dict.fromkeys(USAGE_KEYS, 0)})
    entry["invocation_count"] += invocations
    for key in USAGE_KEYS:
        value = tokens.get(key)
        if key == "cached_tokens" and value is None:
            value = (tokens.get("prompt_tokens_details") or {}).get("cached_tokens")
        entry[key] += int(value or 0)


def item_status(results: list[dict[str, Any]], sample_error: dict[str, Any] | None) -> str:
    """`error` when sampling or a criterion failed to run, else `pass` when every criterion passed."""
    if sample_error is not None or any("error" in r for r in results):
        return "error"
    return "pass" if all(r["passed"] for r in results) else "fail"


@dataclass
class Summary:
    """A run's counts so far, in OpenAI's shapes."""

    criteria: list[str]
    """The criteria's names, in the eval's order."""
    counts: dict[str, int] = field(
        default_factory=lambda: dict.fromkeys(("total", "errored", "failed", "passed"), 0)
    )
    per_criterion: dict[str, list[int]] = field(default_factory=dict)
    usage: dict[str, dict[str, int]] = field(default_factory=dict)
    first_error: dict[str, Any] | None = None
    """The first error met (an item's sample or criterion): what a run whose every item errored reports."""

    def add(
        self,
        status: str,
        results: list[dict[str, Any]],
        usage: dict[str, dict[str, int]],
        sample_error: dict[str, Any] | None = None,
    ) -> None:
        self.counts["total"] += 1
        self.counts[{"pass": "passed", "fail": "failed", "error": "errored"}[status]] += 1
        for result in results:
            tally = self.per_criterion.setdefault(result["name"], [0, 0])
            tally[0 if result["passed"] else 1] += 1
        for model, tokens in usage.items():
            add_usage(self.usage, model, tokens, invocations=int(tokens.get("invocation_count", 0)))
        if self.first_error is None and status == "error":
            self.first_error = sample_error or next((r["error"] for r in results if "error" in r), None)

    def result_counts(self) -> dict[str, int]:
        return dict(self.counts)

    def per_testing_criteria_results(self) -> list[dict[str, Any]]:
        tallies = {name: self.per_criterion.get(name, [0, 0]) for name in self.criteria}
        return [{"testing_criteria": n, "passed": t[0], "failed": t[1]} for n, t in tallies.items()]

    def per_model_usage(self) -> list[dict[str, Any]]:
        return [{"model_name": model, **tokens} for model, tokens in self.usage.items()]

    def all_errored(self) -> bool:
        return self.counts["total"] > 0 and self.counts["errored"] == self.counts["total"]

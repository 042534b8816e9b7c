"""A job's guards: the warning signs its worker watches for while it trains, each with its thresholds and the
action taken when it fires.

Every job has every guard, resolved with the defaults below and shown on the job as `guards`
(`{name: {<threshold>: number, ..., "action": str}}`). A create (and the estimate, which shares its checks)
may override any of them with a top-level `guards` object, as it gives `suffix` or `max_cost`:
`{"guards": {"hang": {"seconds": 600}, "length_runaway": {"action": "pause"}}}`. Unknown guards, unknown
fields, numbers out of range and unknown actions are a 400 naming the field (`guards.<name>.<field>`).

Actions: `warn` (an event), `pause` (the job pauses with a checkpoint, as its `max_cost` pauses it; resuming
is the user's choice), `rollback` (pause, and resume from the checkpoint with the best validation numbers
rather than the latest) and `off`. The worker evaluates them (`gateway.worker.job.guards`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from gateway.errors import InvalidRequest

ACTIONS = ("warn", "pause", "rollback", "off")


@dataclass(frozen=True, slots=True)
class Threshold:
    """One number of a guard: its default and the range a job may set it in."""

    default: float
    low: float
    high: float
    integer: bool = False


@dataclass(frozen=True, slots=True)
class Guard:
    """One guard: what it watches, its thresholds and its default action."""

    about: str
    thresholds: dict[str, Threshold]
    action: str
    by_method: dict[str, dict[str, float]] = field(default_factory=dict)
    """Defaults that differ for a method (`{method: {threshold: default}}`)."""


GUARDS: dict[str, Guard] = {
    "validation_divergence": Guard(
        "the training reward rises (or the training loss falls) while the validation numbers get worse, at "
        "each of the last `evaluations` evaluations (needs a validation file)",
        {"evaluations": Threshold(2, 1, 20, integer=True)},
        "warn",
    ),
    "non_finite": Guard(
        "the training loss or the gradient norm is NaN or infinite",
        {},
        "pause",
    ),
    "explosion": Guard(
        "the gradient norm (and for supervised and DPO jobs the loss, above its first step's) exceeds "
        "`factor` times its median over the last `window` steps, once `min_steps` steps are known",
        {
            "factor": Threshold(10.0, 1.5, 1e6),
            "window": Threshold(20, 2, 1000, integer=True),
            "min_steps": Threshold(1, 1, 1000, integer=True),
        },
        "pause",
        # A reinforcement step's gradient comes from the few groups whose rewards differed: its norm moves
        # several-fold from step to step (0.22 to 1.7 over 18 steps of the arithmetic example), so one step
        # is too few to judge by; offline from capture, where more of each batch's tokens leave the clip
        # range as the policy moves, from 0.01 to 0.51 over 64 steps of a clean run, one step 11.3 times its
        # running median. A step 30 times the median is still far below a diverging run's.
        by_method={"reinforcement": {"min_steps": 3, "factor": 30.0}},
    ),
    "length_runaway": Guard(
        "reinforcement: at least `clipped_ratio` of the completions are cut at `max_completion_length`, or "
        "their mean length is `growth` times that of the first steps, for `steps` steps in a row",
        {
            "clipped_ratio": Threshold(0.9, 0.01, 1.0),
            "growth": Threshold(4.0, 1.1, 1000.0),
            "steps": Threshold(5, 1, 1000, integer=True),
        },
        "warn",
    ),
    "entropy_collapse": Guard(
        "reinforcement: the policy's entropy stays below `fraction` of its first steps' for `steps` steps",
        {"fraction": Threshold(0.1, 0.0, 1.0), "steps": Threshold(5, 1, 1000, integer=True)},
        "warn",
    ),
    "sampler_mismatch": Guard(
        "reinforcement: the policy that sampled the completions and the one the trainer scores them with "
        "differ: the KL between them (`mismatch/kl`) is above `max_kl`, or their mean importance ratio "
        "(`mismatch/ratio_mean`) is outside [`min_ratio`, `max_ratio`], at each of the last `steps` steps "
        "that measure it",
        {
            "max_kl": Threshold(0.02, 0.0, 100.0),
            "min_ratio": Threshold(0.8, 0.0, 1.0),
            "max_ratio": Threshold(1.25, 1.0, 1000.0),
            "steps": Threshold(3, 1, 1000, integer=True),
        },
        "warn",
    ),
    "error_rate": Guard(
        "reinforcement: the grader's or the environment's error rate, averaged over the last `window` steps, "
        "is above `max_rate`",
        {"max_rate": Threshold(0.05, 0.0, 1.0), "window": Threshold(3, 1, 1000, integer=True)},
        "pause",
    ),
    "hang": Guard(
        "the trainer reports nothing (no step, checkpoint or message) for `seconds`",
        {"seconds": Threshold(1800, 1, 7 * 86400)},
        "pause",
    ),
}
"""Every guard, in the order they are shown."""


def defaults(method: str = "supervised") -> dict[str, dict[str, Any]]:
    """Every guard with its default thresholds (those of `method`) and action."""
    return {
        name: {
            **{k: _number(g.by_method.get(method, {}).get(k, t.default), t) for k, t in g.thresholds.items()},
            "action": g.action,
        }
        for name, g in GUARDS.items()
    }


def _number(value: float, threshold: Threshold) -> float | int:
    return int(value) if threshold.integer else float(value)


def resolve(
    given: Any, stored: dict[str, Any] | None = None, *, method: str = "supervised"
) -> dict[str, dict[str, Any]]:
    """Every guard resolved: the defaults of the job's `method`, under `stored` (a job's row), under `given`
    (a create's `guards`, checked: a 400 naming the field for anything it may not hold)."""
    out = defaults(method)
    for name, values in (stored or {}).items():
        if name in out and isinstance(values, dict):
            out[name].update({k: v for k, v in values.items() if k in out[name]})
    if given is None:
        return out
    if not isinstance(given, dict):
        raise InvalidRequest("guards must be an object of guard names to settings.", param="guards")
    for name, values in given.items():
        guard = GUARDS.get(name)
        if guard is None:
            raise InvalidRequest(
                f"Unknown guard '{name}'; the guards are {', '.join(GUARDS)}.",
                param=f"guards.{name}",
                code="unknown_guard",
            )
        if not isinstance(values, dict):
            raise InvalidRequest(
                f"guards.{name} must be an object of thresholds and an action.", param=f"guards.{name}"
            )
        for key, value in values.items():
            out[name][key] = _checked(name, guard, key, value)
    return out


def _checked(name: str, guard: Guard, key: str, value: Any) -> Any:
    param = f"guards.{name}.{key}"
    if key == "action":
        if value not in ACTIONS:
            raise InvalidRequest(
                f"guards.{name}.action must be one of {', '.join(ACTIONS)}.",
                param=param,
                code="invalid_value",
            )
        return value
    threshold = guard.thresholds.get(key)
    if threshold is None:
        known = ", ".join([*guard.thresholds, "action"])
        raise InvalidRequest(
            f"Unknown setting '{key}' of guard '{name}'; it has {known}.", param=param, code="invalid_value"
        )
    kind = "an integer" if threshold.integer else "a number"
    if (
        isinstance(value, bool)
        or not isinstance(value, int | float)
        or not math.isfinite(value)
        or (threshold.integer and not float(value).is_integer())
        or not threshold.low <= value <= threshold.high
    ):
        raise InvalidRequest(
            f"guards.{name}.{key} must be {kind} from {threshold.low:g} to {threshold.high:g}.",
            param=param,
            code="invalid_value",
        )
    return _number(value, threshold)

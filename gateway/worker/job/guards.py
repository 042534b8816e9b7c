"""Guards while a job trains: the signals, as pure functions over the metrics the trainer reported, and the
hook that acts on them (`Guards`).

Each signal function takes the run's metrics points so far (the `data` of its `metrics` events, oldest
first, the newest the step just reported; a resumed job's include the steps its checkpoint kept) and a
guard's settings (`gateway.jobs.guards`), and returns a `Signal` with the numbers behind it when the guard
fires, else None. The hang is not a metric: `hang` is checked by the heartbeat, on the time since the trainer
last reported anything.

The worker (`gateway.worker.runner`) calls `Guards.on_metrics` for every metrics event and `Guards.on_beat`
each heartbeat. A firing guard acts once an attempt: `warn` adds an event (level `warn`); `pause` pauses the
job as its `max_cost` does (the trainer checkpoints, the job is resumable) with an event whose message starts
with `GUARD_PAUSED`; `rollback` pauses too, and once the trainer has gone the job is set to resume from the
checkpoint with the best validation number (`best_checkpoint`), when one has it. Every event's data carries
the guard, its action, its settings, the step and the signal's numbers. Resuming a job a guard paused is the
user's choice to go on: in later attempts that guard only warns.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gateway.jobs import guards as job_guards
from gateway.jobs import running
from gateway.jobs import store as jobs_store
from gateway.jobs.store import JobRow
from gateway.worker.context import JobContext
from gateway.worker.job.ingest import Progress

logger = logging.getLogger(__name__)

GUARD_PAUSED = "Paused by the guard"
"""The start of a guard's pause event (`Paused by the guard 'hang': ...`)."""
GUARD_WARNING = "Guard"
"""The start of a guard's warning event (`Guard 'length_runaway': ...`)."""
PRIMARY = {"reinforcement": ("reward_mean", True), "supervised": ("loss", False), "dpo": ("loss", False)}
"""The number validation and checkpoints are judged by per method, and whether higher is better (as the
trainer's `trainer.evaluation.PRIMARY`)."""
ERROR_RATES = ("grader_error_rate", "env_error_rate")
MISMATCH_KL = "mismatch/kl"
MISMATCH_RATIO = "mismatch/ratio_mean"
"""The trainer's sampler/trainer mismatch numbers the `sampler_mismatch` guard judges (`trainer.mismatch`)."""
Point = dict[str, Any]
"""One step's metrics (a `metrics` event's data)."""


@dataclass(frozen=True, slots=True)
class Signal:
    """A guard that fired: what it saw, in words and in numbers."""

    what: str
    numbers: dict[str, Any] = field(default_factory=dict)


def _number(point: Point, key: str) -> float | None:
    value = point.get(key)
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _finite(values: Sequence[float | None]) -> list[float]:
    return [v for v in values if v is not None and math.isfinite(v)]


# ---- the signals ----------------------------------------------------------------------------------------


def non_finite(points: Sequence[Point]) -> Signal | None:
    """The newest step's training loss or gradient norm is NaN or infinite (the trainer writes those as
    null: a key present without a number)."""
    last = points[-1]
    for key in ("train_loss", "grad_norm"):
        if key not in last:
            continue
        value = last[key]
        if value is None or (isinstance(value, int | float) and not math.isfinite(value)):
            return Signal(f"{key} is {value if value is not None else 'NaN or infinite'}", {key: value})
    return None


def explosion(
    points: Sequence[Point], *, factor: float, window: int, min_steps: int, kind: str = "supervised"
) -> Signal | None:
    """The newest gradient norm (and, but for reinforcement, whose loss sits near 0, the loss) exceeds
    `factor` times its median over the `window` steps before, once `min_steps` of them are known (zeros,
    steps that trained nothing, left out); the loss also above the attempt's first."""
    keys = ("grad_norm",) if kind == "reinforcement" else ("grad_norm", "train_loss")
    for key in keys:
        value = _number(points[-1], key)
        if value is None or not math.isfinite(value):
            continue
        before = [v for v in _finite([_number(p, key) for p in points[:-1]]) if v > 0][-window:]
        if len(before) < min_steps:
            continue
        median = statistics.median(before)
        # A loss near 0 late in training may jump many times over and still be low: a loss explodes only
        # above where the attempt started.
        started = _finite([_number(p, key) for p in points])[0]
        if value > factor * median and (key == "grad_norm" or value > started):
            return Signal(
                f"{key} {value:.4g} is {value / median:.1f} times its running median {median:.4g}",
                {key: value, "median": median, "ratio": round(value / median, 4), "steps": len(before)},
            )
    return None


def length_runaway(
    points: Sequence[Point], *, clipped_ratio: float, growth: float, steps: int
) -> Signal | None:
    """At least `clipped_ratio` of the completions cut at the limit, or their mean length `growth` times
    the median of the first three steps', at each of the last `steps` steps."""
    recent = points[-steps:]
    if len(recent) < steps:
        return None
    clipped = [_number(p, "completions/clipped_ratio") for p in recent]
    if all(c is not None and c >= clipped_ratio for c in clipped):
        return Signal(
            f"{clipped[-1]:.0%} of the completions were cut at the length limit ({steps} steps in a row)",
            {"clipped_ratio": clipped},
        )
    lengths = _finite([_number(p, "completion_length_mean") for p in points])
    if len(lengths) < steps + 3:
        return None
    baseline = statistics.median(lengths[:3])
    last = lengths[-steps:]
    if baseline > 0 and all(n >= growth * baseline for n in last):
        return Signal(
            f"the mean completion length grew from {baseline:.1f} to {last[-1]:.1f} tokens",
            {"completion_length_mean": last, "baseline": baseline},
        )
    return None


def entropy_collapse(points: Sequence[Point], *, fraction: float, steps: int) -> Signal | None:
    """The policy's entropy below `fraction` of the median of its first three steps', at each of the last
    `steps` steps."""
    values = _finite([_number(p, "entropy") for p in points])
    if len(values) < steps + 3 or _number(points[-1], "entropy") is None:
        return None
    baseline = statistics.median(values[:3])
    last = values[-steps:]
    if baseline > 0 and all(v < fraction * baseline for v in last):
        return Signal(
            f"the policy's entropy fell from {baseline:.4g} to {last[-1]:.4g}",
            {"entropy": last, "baseline": baseline},
        )
    return None


def sampler_mismatch(
    points: Sequence[Point], *, max_kl: float, min_ratio: float, max_ratio: float, steps: int
) -> Signal | None:
    """The policy that sampled and the one the trainer scores with differ: at each of the last `steps` steps
    that measure it (`mismatch/kl`, `mismatch/ratio_mean`: `trainer.mismatch`), the KL between them is above
    `max_kl` or their mean importance ratio is outside [`min_ratio`, `max_ratio`]."""
    measured = [(p, _number(p, MISMATCH_KL), _number(p, MISMATCH_RATIO)) for p in points]
    recent = [m for m in measured if m[1] is not None or m[2] is not None][-steps:]
    if len(recent) < steps or recent[-1][0] is not points[-1]:
        return None

    def off(kl: float | None, ratio: float | None) -> bool:
        return (kl is not None and not kl <= max_kl) or (
            ratio is not None and not min_ratio <= ratio <= max_ratio
        )

    if not all(off(kl, ratio) for _, kl, ratio in recent):
        return None
    last, kl, ratio = recent[-1]
    words = [f"KL {kl:.4g} per token"] if kl is not None else []
    words += [f"mean importance ratio {ratio:.4g}"] if ratio is not None else []
    return Signal(
        f"the sampler and the trainer disagree: {', '.join(words)} ({steps} steps in a row)",
        {
            "steps": [p.get("step") for p, _, _ in recent],
            "kl": [k for _, k, _ in recent],
            "ratio_mean": [r for _, _, r in recent],
            "logprob_diff_mean": [_number(p, "mismatch/logprob_diff_mean") for p, _, _ in recent],
            "ratio_min": _number(last, "mismatch/ratio_min"),
            "ratio_max": _number(last, "mismatch/ratio_max"),
        },
    )


def error_rate(points: Sequence[Point], *, max_rate: float, window: int) -> Signal | None:
    """The grader's or environment's error rate (`grader_error_rate`, `env_error_rate`: the share of a step's
    rewards that failed), averaged over the last `window` steps that report one, above `max_rate`, with
    failures at two or more of those steps."""
    rates = [max(found) for p in points if (found := _finite([_number(p, key) for key in ERROR_RATES]))][
        -window:
    ]
    if len(rates) < window or not any(_number(points[-1], key) is not None for key in ERROR_RATES):
        return None
    # One failed call into a sandbox (a timeout on a loaded machine) fails its whole batch: a rate needs
    # failures at two of the window's steps.
    if sum(rate > 0 for rate in rates) < min(2, window):
        return None
    mean = sum(rates) / len(rates)
    if mean > max_rate:
        return Signal(
            f"{mean:.1%} of the rewards failed over the last {len(rates)} steps",
            {"error_rate": mean, "rates": rates},
        )
    return None


def validation_divergence(points: Sequence[Point], *, evaluations: int, kind: str) -> Signal | None:
    """At each of the last `evaluations` evaluations the training number got better (its mean over the steps
    since the evaluation before) while the validation number (`valid_<primary>`) got worse."""
    primary, higher = PRIMARY.get(kind, PRIMARY["supervised"])
    train_key = "reward_mean" if primary == "reward_mean" else "train_loss"
    evals: list[tuple[int, float, float]] = []  # (step, validation, training mean since the one before)
    since: list[float] = []
    for p in points:
        train = _number(p, train_key)
        if train is not None and math.isfinite(train):
            since.append(train)
        valid = _number(p, f"valid_{primary}")
        if valid is not None and since:
            evals.append((int(p.get("step") or 0), valid, sum(since) / len(since)))
            since = []
    last = evals[-(evaluations + 1) :]
    if len(last) < evaluations + 1 or last[-1][0] != points[-1].get("step"):
        return None
    sign = 1 if higher else -1
    for (_, v0, t0), (_, v1, t1) in zip(last, last[1:], strict=False):
        if not (sign * (t1 - t0) > 0 and sign * (v1 - v0) < 0):
            return None
    word = "reward rose" if higher else "loss fell"
    return Signal(
        f"the training {word} while validation got worse at {evaluations} evaluation(s) in a row",
        {"steps": [e[0] for e in last], "validation": [e[1] for e in last], "training": [e[2] for e in last]},
    )


def hang(idle_s: float, *, seconds: float) -> Signal | None:
    """The trainer has reported nothing for more than `seconds`."""
    if idle_s <= seconds:
        return None
    return Signal(f"the trainer reported nothing for {idle_s:.0f} s", {"idle_s": round(idle_s, 3)})


def evaluate(points: Sequence[Point], settings: dict[str, dict[str, Any]], kind: str) -> dict[str, Signal]:
    """Every metrics guard that fires on the newest point, by name (the hang is the heartbeat's)."""

    def given(name: str) -> dict[str, Any]:
        return {k: v for k, v in settings[name].items() if k != "action"}

    checks: dict[str, Callable[[], Signal | None]] = {
        "non_finite": lambda: non_finite(points),
        "explosion": lambda: explosion(points, **given("explosion"), kind=kind),
        "length_runaway": lambda: length_runaway(points, **given("length_runaway")),
        "entropy_collapse": lambda: entropy_collapse(points, **given("entropy_collapse")),
        "sampler_mismatch": lambda: sampler_mismatch(points, **given("sampler_mismatch")),
        "error_rate": lambda: error_rate(points, **given("error_rate")),
        "validation_divergence": lambda: validation_divergence(
            points, **given("validation_divergence"), kind=kind
        ),
    }
    fired = {}
    for name, check in checks.items():
        if settings[name]["action"] == "off":
            continue
        signal = check()
        if signal is not None:
            fired[name] = signal
    return fired


def best_checkpoint(checkpoints: Sequence[tuple[int, dict[str, Any] | None]], kind: str) -> int | None:
    """The step of the checkpoint with the best full validation number (`full_valid_<primary>`) among
    `(step, metrics)`; None when none has one."""
    primary, higher = PRIMARY.get(kind, PRIMARY["supervised"])
    scored = [
        (value, step)
        for step, metrics in checkpoints
        if (value := _number(metrics or {}, f"full_valid_{primary}")) is not None and math.isfinite(value)
    ]
    if not scored:
        return None
    return (max if higher else min)(scored, key=lambda s: s[0])[1]


# ---- the hook ---------------------------------------------------------------------------------------------


class Guards:
    """One attempt's guards: evaluates them and acts (`pause` is the caller's: it pauses the job and stops
    its trainer, returning whether it did)."""

    def __init__(
        self,
        ctx: JobContext[JobRow],
        *,
        progress: Progress,
        pause: Callable[[str, str, dict[str, Any]], Awaitable[bool]],
    ) -> None:
        self.ctx = ctx
        self.progress = progress
        self.pause = pause
        self.kind = ctx.row.method.type
        self.settings = job_guards.resolve(None, ctx.row.guards, method=self.kind)
        self.points: list[Point] = []
        self.acted: set[str] = set()
        """Guards that acted in this attempt (each acts once an attempt)."""
        self.resumed_past: set[str] | None = None
        """Guards that paused an earlier attempt, the job resumed since: they only warn now."""
        self.rollback_to: int | None = None
        """A rollback's checkpoint step, set on the job once the trainer has gone (`roll_back`)."""

    async def on_metrics(self, data: dict[str, Any]) -> bool:
        """Evaluate the guards on a step's metrics; True when one paused the job. A resumed job's guards
        judge the steps it kept from its earlier attempts too (running medians and baselines are the run's,
        not one or two steps')."""
        step = data.get("step")
        if not self.points and self.ctx.row.attempts > 1 and isinstance(step, int):
            self.points = await running.metrics_before(self.ctx.pool, job_id=self.ctx.id, step=step)
        if self.points and self.points[-1].get("step") == step:
            self.points[-1] = data  # the same event again (its recording was retried)
        else:
            self.points.append(data)
        fired = evaluate(self.points, self.settings, self.kind)
        paused = False
        for name, signal in fired.items():
            if not paused:
                paused = await self._act(name, signal)
        return paused

    async def on_beat(self) -> bool:
        """The hang guard, each heartbeat; True when it paused the job."""
        settings = self.settings["hang"]
        since = self.progress.event_mono or self.progress.started_mono
        if settings["action"] == "off" or since is None:
            return False
        signal = hang(time.monotonic() - since, seconds=settings["seconds"])
        return signal is not None and await self._act("hang", signal)

    async def _act(self, name: str, signal: Signal) -> bool:
        if name in self.acted:
            return False
        action = self.settings[name]["action"]
        if self.resumed_past is None:
            self.resumed_past = await running.guards_paused(self.ctx.pool, job_id=self.ctx.id)
        if name in self.resumed_past and action in ("pause", "rollback"):
            action = "warn"
        step = self.progress.step
        data: dict[str, Any] = {
            "guard": name,
            "action": action,
            "step": step,
            "settings": {k: v for k, v in self.settings[name].items() if k != "action"},
            "signal": signal.numbers,
        }
        best = await self._best_step() if action == "rollback" else None
        if action == "rollback":
            data["resume_from_step"] = best
        if action == "warn":
            await jobs_store.add_event(
                self.ctx.pool,
                job_id=self.ctx.id,
                org_id=self.ctx.org_id,
                level="warn",
                message=f"{GUARD_WARNING} '{name}': {signal.what} (step {step})",
                data=data,
                dedup_key=f"guard:{name}:{self.ctx.row.attempts}",
            )
            self.acted.add(name)
            logger.info("job %s: guard %s warns: %s", self.ctx.id, name, signal.what)
            return False
        message = f"{GUARD_PAUSED} '{name}': {signal.what} (step {step})"
        if action == "rollback":
            message += (
                f"; it resumes from the checkpoint of step {best}, the best on validation"
                if best is not None
                else "; no checkpoint has validation numbers, so it resumes from the latest"
            )
        paused = await self.pause(message, f"guard_paused:{name}", data)
        self.acted.add(name)
        if paused:
            self.rollback_to = best
            logger.info("job %s: guard %s paused it: %s", self.ctx.id, name, signal.what)
        return paused

    async def _best_step(self) -> int | None:
        found = await running.checkpoint_metrics(self.ctx.pool, job_id=self.ctx.id)
        return best_checkpoint(found, self.kind)

    async def roll_back(self) -> None:
        """After a rollback's pause, once the trainer has gone: resume from the chosen checkpoint."""
        if self.rollback_to is not None:
            await running.resume_from_step(self.ctx.pool, job_id=self.ctx.id, step=self.rollback_to)

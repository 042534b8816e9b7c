"""`tunegate jobs follow`: watch a fine-tuning job through the public API until it ends.

Polls the job and its events with the `openai` SDK, draws a live progress bar (step / total, reward, loss),
prints the job's messages as they arrive, and returns the job's last state with every metrics point seen.
Before a job is created, `estimate_job` and `print_estimate` show what it will cost
(`POST /v1/fine_tuning/jobs/estimate`); following prints the job's cost, projected and accrued.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import openai
    from openai.types.fine_tuning import FineTuningJob, FineTuningJobEvent
    from rich.console import Console

logger = logging.getLogger(__name__)

TERMINAL_STATES = frozenset({"succeeded", "failed", "cancelled"})
REWARD_KEY = "reward_mean"
"""Metrics field of the mean reward of a step (reinforcement jobs)."""
LOSS_KEY = "train_loss"
"""Metrics field of the training loss of a step."""
VALID_KEYS = ("valid_reward_mean", "valid_loss")
"""Metrics fields of the latest evaluation on the validation file (reinforcement, else loss)."""


@dataclass
class FollowResult:
    """What following a job saw."""

    job: FineTuningJob
    """The job as last retrieved (a terminal state unless following timed out)."""
    metrics: list[dict[str, Any]] = field(default_factory=list)
    """The `data` of every `metrics` event, one per step, ordered by step."""
    messages: list[str] = field(default_factory=list)
    """The text of every other event, oldest first."""

    def series(self, key: str) -> tuple[list[int], list[float]]:
        """(steps, values) of one metric over the steps that report it."""
        steps, values = [], []
        for point in self.metrics:
            value = point.get(key)
            if isinstance(value, int | float):
                steps.append(int(point["step"]))
                values.append(float(value))
        return steps, values


def new_events(client: openai.OpenAI, job_id: str, seen: set[str]) -> list[FineTuningJobEvent]:
    """Events of the job not in `seen` (which is updated), oldest first. The API lists newest first, so
    pages are read until an already seen event turns up."""
    fresh: list[FineTuningJobEvent] = []
    page = client.fine_tuning.jobs.list_events(job_id, limit=100)
    while True:
        hit_seen = False
        for event in page.data:
            if event.id in seen:
                hit_seen = True
                break
            fresh.append(event)
        if hit_seen or not page.has_next_page():
            break
        page = page.get_next_page()
    seen.update(e.id for e in fresh)
    fresh.reverse()
    return fresh


def _fmt(value: Any) -> str:
    return f"{value:.4f}" if isinstance(value, int | float) else "—"


def _latest_validation(by_step: dict[int, dict[str, Any]]) -> str:
    """`valid <name> <value>` of the latest step that was evaluated (empty without evaluations)."""
    for step in sorted(by_step, reverse=True):
        for key in VALID_KEYS:
            if isinstance(by_step[step].get(key), int | float):
                return f"{key.removeprefix('valid_').removesuffix('_mean')} (valid) {by_step[step][key]:.4f}"
    return ""


def estimate_job(client: openai.OpenAI, **body: Any) -> dict[str, Any] | None:
    """The gateway's estimate of a job create with this body (None when the gateway gives none)."""
    import openai

    try:
        found = client.post("/fine_tuning/jobs/estimate", body=body, cast_to=object)
    except openai.APIError as exc:
        logger.warning("no estimate of the job: %s", exc)
        return None
    return found if isinstance(found, dict) else None


def _usd(value: Any) -> str:
    return f"${value:.4f}" if isinstance(value, int | float) else "?"


def print_estimate(console: Console, estimate: dict[str, Any]) -> None:
    """An estimate in three lines: steps and tokens, cost low / expected / high, and the budget."""
    tokens = estimate.get("tokens") or {}
    trained, sampled = tokens.get("trained") or {}, tokens.get("sampled") or {}
    line = f"estimate: {estimate.get('steps')} steps, {trained.get('expected', 0):,.0f} trained tokens"
    if sampled.get("high"):
        line += f" ({sampled.get('expected', 0):,.0f} sampled)"
    console.print(line, highlight=False)
    cost = estimate.get("cost") or {}
    console.print(
        f"cost: {_usd(cost.get('expected'))} expected ({_usd(cost.get('low'))} to {_usd(cost.get('high'))})",
        highlight=False,
    )
    budget = estimate.get("budget") or {}
    allowed = "fits" if estimate.get("allowed") else "[red]does not fit[/red]"
    if budget.get("left_usd") is not None:
        console.print(f"budget left: {_usd(budget['left_usd'])} ({allowed})", highlight=False)
    if budget.get("api_key_left_usd") is not None:
        console.print(
            f"this key's spend limit left: {_usd(budget['api_key_left_usd'])} ({allowed})", highlight=False
        )


def _cost_line(job: FineTuningJob) -> str | None:
    cost = (job.model_extra or {}).get("cost")
    if not isinstance(cost, dict):
        return None
    return f"cost: {_usd(cost.get('accrued'))} so far, {_usd(cost.get('projected_total'))} projected"


def follow_job(
    client: openai.OpenAI,
    job_id: str,
    *,
    console: Console | None = None,
    poll_s: float = 1.0,
    timeout_s: float | None = None,
) -> FollowResult:
    """Follow `job_id` until it is succeeded, failed or cancelled (or `timeout_s` passes); shows progress
    on `console` and returns what was seen."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    console = console or Console()
    seen: set[str] = set()
    by_step: dict[int, dict[str, Any]] = {}
    messages: list[str] = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    progress = Progress(
        TextColumn("[bold]{task.description}"),
        BarColumn(),
        TextColumn("step {task.completed:.0f}/{task.fields[total_text]}"),
        TextColumn("reward {task.fields[reward]}"),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[valid]}"),
        TimeElapsedColumn(),
        console=console,
    )
    job = client.fine_tuning.jobs.retrieve(job_id)
    if job.status not in TERMINAL_STATES and (line := _cost_line(job)) is not None:
        console.print(line, highlight=False)
    with progress:
        task = progress.add_task(job.status, total=None, total_text="?", reward="—", loss="—", valid="")
        while True:
            for event in new_events(client, job_id, seen):
                if event.type == "metrics" and isinstance(event.data, dict) and "step" in event.data:
                    by_step[int(event.data["step"])] = dict(event.data)
                else:
                    messages.append(event.message)
                    progress.console.print(f"[dim]{event.level}[/dim] {event.message}", highlight=False)
            if by_step:
                last = by_step[max(by_step)]
                total = last.get("total_steps")
                progress.update(
                    task,
                    completed=int(last["step"]),
                    total=int(total) if isinstance(total, int) else None,
                    total_text=str(total) if total is not None else "?",
                    reward=_fmt(last.get(REWARD_KEY)),
                    loss=_fmt(last.get(LOSS_KEY)),
                    valid=_latest_validation(by_step),
                )
            progress.update(task, description=job.status)
            if job.status in TERMINAL_STATES:
                break
            if deadline is not None and time.monotonic() > deadline:
                logger.warning("stopped following %s after %.0fs (still %s)", job_id, timeout_s, job.status)
                break
            time.sleep(poll_s)
            job = client.fine_tuning.jobs.retrieve(job_id)
    result = FollowResult(job=job, metrics=[by_step[s] for s in sorted(by_step)], messages=messages)
    print_outcome(console, result)
    return result


def print_outcome(console: Console, result: FollowResult) -> None:
    """The final status, the fine-tuned model and any error."""
    job = result.job
    colour = {"succeeded": "green", "failed": "red", "cancelled": "yellow"}.get(job.status, "white")
    console.print(f"job {job.id}: [bold {colour}]{job.status}[/]", highlight=False)
    if job.fine_tuned_model:
        console.print(f"fine-tuned model: {job.fine_tuned_model}", highlight=False)
    if job.trained_tokens:
        console.print(f"trained tokens: {job.trained_tokens}", highlight=False)
    if (line := _cost_line(job)) is not None:
        console.print(line, highlight=False)
    if job.error is not None and (job.error.code or job.error.message):
        console.print(f"[red]error {job.error.code}[/red]: {job.error.message}", highlight=False)

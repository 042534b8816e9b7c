"""What a `tunegate quickstart` run (`tunegate.quickstart`) found, and how it is told: the held-out answers
of the base and the fine-tuned model, the train and validation reward curves (sparklines in the terminal, a
PNG in the data dir), and where everything lives (data dir, keys, job, model, eval, the job's dashboard page).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tunegate.client import root_url

if TYPE_CHECKING:
    from rich.console import Console

    from tunegate.follow import FollowResult

BASE_MODEL = "tiny-chat"
"""The base model the quickstart trains (its answers' column)."""


@dataclass
class QuickstartReport:
    """Where everything lives after a quickstart run, and what training did."""

    data_dir: Path
    base_url: str
    org_id: str = ""
    api_key: str = ""
    job_id: str = ""
    fine_tuned_model: str | None = None
    rewards: list[float] = field(default_factory=list)
    """Mean training reward per step."""
    valid_rewards: list[float] = field(default_factory=list)
    """Mean validation reward (greedy answers to the held-out problems) at each evaluation, step 0 first."""
    eval_id: str = ""
    base_exact: float = 0.0
    """Share of held-out problems the base model answers exactly."""
    tuned_exact: float = 0.0
    """Share of held-out problems the fine-tuned model answers exactly."""
    png: Path | None = None
    answers: list[tuple[str, str, str, str]] = field(default_factory=list)
    """(question, right answer, base answer, fine-tuned answer) per held-out problem."""
    started_stack: bool = False
    engine: str = ""
    """What serves the base model and how to choose the other engine (a stack started here only)."""
    stack_start_s: float = 0.0
    """Seconds from starting the stack to its being ready (a stack started here only)."""


def print_heldout(console: Console, report: QuickstartReport) -> None:
    """The first held-out answers of both models as a table, then both models' share of exact answers."""
    from rich.table import Table

    table = Table("question", "answer", BASE_MODEL, "fine-tuned")
    for row in report.answers[:10]:
        table.add_row(*row)
    console.print(table)
    console.print(
        f"[bold]held-out exact answers: base {report.base_exact:.0%} -> fine-tuned {report.tuned_exact:.0%}"
        "[/bold]",
        highlight=False,
    )


def show_rewards(console: Console, report: QuickstartReport, result: FollowResult) -> None:
    """Keep the job's mean train and validation rewards in `report`, print them as sparklines and draw them
    in `reward.png` under the data dir's `quickstart` folder."""
    from tunegate.plot import save_curves, sparkline

    steps, report.rewards = result.series("reward_mean")
    valid_steps, report.valid_rewards = result.series("valid_reward_mean")
    if report.rewards:
        console.rule("reward per step")
        console.print(
            f"train      {report.rewards[0]:.3f} {sparkline(report.rewards)} {report.rewards[-1]:.3f}",
            highlight=False,
        )
        if report.valid_rewards:
            console.print(
                f"validation {report.valid_rewards[0]:.3f} {sparkline(report.valid_rewards)} "
                f"{report.valid_rewards[-1]:.3f}",
                highlight=False,
            )
        report.png = save_curves(
            [
                ("train (sampled)", steps, report.rewards),
                ("held-out (greedy)", valid_steps, report.valid_rewards),
            ],
            report.data_dir / "quickstart" / "reward.png",
            title=(
                f"{BASE_MODEL} learns arithmetic: held-out exact {report.base_exact:.0%} -> "
                f"{report.tuned_exact:.0%}"
            ),
            ylabel="mean reward",
        )


def print_summary(console: Console, report: QuickstartReport, keep_running: bool) -> None:
    """Where everything lives."""
    lines = [
        f"data dir:         {report.data_dir}",
        f"admin key file:   {report.data_dir / 'admin_key'}",
        f"gateway:          {report.base_url}",
        f"organisation:     {report.org_id}",
        f"API key:          {report.api_key}",
        f"job:              {report.job_id}",
        f"fine-tuned model: {report.fine_tuned_model}",
        f"held-out eval:    {report.eval_id}",
    ]
    if report.png is not None:
        lines.append(f"reward curves:    {report.png}")
    if report.engine:
        lines.append(f"engine:           {report.engine}")
    if report.started_stack:
        lines.append(f"stack log:        {report.data_dir / 'stack.log'}")
        lines.append("the stack is still running" if keep_running else "the stack was stopped")
    console.rule("where everything lives")
    console.print("\n".join(lines), highlight=False)
    if report.job_id:  # last, on one line however narrow: the job in the browser (sign in with the API key)
        url = f"{root_url(report.base_url)}/dashboard/jobs/{report.job_id}"
        console.print(f"dashboard:        {url}", highlight=False, soft_wrap=True)

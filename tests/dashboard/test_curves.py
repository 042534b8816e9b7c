"""The job page's curves of a long job: thinned evenly, never losing the first or the last step."""

from __future__ import annotations

from gateway.dashboard.router import curves


def test_short_jobs_keep_every_step_and_long_ones_are_thinned() -> None:
    rows = [{"step": s, "train_loss": 1 / s} for s in range(1, 10_001)]
    assert curves(rows[:2000], 2000) == (1, rows[:2000])
    stride, kept = curves(rows, 2000)
    assert stride == 5 and len(kept) == 2001
    steps = [r["step"] for r in kept]
    assert steps[0] == 1 and steps[-1] == 10_000 and steps[1:-1] == list(range(6, 10_000, 5))
    stride, kept = curves(rows[:2001], 2000)  # one over: every second step, and the last
    assert stride == 2 and [r["step"] for r in kept][-2:] == [1999, 2001]

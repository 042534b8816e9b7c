"""Reward curves: a unicode sparkline for the terminal and a PNG (matplotlib, Agg backend)."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from pathlib import Path

logger = logging.getLogger(__name__)

BARS = "▁▂▃▄▅▆▇█"


def resample(values: Sequence[float], width: int) -> list[float]:
    """At most `width` values: means of consecutive buckets when there are more."""
    finite = [float(v) for v in values if math.isfinite(v)]
    if len(finite) <= width:
        return finite
    out = []
    for i in range(width):
        lo, hi = i * len(finite) // width, (i + 1) * len(finite) // width
        bucket = finite[lo:hi] or [finite[lo]]
        out.append(sum(bucket) / len(bucket))
    return out


def sparkline(values: Sequence[float], width: int = 60) -> str:
    """One line of block characters, lowest value `▁`, highest `█` (all `▄` when flat; empty for none)."""
    points = resample(values, width)
    if not points:
        return ""
    lo, hi = min(points), max(points)
    if hi - lo < 1e-12:
        return BARS[3] * len(points)
    scale = (len(BARS) - 1) / (hi - lo)
    return "".join(BARS[round((v - lo) * scale)] for v in points)


Series = tuple[str, Sequence[int], Sequence[float]]
"""A labelled curve: (label, steps, values)."""


def save_curve(steps: Sequence[int], values: Sequence[float], path: Path, *, title: str, ylabel: str) -> Path:
    """Draw `values` against `steps` into a PNG at `path`; returns the path."""
    return save_curves([("", steps, values)], path, title=title, ylabel=ylabel)


def save_curves(series: Sequence[Series], path: Path, *, title: str, ylabel: str) -> Path:
    """Draw several labelled curves on one set of axes into a PNG at `path`; returns the path."""
    import matplotlib

    matplotlib.use("Agg")
    from matplotlib import pyplot as plt

    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(7, 3.5), dpi=100)
    try:
        for label, steps, values in series:
            ax.plot(list(steps), list(values), marker="o", markersize=3, linewidth=1.5, label=label or None)
        if any(label for label, _, _ in series):
            ax.legend(loc="best")
        ax.set_xlabel("step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(True, alpha=0.3)
        fig.tight_layout()
        fig.savefig(path)
    finally:
        plt.close(fig)
    return path

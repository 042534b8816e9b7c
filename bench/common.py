"""What every bench shares: the machine description, percentile maths, pinning to a core, CPU time of a
process. Ports and waits are `tunegate.processes`' (`free_port`, `wait_port`), named here too."""

from __future__ import annotations

import os
import platform
import statistics
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any

from tunegate.processes import free_port as free_port
from tunegate.processes import wait_port as wait_port

ROOT = Path(__file__).resolve().parents[1]
RESULTS_DIR = ROOT / "bench" / "results"
CLK_TCK = os.sysconf("SC_CLK_TCK")


@dataclass(frozen=True)
class Options:
    """How a bench run is sized."""

    quick: bool = False
    """Seconds instead of minutes: tiny loads, few steps (the smoke test's mode)."""
    workdir: Path = RESULTS_DIR / "work"
    """Scratch directory (models, adapters, databases' blobs)."""
    profile: bool = False
    """Also sample the gateway with py-spy under load and report where its time goes."""
    venv_dir: Path | None = None
    """Where environment packages' venvs are built and kept (`formats`); None: under `workdir`. A cache
    kept from an earlier run (or shared with a stack's `TUNEGATE_ENV_VENV_DIR`) spares building them again."""


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` so far (from /proc/<pid>/stat)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    # after the command name: state is field 3, utime 14 and stime 15 (1-based) -> 11, 12 here
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def tree_cpu_seconds(pid: int) -> float:
    """User + system CPU time so far of process `pid` and every live process below it (a server's pool
    processes do its work too)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    total, todo = 0.0, [pid]
    while todo:
        current = todo.pop()
        try:
            total += cpu_seconds(current)
        except OSError:
            continue
        todo.extend(children.get(current, []))
    return total


def steal_seconds(core: int | None) -> float:
    """Time the hypervisor ran something else while `core` (all cores for None) wanted to run, so far
    (`steal` in /proc/stat; 0 on machines that do not report it)."""
    name = "cpu" if core is None else f"cpu{core}"
    for line in Path("/proc/stat").read_text().splitlines():
        fields = line.split()
        if fields and fields[0] == name and len(fields) > 8:
            return int(fields[8]) / CLK_TCK
    return 0.0


def percentile(values: list[float], q: float) -> float:
    """The `q`-th percentile (0-100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    if len(ordered) == 1:
        return ordered[0]
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def summary_ms(seconds: list[float]) -> dict[str, float]:
    """p50/p99/mean of durations given in seconds, in milliseconds."""
    return {
        "p50_ms": percentile(seconds, 50) * 1000,
        "p99_ms": percentile(seconds, 99) * 1000,
        "mean_ms": (statistics.fmean(seconds) * 1000) if seconds else float("nan"),
        "n": len(seconds),
    }


def fmt(value: Any, spec: str = ".2f") -> str:
    """`value` formatted with `spec`, or `-` for None (a figure a run did not produce)."""
    return "-" if value is None else format(value, spec)


def ratio(a: float, b: float) -> float | None:
    """a / b, or None when b is zero or not a number."""
    if not b or b != b:
        return None
    return a / b


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine a report was measured on."""
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "versions": {
            d: _version(d)
            for d in ("tunegate", "torch", "transformers", "trl", "peft", "fastapi", "uvicorn", "httpx")
        },
    }


def pin(core: int | None) -> list[str]:
    """What goes before a command to run it on `core`: `taskset -c core` when taskset exists and the core is
    usable, else nothing."""
    if core is None or core not in os.sched_getaffinity(0):
        return []
    from shutil import which

    if which("taskset") is None:
        return []
    return ["taskset", "-c", str(core)]


def pinned(cmd: list[str], core: int | None) -> list[str]:
    """`cmd` run on `core` (see `pin`)."""
    return [*pin(core), *cmd]


def cores() -> tuple[int | None, int | None]:
    """(server core, load-generator core): two distinct cores when there are two, else (None, None)."""
    usable = sorted(os.sched_getaffinity(0))
    if len(usable) < 2:
        return None, None
    return usable[0], usable[1]

"""Where a process spends its time under load: py-spy samples (`py-spy record --format raw`, collapsed
stacks) summarised as the frames with the most samples of their own and the project's functions with the
most samples below them.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

PACKAGES = ("gateway/", "inference/", "envsdk/", "trainer/")
"""Frames from these count as the project's own."""


def py_spy() -> str | None:
    """The py-spy executable: next to this Python (the dev install has it) or on PATH."""
    beside = Path(sys.executable).parent / "py-spy"
    return str(beside) if beside.exists() else shutil.which("py-spy")


def start(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes] | None:
    """Sample `pid` for `seconds` at 500 Hz into `out`; None when py-spy is missing or may not attach."""
    exe = py_spy()
    if exe is None:
        logger.warning("py-spy is not installed; no profile")
        return None
    cmd = [exe, "record", "-p", str(pid), "-d", str(max(1, round(seconds))), "-r", "500"]
    cmd += ["-f", "raw", "-o", str(out), "--nonblocking"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def finish(proc: subprocess.Popen[bytes] | None, out: Path, top: int = 15) -> dict[str, Any] | None:
    """Wait for `start`'s sampler and summarise its file (None when it produced nothing)."""
    if proc is None:
        return None
    _, err = proc.communicate(timeout=120)
    if proc.returncode != 0 or not out.exists():
        logger.warning("py-spy failed: %s", err.decode(errors="replace")[-500:])
        return None
    return summarize(out, top)


def _short(frame: str) -> str:
    """`func (path/to/file.py:12)` -> `func (file.py:12)` for site-packages, the project's path kept."""
    name, _, where = frame.partition(" (")
    where = where.rstrip(")")
    if "site-packages/" in where:
        where = where.split("site-packages/", 1)[1]
    return f"{name} ({where})" if where else name


def summarize(path: Path, top: int = 15) -> dict[str, Any]:
    """Per frame: share of samples spent in it (self) and, for the project's functions, below it."""
    own: Counter[str] = Counter()
    below: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        n = int(count)
        total += n
        frames = stack.split(";")
        own[_short(frames[-1])] += n
        for frame in {f.split(":")[0] + ")" if ":" in f else f for f in frames}:
            if any(p in frame for p in PACKAGES):
                below[_short(frame)] += n
    share = (lambda n: round(100 * n / total, 1)) if total else (lambda n: 0.0)
    return {
        "file": str(path),
        "samples": total,
        "self": [[share(n), f] for f, n in own.most_common(top)],
        "project_inclusive": [[share(n), f] for f, n in below.most_common(top)],
    }

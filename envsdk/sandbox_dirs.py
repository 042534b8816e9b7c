"""Host directories of sandboxes: each names the process that owns it, so those of dead processes can be
told from live ones and removed (a worker killed while a sandbox ran leaves its scratch behind).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

logger = logging.getLogger(__name__)

_OWNED = re.compile(r"^envsdk-[a-z]+-(\d+)\.(\d+)-")
_stale_checked = False


def _start_ticks(pid: int) -> int | None:
    """When process ``pid`` started (clock ticks since boot), None when there is no such process."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return int(stat.rsplit(")", 1)[1].split()[19])


def owned_tempdir(kind: str) -> Path:
    """A fresh temporary directory whose name says which process owns it (``envsdk-<kind>-<pid>.<start>-``),
    so that :func:`remove_stale_dirs` can tell the directories of dead processes from live ones."""
    ticks = _start_ticks(os.getpid()) or 0
    return Path(tempfile.mkdtemp(prefix=f"envsdk-{kind}-{os.getpid()}.{ticks}-"))


@contextlib.contextmanager
def owned_workdir(kind: str) -> Iterator[Path]:
    """:func:`owned_tempdir`, removed when the block ends (and by :func:`remove_stale_dirs` when its
    process dies first)."""
    path = owned_tempdir(kind)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def remove_stale_dirs(root: Path | None = None) -> int:
    """Remove the directories :func:`owned_tempdir` made for processes that are gone (a worker killed while a
    sandbox ran leaves its scratch behind). Returns how many it removed; run at a process's start."""
    root = Path(root or tempfile.gettempdir())
    removed = 0
    try:
        entries = list(root.iterdir())
    except OSError:
        return 0
    for entry in entries:
        match = _OWNED.match(entry.name)
        if match is None:
            continue
        try:
            if not entry.is_dir() or entry.is_symlink() or entry.stat().st_uid != os.geteuid():
                continue
        except OSError:
            continue
        pid, ticks = int(match.group(1)), int(match.group(2))
        if _start_ticks(pid) == ticks:
            continue  # its owner is alive
        shutil.rmtree(entry, ignore_errors=True)
        removed += 1
    if removed:
        logger.info("removed %d sandbox directories left by processes that are gone", removed)
    return removed


def remove_stale_once() -> None:
    """:func:`remove_stale_dirs`, the first time a process starts a sandbox."""
    global _stale_checked
    if not _stale_checked:
        _stale_checked = True
        remove_stale_dirs()

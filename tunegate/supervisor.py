"""`Supervisor`: child processes kept running, each started again when it exits, with backoff (the worker
and the engine of `tunegate up`)."""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import TypeVar

from tunegate.processes import Process

logger = logging.getLogger(__name__)

P = TypeVar("P", bound=Process)


@dataclass
class _Watched:
    process: Process
    restarts: int = 0
    """How many times it was started again."""
    backoff_s: float = 0.0
    """The pause before the next start, after an exit."""
    due_at: float | None = None
    """When it is to be started again (None while it runs)."""


class Supervisor:
    """Starts watched processes again when they exit.

    A process that exits is started again after a pause that doubles with each exit in a row
    (`min_backoff_s` up to `max_backoff_s`) and starts over once the process has run `stable_after_s`. The
    watch runs in a thread of its own; `stop()` ends it and stops every process (SIGTERM to all, then
    SIGKILL to what is left after `stop_timeout_s`). Watched processes are best made with
    `die_with_parent`, so that they end if their parent dies without stopping them.
    """

    def __init__(
        self,
        *,
        check_every_s: float = 0.5,
        min_backoff_s: float = 1.0,
        max_backoff_s: float = 30.0,
        stable_after_s: float = 60.0,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.check_every_s = check_every_s
        self.min_backoff_s = min_backoff_s
        self.max_backoff_s = max_backoff_s
        self.stable_after_s = stable_after_s
        self.stop_timeout_s = stop_timeout_s
        self._watched: list[_Watched] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, process: P) -> P:
        """Watch a started process from now on; returns it."""
        with self._lock:
            self._watched.append(_Watched(process))
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="supervisor", daemon=True)
            self._thread.start()
        return process

    def _run(self) -> None:
        while not self._stopping.wait(self.check_every_s):
            with self._lock:
                if self._stopping.is_set():
                    return
                for watched in self._watched:
                    self._check(watched)

    def _check(self, watched: _Watched) -> None:
        process = watched.process
        now = time.monotonic()
        if watched.due_at is None:
            code = process.poll()
            if code is None:
                return
            if now - process.started_at >= self.stable_after_s:
                watched.backoff_s = self.min_backoff_s
            else:
                watched.backoff_s = min(self.max_backoff_s, max(self.min_backoff_s, watched.backoff_s * 2))
            watched.due_at = now + watched.backoff_s
            logger.warning(
                "%s exited with code %s; starting it again in %.0f s", process.name, code, watched.backoff_s
            )
        if now >= watched.due_at:
            watched.restarts += 1
            watched.due_at = None
            process.respawn()
            logger.info("%s started again (restart %d, pid %d)", process.name, watched.restarts, process.pid)

    def stop(self) -> None:
        """Stop watching, then stop every process."""
        with self._lock:
            self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        for watched in self._watched:
            watched.process.terminate()
        for watched in self._watched:
            watched.process.stop(self.stop_timeout_s)

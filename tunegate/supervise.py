"""The children of `tunegate up` (the worker, the engine), kept running.

A child that exits while the stack is up is started again after a pause that doubles with each exit in a
row (`min_backoff_s` up to `max_backoff_s`) and starts over once the child has run `stable_after_s`. The
watch runs in a thread of its own, beside the gateway's event loop; `stop()` ends it and stops every child
(SIGTERM, then SIGKILL after `stop_timeout_s`). Children run in sessions of their own, so that a Ctrl-C
reaches only `tunegate up`, which stops them in order; they get SIGTERM if it dies.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import subprocess
import threading
import time
from dataclasses import dataclass

logger = logging.getLogger(__name__)


def _terminate_with_parent() -> None:
    """In the child before `exec`: SIGTERM when the thread that started it ends (`tunegate up` died)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


@dataclass
class Child:
    """One supervised process."""

    name: str
    argv: list[str]
    env: dict[str, str] | None = None
    proc: subprocess.Popen[bytes] | None = None
    started_at: float = 0.0
    """Monotonic time of the current process's start."""
    restarts: int = 0
    """How many times it was started again."""
    backoff_s: float = 0.0
    """The pause before the next start, after an exit."""
    due_at: float | None = None
    """When it is to be started again (None while it runs)."""

    def spawn(self) -> None:
        self.proc = subprocess.Popen(
            self.argv, env=self.env, start_new_session=True, preexec_fn=_terminate_with_parent
        )
        self.started_at = time.monotonic()
        self.due_at = None


class Supervisor:
    """Starts children and starts them again when they exit."""

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
        self.children: list[Child] = []
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, name: str, argv: list[str], env: dict[str, str] | None = None) -> Child:
        """Start a child now and watch it from then on."""
        child = Child(name, argv, env)
        with self._lock:
            child.spawn()
            self.children.append(child)
        if self._thread is None:
            self._thread = threading.Thread(target=self._watch, name="supervisor", daemon=True)
            self._thread.start()
        return child

    def _watch(self) -> None:
        while not self._stopping.wait(self.check_every_s):
            with self._lock:
                if self._stopping.is_set():
                    return
                for child in self.children:
                    self._check(child)

    def _check(self, child: Child) -> None:
        assert child.proc is not None
        now = time.monotonic()
        if child.due_at is None:
            code = child.proc.poll()
            if code is None:
                return
            if now - child.started_at >= self.stable_after_s:
                child.backoff_s = self.min_backoff_s
            else:
                child.backoff_s = min(self.max_backoff_s, max(self.min_backoff_s, child.backoff_s * 2))
            child.due_at = now + child.backoff_s
            logger.warning(
                "%s exited with code %s; starting it again in %.0f s", child.name, code, child.backoff_s
            )
        if now >= child.due_at:
            child.restarts += 1
            child.spawn()
            logger.info("%s started again (restart %d, pid %d)", child.name, child.restarts, child.proc.pid)

    def stop(self) -> None:
        """Stop watching, then stop every child: SIGTERM, and SIGKILL what is left after the timeout."""
        with self._lock:
            self._stopping.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        procs = [c.proc for c in self.children if c.proc is not None]
        for proc in procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in procs:
            try:
                proc.wait(timeout=self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

"""Running a server of a stack: a child process started, waited for until it serves, and stopped; or a
server in a thread of this process.

- `Process`: one child process, in a session of its own (a Ctrl-C reaches only its parent, which stops it in
  order), its output in a log file or its parent's. `wait_port` and `wait_http` block until it serves,
  failing early when it exits; `stop` sends SIGTERM, then SIGKILL to its process group after
  `stop_timeout_s`.
- `free_port` and `wait_port`: a free port for a server, and the wait for one started some other way.
- `ServerThread`: a uvicorn server in a thread of this process instead, for callers that read the app's
  state (the tests' gateways and engines).

tunegate's own processes (gateway, worker, env server, engine) are `tunegate.role_processes`; the
`Supervisor` that starts them again when they exit is `tunegate.supervisor`. `tunegate up`
(`tunegate.stack`), the test fixtures (`tests/support`) and the benches (`bench/stack.py`) start their stacks
with these and with `tunegate.services` (PostgreSQL and Redis).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self

import httpx

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def _listens(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def _answers(url: str, status: int | None) -> bool:
    try:
        code = httpx.get(url, timeout=2.0).status_code
    except httpx.HTTPError:
        return False
    return code == status if status is not None else code < 500


def wait_until(
    ready: Callable[[], bool],
    awaited: str,
    timeout_s: float,
    proc: subprocess.Popen[Any] | None = None,
    *,
    every_s: float = 0.05,
    name: str | None = None,
    log_path: Path | None = None,
) -> None:
    """Block until `ready()`; raises `RuntimeError` naming `awaited` when `proc` (called `name`) exits or
    time runs out."""
    see = f"; see {log_path}" if log_path is not None else ""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if proc is not None and proc.poll() is not None:
            who = name or repr(proc.args)
            raise RuntimeError(f"{who} exited with code {proc.returncode} while waiting for {awaited}{see}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no {awaited} within {timeout_s:.0f}s{see}")
        time.sleep(every_s)


def wait_port(port: int, timeout: float = 60.0, proc: subprocess.Popen[Any] | None = None) -> None:
    """Block until something accepts connections on 127.0.0.1:`port` (failing early when `proc` exits)."""
    wait_until(lambda: _listens(port), f"listener on port {port}", timeout, proc)


def _terminate_with_parent() -> None:
    """In the child before `exec`: SIGTERM when the thread that started it ends (its parent died)."""
    import ctypes

    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class Process:
    """A child process, started at once (see the module)."""

    def __init__(
        self,
        argv: Sequence[str],
        log_path: Path | None = None,
        env: Mapping[str, str] | None = None,
        *,
        name: str | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
        stop_timeout_s: float = 30.0,
    ) -> None:
        self.argv = list(argv)
        self.log_path = log_path
        """Where its stdout and stderr go (appended); None: its parent's."""
        self.env = dict(env) if env is not None else None
        """Its whole environment; None: its parent's."""
        self.name = name or Path(self.argv[0]).name
        self.cwd = cwd
        self.die_with_parent = die_with_parent
        """SIGTERM when the thread that started it ends, should its parent die without stopping it. Off by
        default: it runs code between fork and exec, which a process with threads had better avoid."""
        self.stop_timeout_s = stop_timeout_s
        """How long `stop` waits after SIGTERM before SIGKILL."""
        self._log: IO[bytes] | None = None
        self._terminated = False
        self.proc = self._spawn()
        self.started_at = time.monotonic()
        """Monotonic time of the current process's start."""

    def _spawn(self) -> subprocess.Popen[bytes]:
        if self.log_path is not None and self._log is None:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            self._log = open(self.log_path, "ab")  # noqa: SIM115 - closed in stop()
        return subprocess.Popen(
            self.argv,
            env=self.env,
            cwd=self.cwd,
            stdout=self._log,
            stderr=subprocess.STDOUT if self._log is not None else None,
            start_new_session=True,
            preexec_fn=_terminate_with_parent if self.die_with_parent else None,
        )

    def respawn(self) -> None:
        """Start it again (after it exited)."""
        self.proc = self._spawn()
        self.started_at = time.monotonic()
        self._terminated = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        """Its exit code, or None while it runs."""
        return self.proc.poll()

    def wait_port(self, port: int, timeout_s: float = 60.0) -> None:
        """Block until it listens on 127.0.0.1:`port`; `RuntimeError` if it exits first or time runs out."""
        awaited = f"listener on port {port}"
        wait_until(
            lambda: _listens(port), awaited, timeout_s, self.proc, name=self.name, log_path=self.log_path
        )

    def wait_http(self, url: str, timeout_s: float = 60.0, *, status: int | None = None) -> None:
        """Block until `url` answers a GET with `status`, or with anything under 500 when no status is given;
        `RuntimeError` if it exits first or time runs out."""
        awaited = f"answer {status or 'under 500'} from {url}"
        wait_until(
            lambda: _answers(url, status),
            awaited,
            timeout_s,
            self.proc,
            every_s=0.2,
            name=self.name,
            log_path=self.log_path,
        )

    def _ready_or_stop(self, wait: Callable[[], None]) -> None:
        """`wait()`; should it raise (the process exited, time ran out, a Ctrl-C), stop the process first."""
        try:
            wait()
        except BaseException:
            self.stop()
            raise

    def terminate(self) -> None:
        """Send SIGTERM (once) if it runs; `stop` then waits for it."""
        if self.proc.poll() is None and not self._terminated:
            self.proc.send_signal(signal.SIGTERM)
            self._terminated = True

    def kill(self) -> None:
        """SIGKILL, and wait for it to be gone."""
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout_s: float | None = None) -> int:
        """SIGTERM, wait up to `timeout_s` (else `stop_timeout_s`), then SIGKILL its process group; returns
        its exit code."""
        self.terminate()
        try:
            self.proc.wait(timeout=self.stop_timeout_s if timeout_s is None else timeout_s)
        except subprocess.TimeoutExpired:
            logger.warning("%s (pid %d) did not stop in time: killing it", self.name, self.proc.pid)
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode


class ServerThread:
    """A uvicorn server run in a daemon thread of this process, its app at hand (`app`)."""

    def __init__(self, server: uvicorn.Server, name: str = "server") -> None:
        self.server = server
        self.port: int = server.config.port
        self.url = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=server.run, name=f"{name}-{self.port}", daemon=True)

    @property
    def app(self) -> Any:
        """The ASGI app served."""
        return self.server.config.app

    def start(self, timeout_s: float = 60.0) -> Self:
        """Start the thread; return once the server listens (its lifespan has run)."""
        self.thread.start()
        deadline = time.monotonic() + timeout_s
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"{self.thread.name} did not start")
            time.sleep(0.05)
        return self

    def stop(self, timeout_s: float = 30.0) -> None:
        """Ask the server to exit (a graceful shutdown) and wait for the thread."""
        self.server.should_exit = True
        self.thread.join(timeout=timeout_s)

"""The processes of a stack: started, waited for until they serve, stopped, and kept running.

- `Process`: one child process, in a session of its own (a Ctrl-C reaches only its parent, which stops it in
  order), its output in a log file or its parent's. `stop` sends SIGTERM, then SIGKILL to its process group
  after `stop_timeout_s`.
- `GatewayProcess`, `WorkerProcess`, `EngineProcess`: tunegate's three (`python -m tunegate gateway`,
  `python -m tunegate worker`, `python -m inference`); the first two get their settings as `TUNEGATE_*`
  variables (`child_env`). `wait_ready` returns once the gateway listens or the engine answers `/health`.
- `Supervisor`: starts a watched process again when it exits, with backoff (the worker and the engine of
  `tunegate up`).
- `ServerThread`: a uvicorn server in a thread of this process instead, for callers that read the app's
  state (the tests' gateways and engines).

`tunegate up` (`tunegate.stack`), the test fixtures (`tests/support`) and the benches (`bench/stack.py`)
start their stacks with these and with `tunegate.services` (PostgreSQL and Redis).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Self, TypeVar

import httpx

from gateway.settings import Settings, settings_env

if TYPE_CHECKING:
    import uvicorn

logger = logging.getLogger(__name__)

P = TypeVar("P", bound="Process")


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


def _wait_until(
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
    _wait_until(lambda: _listens(port), f"listener on port {port}", timeout, proc)


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
        _wait_until(
            lambda: _listens(port), awaited, timeout_s, self.proc, name=self.name, log_path=self.log_path
        )

    def wait_http(self, url: str, timeout_s: float = 60.0, *, status: int | None = None) -> None:
        """Block until `url` answers a GET with `status`, or with anything under 500 when no status is given;
        `RuntimeError` if it exits first or time runs out."""
        awaited = f"answer {status or 'under 500'} from {url}"
        _wait_until(
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


# ---- tunegate's processes -----------------------------------------------------------------------------


def child_env(settings: Settings, **overrides: str) -> dict[str, str]:
    """This process's environment plus `settings` as `TUNEGATE_*` variables (then `overrides`): a child
    started with it runs with these settings."""
    return {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1", **overrides}


class GatewayProcess(Process):
    """`python -m tunegate gateway` with `settings`, on 127.0.0.1 and the settings' port. `launcher` goes
    before the command (`taskset -c 2`, say)."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path | None = None,
        *,
        launcher: Sequence[str] = (),
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.port = settings.port
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [*launcher, sys.executable, "-m", "tunegate", "gateway", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port)]
        super().__init__(
            argv, log_path, child_env(settings), name="gateway", cwd=cwd, die_with_parent=die_with_parent
        )

    def wait_ready(self, timeout_s: float = 90.0) -> Self:
        """Return once it listens (its lifespan has run: the pool, the migrations, the engines' clients);
        `RuntimeError`, the process stopped, if it exits first or time runs out."""
        self._ready_or_stop(lambda: self.wait_port(self.port, timeout_s))
        return self


class WorkerProcess(Process):
    """`python -m tunegate worker` with `settings`, and `overrides` (`TUNEGATE_*` variables) over them."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path | None = None,
        *,
        overrides: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        super().__init__(
            [sys.executable, "-m", "tunegate", "worker"],
            log_path,
            child_env(settings, **(overrides or {})),
            name="worker",
            cwd=cwd,
            die_with_parent=die_with_parent,
            stop_timeout_s=60.0,  # a graceful stop hands its jobs back first
        )


class EnvServerProcess(Process):
    """`python -m tunegate env-server` with `settings` and `overrides` (`TUNEGATE_*` variables) over them;
    `wait_registered` returns its id once it is registered in its pool."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path | None = None,
        *,
        capacity: int = 2,
        overrides: Mapping[str, str] | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.settings = settings
        self.pool = (overrides or {}).get("TUNEGATE_ENV_POOL", settings.env_pool)
        argv = [sys.executable, "-m", "tunegate", "env-server", "--capacity", str(capacity)]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        super().__init__(
            argv, log_path, child_env(settings, **(overrides or {})), name="env-server", stop_timeout_s=150.0
        )

    def wait_registered(self, timeout_s: float = 60.0) -> str:
        """Block until it is registered in its pool; its server id."""
        import redis

        from envsdk.remote_wire import live_servers

        assert self.settings.redis_url
        client = redis.Redis.from_url(self.settings.redis_url)
        found: list[str] = []

        def registered() -> bool:
            found[:] = [r.id for r in live_servers(client, self.pool).values() if r.pid == self.pid]
            return bool(found)

        try:
            _wait_until(
                registered, "its registration", timeout_s, self.proc, name=self.name, log_path=self.log_path
            )
        finally:
            client.close()
        return found[0]


class EngineProcess(Process):
    """`python -m inference` serving `models` (name -> local folder) on `host`:`port`."""

    def __init__(
        self,
        models: Mapping[str, str | Path],
        port: int,
        log_path: Path | None = None,
        *,
        host: str = "127.0.0.1",
        device: str | None = None,
        log_level: str | None = None,
        max_loras: int | None = None,
        max_model_len: int | None = None,
        launcher: Sequence[str] = (),
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.url = f"http://{host}:{port}"
        argv = [*launcher, sys.executable, "-m", "inference", "--host", host, "--port", str(port)]
        for name, path in models.items():
            argv += ["--model", f"{name}={path}"]
        if device is not None:
            argv += ["--device", device]
        if max_loras is not None:
            argv += ["--max-loras", str(max_loras)]
        if max_model_len is not None:
            argv += ["--max-model-len", str(max_model_len)]
        if log_level is not None:
            argv += ["--log-level", log_level]
        super().__init__(argv, log_path, name="engine", cwd=cwd, die_with_parent=die_with_parent)

    def wait_ready(self, timeout_s: float = 120.0) -> Self:
        """Return once `/health` answers (its models are loaded); `RuntimeError`, the process stopped, if it
        exits first or time runs out."""
        self._ready_or_stop(lambda: self.wait_http(f"{self.url}/health", timeout_s))
        return self


# ---- kept running -------------------------------------------------------------------------------------


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


# ---- in this process ----------------------------------------------------------------------------------


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

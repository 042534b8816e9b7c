"""Run an environment package, untrusted code, in an isolated process and talk to it in JSON lines.

Isolation (the ``bwrap`` backend, bubblewrap):

* its own network namespace (only a down loopback: no network at all), PID, IPC and UTS namespaces;
* a new root holding read-only binds of ``/usr`` (and the ``/lib*``, ``/bin`` links), the Python prefix,
  envsdk's own source, the package (at ``/env``) and its requirements' venv (at ``/venv``, built outside
  the sandbox by :mod:`envsdk.venvs`), a writable scratch (``/scratch``, also ``/tmp``): a tmpfs of
  ``disk_mb``, so all the sandbox writes is bounded and gone when it ends; a fresh ``/proc`` and a minimal
  ``/dev`` -- nothing else of the host: no blob store, no database files, no other tenant's data,
  no ``/etc``;
* a clean environment (``PATH``, ``HOME``, ``LANG``, ``TMPDIR``, ``PYTHONPATH`` only);
* an unprivileged uid: as root, bubblewrap runs without a user namespace and the child drops to a uid of
  its own before importing user code (inside a user namespace the host uid would stay 0, and the kernel
  does not apply ``RLIMIT_NPROC`` to root); as another user, ``--unshare-all --uid 65534``;
* rlimits on address space, CPU seconds, open files, processes and file size, set by the child before it
  imports user code;
* a lower CPU priority (niceness raised by ``SANDBOX_NICE``), so that hostile code cannot starve the
  gateway, the worker or the trainers of the CPU;
* a wall-clock timeout per call; on timeout, death or a garbled channel the whole process group is killed
  (``--die-with-parent`` takes the sandbox's PID namespace with it), and :meth:`Sandbox.start` may be
  called again.

Every limit is the smaller of the package's ``[limits]`` and the operator's :class:`~envsdk.manifest.Maxima`
(conservative defaults unless the caller passes its own).

The ``unshare`` backend (util-linux, as root) gives the same isolation where bubblewrap is missing; with
neither, the sandbox refuses to start unless ``allow_unsandboxed=True`` (development only). Which backend
works here, and what each needs to start a process, is :mod:`envsdk.sandbox_backends`; the host directories
a sandbox leaves behind are :mod:`envsdk.sandbox_dirs`. Their public names are importable from here too. The
JSON-lines channel to the process (framing, encoding, the stderr kept, why it died) is
:mod:`envsdk.sandbox_channel`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from envsdk.errors import SandboxError
from envsdk.manifest import Limits, Maxima, load_manifest
from envsdk.sandbox_backends import (
    ENVSDK_SRC,
    SANDBOX_NICE,
    SANDBOX_PATH,
    SANDBOX_PYTHONPATH,
    SCRATCH,
    Mount,
    allocate_uid,
    base_python,
    detect_backend,
    file_system_view,
    host_env,
    is_root,
    kill_uid,
    probe_backend,
    sandbox_command,
)
from envsdk.sandbox_channel import EOF, Channel, decode_line
from envsdk.sandbox_dirs import owned_tempdir, owned_workdir, remove_stale_dirs, remove_stale_once
from envsdk.venvs import WHEELS_DIR, VenvBuilder, default_builder

__all__ = [
    "ENVSDK_SRC",
    "SANDBOX_PATH",
    "SANDBOX_PYTHONPATH",
    "SCRATCH",
    "Mount",
    "Sandbox",
    "base_python",
    "detect_backend",
    "file_system_view",
    "owned_tempdir",
    "owned_workdir",
    "probe_backend",
    "remove_stale_dirs",
]

logger = logging.getLogger(__name__)


def _child_setup(die_with_parent: bool) -> None:
    """In the child before ``exec``: a lower CPU priority (``SANDBOX_NICE``, for every backend and all the
    sandbox starts) and, with ``die_with_parent``, SIGKILL when the process that started it dies."""
    os.nice(SANDBOX_NICE)
    if die_with_parent:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Sandbox:
    """One sandboxed environment process.

    ``package_dir`` holds ``environment.toml`` and the code. ``config`` overrides the manifest's default
    config; ``limits`` replaces the manifest's limits; either way each limit is lowered to ``maxima``'s
    (the operator's; :class:`~envsdk.manifest.Maxima`'s conservative defaults when not given). Sync API;
    ``acall`` and friends run the same calls in a thread for asyncio callers. One call at a time per
    sandbox. A package with ``requirements`` gets its venv from ``venvs`` (:mod:`envsdk.venvs`; the
    process's default builder when not given), built on the first :meth:`start` unless cached, and
    mounted read-only at ``/venv``.
    """

    def __init__(
        self,
        package_dir: Path,
        *,
        config: dict[str, Any] | None = None,
        limits: Limits | None = None,
        maxima: Maxima | None = None,
        allow_unsandboxed: bool = False,
        backend: str | None = None,
        entrypoint: str | None = None,
        venvs: VenvBuilder | None = None,
    ) -> None:
        self.package_dir = Path(package_dir).resolve()
        manifest = load_manifest(self.package_dir)
        self.manifest = manifest
        self.entrypoint = entrypoint or manifest.entrypoint
        self.config = {**manifest.config, **(config or {})}
        self.maxima = maxima or Maxima()
        self.limits = (limits or manifest.limits).capped(self.maxima)
        self.allow_unsandboxed = allow_unsandboxed
        if backend == "none" and not allow_unsandboxed:
            raise SandboxError("unsandboxed_refused", "backend 'none' needs allow_unsandboxed=True")
        if backend not in (None, "bwrap", "unshare", "none"):
            raise ValueError(f"unknown sandbox backend {backend!r}")
        self.requested_backend = backend
        self.venvs = venvs
        self.venv: Path | None = None
        self.backend: str | None = None
        self.uid: int | None = None
        self.info: dict[str, Any] = {}
        self._proc: subprocess.Popen[bytes] | None = None
        self._channel: Channel | None = None
        """The channel to the process last started (its stderr is kept after it ends)."""
        self._host_dir: Path | None = None
        self._lock = threading.Lock()
        self._next_id = 0

    # -- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> dict[str, Any]:
        """Start the process and load the entrypoint; returns ``describe``'s result."""
        if self._proc is not None:
            self.close()
        remove_stale_once()
        if self.manifest.requirements and self.venv is None:
            self.venv = self.ensure_venv()
        backend = self.requested_backend or detect_backend(allow_unsandboxed=self.allow_unsandboxed)
        if backend != "none" and not probe_backend(backend):
            raise SandboxError("unavailable", f"sandbox backend {backend!r} does not work on this machine")
        self.backend = backend
        # bwrap: only a working directory; unshare: the mount point of the new root; none: the scratch
        host_dir = owned_tempdir("scratch" if backend == "none" else "root")
        self._host_dir = host_dir
        self.uid = allocate_uid() if is_root() and backend != "none" else None
        cmd = sandbox_command(backend, self.package_dir, self.limits, host_dir, self.uid, self.venv)
        logger.debug("starting sandbox (%s) for %s", backend, self.entrypoint)
        self._channel = None
        try:
            self._proc = subprocess.Popen(
                cmd,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                env=host_env(backend, host_dir),
                cwd=str(host_dir),
                close_fds=True,
                start_new_session=True,
                # bubblewrap has --die-with-parent; unshare's --kill-child takes the sandbox down with it
                preexec_fn=functools.partial(_child_setup, backend == "unshare"),
            )
        except OSError as exc:
            self.close()
            raise SandboxError("start_failed", f"cannot start the sandbox: {exc}") from exc
        self._channel = Channel(self._proc, self.entrypoint)
        params = {
            "entrypoint": self.entrypoint,
            "config": self.config,
            "max_turns": self.limits.max_turns,
            "format": self.manifest.format,
            "format_options": self.manifest.format_options(),
        }
        try:
            self.info = self.call("init", params, timeout=self.limits.startup_timeout_s)
        except SandboxError as exc:
            self.close()
            if exc.code == "crashed":
                raise SandboxError("start_failed", exc.message) from exc
            if exc.code == "timeout":
                raise SandboxError(
                    "timeout",
                    f"the environment did not start within {self.limits.startup_timeout_s:g} s "
                    f"(its start-up timeout, at most the operator's {self.maxima.startup_timeout_s:g} s)",
                ) from exc
            raise
        return self.info

    def ensure_venv(self) -> Path | None:
        """The venv of the package's requirements, built (outside the sandbox, blocking) unless it is
        cached: by this sandbox's ``venvs`` builder, else :func:`~envsdk.venvs.default_builder`. Raises
        :class:`~envsdk.venvs.RequirementsError` (a :class:`~envsdk.errors.PackageError`)."""
        builder = self.venvs or default_builder()
        exact = self.manifest.requirements_exact
        return builder.ensure(self.manifest.requirements, self.package_dir / WHEELS_DIR, exact=exact)

    def close(self) -> None:
        """Kill the process group, and every process left of the sandbox's uid, and remove its host
        directory (idempotent). Its scratch, a tmpfs in its own mount namespace, goes with it."""
        proc, self._proc = self._proc, None
        if proc is not None:
            self._kill(proc)
            if self.uid is not None:
                kill_uid(self.uid)
        if self._host_dir is not None:
            shutil.rmtree(self._host_dir, ignore_errors=True)
            self._host_dir = None

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            logger.error("sandbox process %s did not exit after SIGKILL", proc.pid)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            try:
                if stream is not None:
                    stream.close()
            except OSError:
                pass

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def __enter__(self) -> Sandbox:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- calls -------------------------------------------------------------------------------------
    def stderr_tail(self, limit: int = 2000) -> str:
        """The last ``limit`` characters the sandbox wrote to stderr (user prints and tracebacks)."""
        return self._channel.stderr_tail(limit) if self._channel is not None else ""

    def call(self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        """One request/response round trip. Raises :class:`SandboxError` (the process is killed on
        ``timeout``/``crashed``/``memory``/``protocol_error``; a ``remote_error`` leaves it running).

        ``reward_batch`` travels in the compact ``rewards`` shape (each distinct task sent once, the
        rewards as one list) and comes back as ``reward_batch``'s list of ``{"reward", "error"}``."""
        if method == "reward_batch" and params is not None and isinstance(params.get("items"), list):
            return self._reward_batch(params["items"], timeout)
        return self._round_trip(method, params, timeout)

    def _reward_batch(self, items: list[dict[str, Any]], timeout: float | None) -> list[dict[str, Any]]:
        tasks: list[Any] = []
        index: dict[int, int] = {}  # id(task) -> position; every task stays referenced by ``tasks``
        compact: list[list[Any]] = []
        for item in items:
            task = item.get("task") or {}
            position = index.get(id(task))
            if position is None:
                position = index[id(task)] = len(tasks)
                tasks.append(task)
            compact.append([position, item.get("completion", "")])
        out = self._round_trip("rewards", {"tasks": tasks, "items": compact}, timeout)
        try:
            rewards = out["rewards"]
            errors = {int(i): str(message) for i, message in out["errors"]}
            if not isinstance(rewards, list) or len(rewards) != len(items):
                raise ValueError(f"{len(rewards)} rewards for {len(items)} items")
        except (KeyError, TypeError, ValueError) as exc:
            self.close()
            raise SandboxError("protocol_error", f"malformed rewards answer: {exc}") from None
        if not errors:
            return [{"reward": r, "error": None} for r in rewards]
        return [
            {"reward": None, "error": errors[i]} if i in errors else {"reward": r, "error": None}
            for i, r in enumerate(rewards)
        ]

    def _allowed_s(self, timeout: float | None) -> float:
        """Seconds a call may take: the limit, or the caller's ``timeout`` held to the longer of the
        (capped) call and start-up limits."""
        if timeout is None:
            return self.limits.timeout_s
        return min(timeout, max(self.limits.timeout_s, self.limits.startup_timeout_s))

    def _round_trip(self, method: str, params: dict[str, Any] | None, timeout: float | None) -> Any:
        with self._lock:
            channel = self._channel
            if self._proc is None or channel is None:
                raise SandboxError("not_running", "the sandbox is not running; call start()")
            self._next_id += 1
            rid = self._next_id
            try:
                channel.write({"id": rid, "method": method, "params": params or {}})
            except (BrokenPipeError, OSError):
                error = channel.died()
                self.close()
                raise error from None
            allowed = self._allowed_s(timeout)
            line = channel.read_line(time.monotonic() + allowed)
            if line is None:
                self.close()
                raise SandboxError("timeout", f"{method} did not answer within {allowed:g} s") from None
            if line is EOF:
                error = channel.died()
                self.close()
                raise error
            assert isinstance(line, bytes)
            try:
                response = decode_line(line)
                if not isinstance(response, dict) or response.get("id") != rid:
                    raise ValueError(f"expected a response to request {rid}")
            except ValueError as exc:
                self.close()
                raise SandboxError(
                    "protocol_error",
                    f"the environment wrote something else than an RPC answer on its channel "
                    f"({exc}): {line[:200]!r}",
                ) from None
            if "error" in response and response["error"] is not None:
                err = response["error"] if isinstance(response["error"], dict) else {}
                code = str(err.get("code") or "remote_error")
                if code == "protocol_error":
                    self.close()
                raise SandboxError(code, str(err.get("message") or "error"))
            return response.get("result")

    # -- typed helpers -----------------------------------------------------------------------------
    def describe(self) -> dict[str, Any]:
        """``{"kind", "entrypoint", "tools", "max_turns"}``."""
        result: dict[str, Any] = self.call("describe")
        return result

    def tasks(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("tasks")
        return result

    def reward_batch(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """``[{"task", "completion"}, ...]`` -> ``[{"reward": float | None, "error": str | None}, ...]``."""
        result: list[dict[str, Any]] = self.call("reward_batch", {"items": items})
        return result

    def group_reward(self, task: dict[str, Any], completions: list[Any]) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("group_reward", {"task": task, "completions": completions})
        return result

    def reset(self, task: dict[str, Any], episode_id: str | None = None) -> dict[str, Any]:
        """Open an episode: ``{"episode_id", "observation", "tools", "max_turns"}``."""
        params: dict[str, Any] = {"task": task}
        if episode_id is not None:
            params["episode_id"] = episode_id
        result: dict[str, Any] = self.call("reset", params)
        return result

    def step(self, episode_id: str, assistant_message: dict[str, Any]) -> dict[str, Any]:
        """``StepResult`` as a dict: ``{"observation", "reward", "done", "info", "error"}``."""
        result: dict[str, Any] = self.call(
            "step", {"episode_id": episode_id, "assistant_message": assistant_message}
        )
        return result

    def tools(self) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("tools")
        return result

    def call_tool(self, name: str, arguments: dict[str, Any] | str, episode_id: str | None = None) -> Any:
        return self.call("call_tool", {"name": name, "arguments": arguments, "episode_id": episode_id})

    # -- asyncio -----------------------------------------------------------------------------------
    async def astart(self) -> dict[str, Any]:
        return await asyncio.to_thread(self.start)

    async def acall(
        self,
        method: str,
        params: dict[str, Any] | None = None,
        *,
        timeout: float | None = None,  # noqa: ASYNC109 - the deadline is enforced by the blocking call
    ) -> Any:
        return await asyncio.to_thread(self.call, method, params, timeout=timeout)

    async def areward_batch(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return await asyncio.to_thread(self.reward_batch, items)

    async def aclose(self) -> None:
        await asyncio.to_thread(self.close)

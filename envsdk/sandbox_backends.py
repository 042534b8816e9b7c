"""Sandbox backends: which one works on this machine (``bwrap``, ``unshare``, ``none``), and what each
needs to start a process: the file-system view, the environment, the command line, and (as root) a uid of
the sandbox's own. :class:`envsdk.sandbox.Sandbox` starts the process and runs the calls.

The ``bwrap`` backend (bubblewrap) is the first choice. The ``unshare`` backend (util-linux, as root) is the
fallback when bubblewrap is missing: the same namespaces, the same file-system view (built by
:mod:`envsdk._confine`: a private mount namespace, a new root of the same binds and scratch tmpfs,
``chroot``, ``no_new_privs``), rlimits and the dropped uid. With neither available the sandbox refuses to
start unless ``allow_unsandboxed=True`` (development only: the ``none`` backend confines nothing, and its
scratch is a plain temporary directory). Each backend is probed once per process, by starting what the
sandbox would start.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import envsdk
from envsdk.errors import SandboxError
from envsdk.manifest import Limits
from envsdk.sandbox_dirs import owned_tempdir

logger = logging.getLogger(__name__)

ENVSDK_SRC = Path(envsdk.__file__).resolve().parent
SANDBOX_PYTHONPATH = "/opt/envsdk"
SCRATCH = "/scratch"
SANDBOX_PATH = "/usr/local/bin:/usr/bin:/bin"
SANDBOX_VENV = "/venv"
"""Where the sandbox mounts a package's venv (read-only, :mod:`envsdk.venvs`)."""
SANDBOX_NICE = 10
"""How far below the host's the sandboxed process's CPU priority is: the child raises its niceness by this
before ``exec`` (the kernel caps it at 19) and all it starts inherits it, so a package that spins every core
it may use still leaves the gateway, the worker and the trainers their share."""

_probe_cache: dict[str, bool] = {}


def is_root() -> bool:
    """Whether this process runs as root (the sandbox then drops to a uid of its own)."""
    return os.geteuid() == 0


def base_python() -> Path:
    """The base interpreter (not a venv's): the sandbox binds only its prefix, read-only."""
    candidate = Path(getattr(sys, "_base_executable", "") or sys.executable)
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    for path in (Path(sys.base_prefix) / "bin" / version, candidate):
        if path.exists():
            return path.resolve()
    return Path(sys.executable).resolve()


@dataclass(frozen=True)
class Mount:
    """One step of the sandbox's file-system view, in the order it is made."""

    kind: str
    """``dir``, ``ro-bind``, ``tmpfs``, ``symlink``, ``proc`` or ``dev``."""
    dest: str
    """Where, inside the new root."""
    source: str = ""
    """The host path of a ``ro-bind``; the target of a ``symlink``."""
    perms: int = 0o755
    """Mode of a ``dir`` or a ``tmpfs``."""
    size: int = 0
    """Bytes of a ``tmpfs``."""

    def bwrap_args(self) -> list[str]:
        """This step as bubblewrap arguments."""
        if self.kind == "dir":
            return ["--perms", f"{self.perms:04o}", "--dir", self.dest]
        if self.kind == "ro-bind":
            return ["--ro-bind", self.source, self.dest]
        if self.kind == "tmpfs":
            return ["--perms", f"{self.perms:04o}", "--size", str(self.size), "--tmpfs", self.dest]
        if self.kind == "symlink":
            return ["--symlink", self.source, self.dest]
        return [f"--{self.kind}", self.dest]  # proc, dev

    def as_dict(self) -> dict[str, Any]:
        return {
            "kind": self.kind,
            "dest": self.dest,
            "source": self.source,
            "perms": self.perms,
            "size": self.size,
        }


def site_packages(venv: Path) -> Path:
    """The venv's site-packages directory (``lib/pythonX.Y/site-packages``)."""
    version = f"python{sys.version_info.major}.{sys.version_info.minor}"
    return Path(venv) / "lib" / version / "site-packages"


def root_links() -> list[Mount]:
    """``/usr`` read-only, and ``/bin``, ``/lib``... as on the host: links stay links, directories become
    read-only binds."""
    view = [Mount("ro-bind", "/usr", "/usr")]
    for name in ("bin", "sbin", "lib", "lib32", "lib64", "libx32"):
        host = Path("/") / name
        if host.is_symlink():
            view.append(Mount("symlink", str(host), os.readlink(host)))
        elif host.is_dir():
            view.append(Mount("ro-bind", str(host), str(host)))
    return view


def _ro_bind(source: Path | str, dest: str) -> list[Mount]:
    """A read-only bind with world-traversable parents (bubblewrap makes missing parents 0700, and the
    sandbox's uid is not their owner)."""
    parents = [Mount("dir", str(p)) for p in reversed(Path(dest).parents) if str(p) != "/"]
    return [*parents, Mount("ro-bind", dest, str(source))]


def file_system_view(package_dir: Path | None, *, disk_bytes: int, venv: Path | None = None) -> list[Mount]:
    """Everything the sandbox sees, for both backends: read-only system directories, the Python prefix,
    envsdk, the package (``/env``) and its requirements' venv (``/venv``, when it has one); a scratch tmpfs
    of ``disk_bytes`` (also ``/tmp``); ``/proc`` and a minimal ``/dev``."""
    python = base_python()
    prefix = Path(sys.base_prefix).resolve()
    view = root_links()
    if not str(prefix).startswith("/usr/"):
        view += _ro_bind(prefix, str(prefix))
    if not str(python).startswith(("/usr/", str(prefix) + "/")):
        view += _ro_bind(python, str(python))
    view += _ro_bind(ENVSDK_SRC, f"{SANDBOX_PYTHONPATH}/envsdk")
    if package_dir is not None:
        view.append(Mount("ro-bind", "/env", str(package_dir)))
    if venv is not None:
        view.append(Mount("ro-bind", SANDBOX_VENV, str(venv)))
    view += [
        Mount("tmpfs", SCRATCH, perms=0o1777, size=disk_bytes),
        Mount("symlink", "/tmp", SCRATCH),
        Mount("proc", "/proc"),
        Mount("dev", "/dev"),
    ]
    return view


def sandbox_env() -> dict[str, str]:
    """The whole environment of the sandboxed process."""
    return {
        "PATH": SANDBOX_PATH,
        "HOME": SCRATCH,
        "TMPDIR": SCRATCH,
        "LANG": "C.UTF-8",
        "PYTHONPATH": SANDBOX_PYTHONPATH,
    }


def unshare_command(root: Path, view: list[Mount], argv: list[str]) -> list[str]:
    """``unshare`` into fresh namespaces, then :mod:`envsdk._confine` builds ``view`` and runs ``argv``."""
    plan = {
        "root": str(root),
        "mounts": [m.as_dict() for m in view],
        "env": sandbox_env(),
        "chdir": SCRATCH,
        "argv": argv,
    }
    return [
        "unshare", "--mount", "--net", "--pid", "--ipc", "--uts", "--fork", "--kill-child",
        str(base_python()), "-S", "-B", "-m", "envsdk._confine", json.dumps(plan),
    ]  # fmt: skip


def bwrap_namespace_args() -> list[str]:
    common = ["--die-with-parent", "--new-session"]
    if is_root():
        # No user namespace: the host uid must become non-root for RLIMIT_NPROC to hold; the child drops
        # privileges itself with exactly these two capabilities (lost on setuid; no_new_privs is set).
        return common + [
            "--unshare-ipc",
            "--unshare-pid",
            "--unshare-net",
            "--unshare-uts",
            "--unshare-cgroup-try",
            "--cap-add",
            "CAP_SETUID",
            "--cap-add",
            "CAP_SETGID",
        ]
    return common + ["--unshare-all", "--uid", "65534", "--gid", "65534"]


def probe_backend(name: str) -> bool:
    """Whether backend ``name`` (``bwrap``, ``unshare``, ``none``) works on this machine (cached)."""
    if name == "none":
        return True
    if name in _probe_cache:
        return _probe_cache[name]
    ok = False
    try:
        if name == "bwrap" and shutil.which("bwrap"):
            view = [*root_links(), Mount("proc", "/proc"), Mount("dev", "/dev")]
            cmd = ["bwrap", *(a for m in view for a in m.bwrap_args()), *bwrap_namespace_args(), "true"]
            ok = subprocess.run(cmd, capture_output=True, timeout=20).returncode == 0
        elif name == "unshare" and shutil.which("unshare") and is_root():
            # the real thing: the confined view, then the interpreter, as the sandbox's own uid would run it
            root = owned_tempdir("probe")
            try:
                view = file_system_view(None, disk_bytes=1 << 20)
                argv = [str(base_python()), "-S", "-B", "-c", "import envsdk._runner"]
                env = {"PATH": SANDBOX_PATH, "PYTHONPATH": str(ENVSDK_SRC.parent)}
                command = unshare_command(root, view, argv)
                result = subprocess.run(command, capture_output=True, timeout=20, env=env)
                ok = result.returncode == 0
                if not ok:
                    logger.info("unshare backend: %s", result.stderr.decode(errors="replace").strip()[-500:])
            finally:
                shutil.rmtree(root, ignore_errors=True)
    except (OSError, subprocess.SubprocessError) as exc:
        logger.warning("sandbox backend %s probe failed: %s", name, exc)
    _probe_cache[name] = ok
    logger.info("sandbox backend %s: %s", name, "available" if ok else "unavailable")
    return ok


def detect_backend(*, allow_unsandboxed: bool = False) -> str:
    """The best working backend: ``bwrap``, else ``unshare``, else ``none`` if allowed."""
    for name in ("bwrap", "unshare"):
        if probe_backend(name):
            return name
    if allow_unsandboxed:
        logger.warning("no sandbox backend available: running environment code UNSANDBOXED")
        return "none"
    raise SandboxError(
        "unavailable",
        "no sandbox backend works here (install bubblewrap: apt-get install bubblewrap); "
        "pass allow_unsandboxed=True only on a development machine",
    )


def sandbox_command(
    backend: str,
    package_dir: Path,
    limits: Limits,
    host_dir: Path,
    uid: int | None,
    venv: Path | None = None,
) -> list[str]:
    """The command that starts ``envsdk._runner`` on ``package_dir`` under ``backend``, with ``limits`` as
    rlimits (and, with ``uid``, dropping to it); ``host_dir`` is the new root's mount point (``unshare``).
    ``venv`` (the package's requirements, :mod:`envsdk.venvs`) is mounted read-only at ``/venv`` and its
    site-packages put on the runner's path."""
    rlimits = (
        f"as={limits.memory_mb * 1024 * 1024},cpu={limits.cpu_s},nofile={limits.nofile},"
        f"nproc={limits.nproc},fsize={limits.fsize_mb * 1024 * 1024},core=0"
    )
    runner = [str(base_python()), "-S", "-B", "-m", "envsdk._runner", "--rlimits", rlimits]
    if uid is not None:
        runner += ["--drop-uid", str(uid), "--drop-gid", str(uid)]
    if venv is not None:
        inside = venv if backend == "none" else Path(SANDBOX_VENV)
        runner += ["--site", str(site_packages(inside))]
    if backend == "none":
        return [*runner, str(package_dir)]
    view = file_system_view(package_dir, disk_bytes=limits.disk_mb * 1024 * 1024, venv=venv)
    if backend == "unshare":
        return unshare_command(host_dir, view, [*runner, "/env"])
    env = [a for name, value in sandbox_env().items() for a in ("--setenv", name, value)]
    return [
        "bwrap",
        *(a for m in view for a in m.bwrap_args()),
        *bwrap_namespace_args(),
        "--clearenv", *env, "--chdir", SCRATCH,
        *runner, "/env",
    ]  # fmt: skip


def host_env(backend: str, host_dir: Path) -> dict[str, str]:
    """The environment of the process this side starts (bubblewrap and unshare set the sandbox's own)."""
    env = {"PATH": SANDBOX_PATH, "LANG": "C.UTF-8"}
    if backend == "unshare":
        env["PYTHONPATH"] = str(ENVSDK_SRC.parent)  # for envsdk._confine, before the new root
    elif backend == "none":
        env.update(HOME=str(host_dir), TMPDIR=str(host_dir), PYTHONPATH=str(ENVSDK_SRC.parent))
    return env


# -- the sandbox's own uid (as root) ----------------------------------------------------------------------
def allocate_uid() -> int:
    """A uid of its own for this sandbox (so that RLIMIT_NPROC counts only this sandbox's processes)."""
    return 200_000 + secrets.randbelow(800_000)


def pids_of(uid: int) -> list[int]:
    """Ids of the processes running as `uid`."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except FileNotFoundError:
                pass
    return pids


def kill_uid(uid: int, within_s: float = 5.0) -> None:
    """SIGKILL what is left of a sandbox's own uid and wait until nothing is: the kernel tears a PID
    namespace down after its first process died, not with it, and a fork bomb may outlive the group kill
    for a moment. A closed sandbox thus leaves no process behind."""
    deadline = time.monotonic() + within_s
    while pids := pids_of(uid):
        if time.monotonic() > deadline:
            logger.error("sandbox uid %d still has processes %s after SIGKILL", uid, pids[:10])
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        time.sleep(0.01)

"""Virtual environments for packages with requirements: one per distinct set, built once and shared.

A package lists its requirements in ``environment.toml`` (``requirements = ["sympy==1.14.0"]``), each
pinned with ``==`` (:func:`normalise_requirements` refuses anything else). :class:`VenvBuilder` makes one
virtual environment per distinct set:

* **key** -- :func:`venv_key`: a hash of the normalised, sorted requirements, the Python version, the
  platform, and the digests of the wheels the package ships (so that a wheel shipped by one package is never
  installed for another that asked the registry for the same name and version);
* **where from** -- pip's configured index (the registry this machine reaches), or, when the package ships a
  ``wheels/`` folder, those wheels only (``--no-index --find-links``); binary distributions only
  (``--only-binary=:all:``): an sdist would run its build code on the host, outside the sandbox;
* **once** -- a lock per key (``fcntl.flock``, across threads and processes) so that concurrent builds of
  one set happen once; built into a temporary directory beside the cache and renamed into place when
  complete, so that a failed or killed build leaves nothing half-made (the next build of that key removes
  what a killed one left);
* **capped** -- pip runs with a wall-clock limit (its process group killed past it) and the result's size is
  checked against a byte cap; either failure leaves nothing behind.

The sandbox mounts the result read-only at ``/venv`` and puts its site-packages on the sandboxed Python's
path (:mod:`envsdk.sandbox_backends`); pip itself never runs in the sandbox. Which builder a sandbox uses:
the one its caller passes, else :func:`default_builder` (what :func:`configure` set in this process, else
the ``ENVSDK_VENV_*`` variables a parent process set, else a user cache directory).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from envsdk.requirements import RequirementsError, normalise_requirements
from envsdk.sandbox_backends import base_python

__all__ = [
    "RequirementsError",
    "VenvBuilder",
    "builder_env",
    "configure",
    "default_builder",
    "normalise_requirements",
    "venv_key",
]

logger = logging.getLogger(__name__)

VENV_DIR_ENV = "ENVSDK_VENV_DIR"
"""Where a process without :func:`configure` keeps its venvs (the worker sets it for its trainers)."""
VENV_TIMEOUT_ENV = "ENVSDK_VENV_BUILD_TIMEOUT_S"
VENV_MAX_BYTES_ENV = "ENVSDK_VENV_MAX_BYTES"
READY = ".envsdk-venv.json"
"""Written last into a finished venv: what it was built from (its presence marks the venv complete)."""
BUILD_PREFIX = ".build-"
SIZE_CHECK_S = 1.0
"""How often a running build's size is checked against the cap."""
WHEELS_DIR = "wheels"

_configured: VenvBuilder | None = None


def wheel_digests(wheels_dir: Path | None) -> dict[str, str]:
    """``{file name: sha256}`` of the ``.whl`` files a package ships (empty without a wheels folder)."""
    if wheels_dir is None or not wheels_dir.is_dir():
        return {}
    return {
        path.name: hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(wheels_dir.iterdir())
        if path.name.endswith(".whl") and path.is_file() and not path.is_symlink()
    }


def venv_key(requirements: list[str], wheels: dict[str, str] | None = None, *, exact: bool = False) -> str:
    """The cache key of a normalised requirement set: a hash of it, the Python version and the platform
    (and of the shipped wheels' digests, when there are any, and of ``exact``: installed without
    dependencies)."""
    identity = {
        "requirements": sorted(requirements),
        **({"exact": True} if exact else {}),
        "python": f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}",
        "platform": sysconfig.get_platform(),
        "wheels": dict(sorted((wheels or {}).items())),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:32]


def tree_bytes(path: Path) -> int:
    """Bytes of the regular files under ``path`` (links not followed)."""
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(root, name)).st_size
    return total


def readable_by_all(path: Path) -> None:
    """Let every uid read the files under ``path`` and traverse its directories (links left alone)."""
    for root, _dirs, files in os.walk(path):
        os.chmod(root, os.stat(root).st_mode | 0o555)
        for name in files:
            full = os.path.join(root, name)
            if not os.path.islink(full):
                os.chmod(full, os.stat(full).st_mode | 0o444)


def _pip_reason(output: str) -> str:
    """pip's reason in one line: its last ``ERROR:`` line (else the last line it wrote)."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR:").strip() for line in lines if line.startswith("ERROR:")]
    reason = errors[-1] if errors else (lines[-1] if lines else "pip failed without a message")
    return reason[:500]


@dataclass(frozen=True)
class VenvBuilder:
    """Builds and caches the venvs of requirement sets under ``root`` (see the module's docstring)."""

    root: Path
    """The cache: one directory per key, and the locks (``.locks``)."""
    timeout_s: float = 600.0
    """Wall-clock seconds one build may take."""
    max_bytes: int = 2 * 1024**3
    """Largest venv, in bytes."""
    pip_args: tuple[str, ...] = field(default_factory=tuple)
    """Extra arguments for ``pip install`` (pip's own configuration applies besides)."""

    def path_for(self, key: str) -> Path:
        return Path(self.root) / key

    def ensure(
        self, requirements: Iterable[str], wheels_dir: Path | None = None, *, exact: bool = False
    ) -> Path | None:
        """The venv of ``requirements`` (with the wheels in ``wheels_dir``, when it holds any): built now
        unless it is in the cache. ``None`` for no requirements. With ``exact``, the requirements are the
        whole set (a lock): installed as listed, none of their own dependencies added (``pip --no-deps``).
        Blocking; raises :class:`RequirementsError`."""
        normalised = normalise_requirements(requirements)
        if not normalised:
            return None
        wheels = wheel_digests(wheels_dir)
        key = venv_key(normalised, wheels, exact=exact)
        final = self.path_for(key)
        if (final / READY).is_file():
            return final
        with self._lock(key):
            if (final / READY).is_file():  # built by another thread or process while this one waited
                return final
            self._remove_leftovers(key, final)
            self._build(key, normalised, wheels_dir if wheels else None, final, exact=exact)
        return final

    @contextlib.contextmanager
    def _lock(self, key: str) -> Iterator[None]:
        locks = Path(self.root) / ".locks"
        locks.mkdir(parents=True, exist_ok=True)
        with open(locks / f"{key}.lock", "a") as handle:
            fcntl.flock(handle, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle, fcntl.LOCK_UN)

    def _remove_leftovers(self, key: str, final: Path) -> None:
        """What a killed build of ``key`` left (the lock is held: nobody else builds it now)."""
        for entry in Path(self.root).glob(f"{BUILD_PREFIX}{key}-*"):
            shutil.rmtree(entry, ignore_errors=True)
        if final.exists():  # no READY marker: incomplete
            shutil.rmtree(final, ignore_errors=True)

    def _build(
        self, key: str, requirements: list[str], wheels_dir: Path | None, final: Path, *, exact: bool = False
    ) -> None:
        started = time.monotonic()
        temp = Path(tempfile.mkdtemp(prefix=f"{BUILD_PREFIX}{key}-", dir=self.root))
        try:
            deadline = started + self.timeout_s
            venv = [str(base_python()), "-m", "venv", "--without-pip", str(temp)]
            self._run(venv, "make the venv", temp, deadline)
            # pip from this process's environment installs into the venv's interpreter (pip >= 22.3)
            pip = [sys.executable, "-m", "pip", "--python", str(temp / "bin" / "python"), "install"]
            pip += ["--no-input", "--disable-pip-version-check", "--only-binary=:all:"]
            if wheels_dir is not None:
                pip += ["--no-index", "--find-links", str(wheels_dir)]
            if exact:
                pip.append("--no-deps")
            self._run([*pip, *self.pip_args, *requirements], "build the requirements", temp, deadline)
            size = tree_bytes(temp)
            if size > self.max_bytes:
                raise RequirementsError(
                    f"could not build the requirements: the venv is {size} bytes, over the cap of "
                    f"{self.max_bytes} bytes",
                    "requirements_build_failed",
                )
            (temp / READY).write_text(
                json.dumps({"requirements": requirements, "wheels": wheels_dir is not None, "bytes": size})
            )
            readable_by_all(temp)  # the sandbox's own uid reads it, whatever this process's umask
            os.rename(temp, final)
        except BaseException:
            shutil.rmtree(temp, ignore_errors=True)
            raise
        elapsed = time.monotonic() - started
        logger.info("built venv %s (%s) in %.1f s, %d bytes", key, ", ".join(requirements), elapsed, size)

    def _run(self, argv: list[str], what: str, temp: Path, deadline: float) -> None:
        """Run one build step until ``deadline`` (the build's time cap) while ``temp`` stays under the size
        cap, checked every ``SIZE_CHECK_S``; past either its process group is killed."""
        # pip's own configuration (PIP_*, proxies, certificates, HOME for pip.conf) but none of the
        # gateway's settings (TUNEGATE_*: database URL, keys) and no Python path of this process
        env = {
            k: v
            for k, v in os.environ.items()
            if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV") and not k.startswith("TUNEGATE_")
        }
        proc = subprocess.Popen(
            argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            while True:
                try:  # communicate() may be called again after a timeout; it keeps what it read
                    output, _ = proc.communicate(
                        timeout=max(0.0, min(SIZE_CHECK_S, deadline - time.monotonic()))
                    )
                    break
                except subprocess.TimeoutExpired:
                    if time.monotonic() >= deadline:
                        raise RequirementsError(
                            f"could not {what}: it took longer than {self.timeout_s:g} s",
                            "requirements_build_failed",
                        ) from None
                    if (size := tree_bytes(temp)) > self.max_bytes:
                        raise RequirementsError(
                            f"could not {what}: the venv grew to {size} bytes, over the cap of "
                            f"{self.max_bytes} bytes",
                            "requirements_build_failed",
                        ) from None
        except BaseException:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
        if proc.returncode != 0:
            text = output.decode(errors="replace")
            logger.info("venv build step failed (%s): %s", what, text[-2000:])
            raise RequirementsError(f"could not {what}: {_pip_reason(text)}", "requirements_build_failed")


def user_cache_dir() -> Path:
    """``$XDG_CACHE_HOME/envsdk/venvs`` (``~/.cache/envsdk/venvs``): where ``envsdk test`` keeps its venvs."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "envsdk" / "venvs"


def configure(builder: VenvBuilder | None) -> None:
    """Make ``builder`` this process's default (the gateway's processes pass their settings' builder)."""
    global _configured
    _configured = builder


def builder_env(builder: VenvBuilder) -> dict[str, str]:
    """The variables that give a child process the same default builder (:func:`default_builder`)."""
    return {
        VENV_DIR_ENV: str(builder.root),
        VENV_TIMEOUT_ENV: str(builder.timeout_s),
        VENV_MAX_BYTES_ENV: str(builder.max_bytes),
    }


def default_builder() -> VenvBuilder:
    """What :func:`configure` set, else the ``ENVSDK_VENV_*`` variables, else the user cache directory."""
    if _configured is not None:
        return _configured
    root = os.environ.get(VENV_DIR_ENV)
    timeout = os.environ.get(VENV_TIMEOUT_ENV)
    max_bytes = os.environ.get(VENV_MAX_BYTES_ENV)
    return VenvBuilder(
        root=Path(root) if root else user_cache_dir(),
        timeout_s=float(timeout) if timeout else 600.0,
        max_bytes=int(max_bytes) if max_bytes else 2 * 1024**3,
    )

"""Uploaded code run by the gateway's own processes, as the operator's settings allow it: environment
packages unpacked within their upload caps and started in the sandbox, and python graders in theirs.
The graders API's environment runs and server-side scoring of captured episodes start packages here; a job's
worker unpacks one for its trainer."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from gateway.settings import Settings

if TYPE_CHECKING:
    from envsdk.python_grader import PythonGraders
    from envsdk.sandbox import Sandbox


def unpack(settings: Settings, archive: Path, dest: Path) -> None:
    """Unpack a package's archive into `dest`, within the caps its upload was checked against."""
    from envsdk.archive import safe_extract

    safe_extract(
        archive,
        dest,
        max_entries=settings.environment_max_entries,
        max_total_bytes=settings.environment_max_unpacked_bytes,
        max_ratio=settings.environment_max_ratio,
    )


def start(settings: Settings, archive: Path, workdir: Path, config: dict[str, Any] | None) -> Sandbox:
    """The package of `archive`, unpacked into `workdir` and started in its sandbox with `config` (the
    caller closes it); `envsdk.errors.EnvSDKError` when it cannot be unpacked or started."""
    from envsdk.sandbox import Sandbox

    workdir.chmod(0o755)  # the sandbox's own uid reads the package
    package = workdir / "package"
    unpack(settings, archive, package)
    sandbox = Sandbox(
        package,
        config=config,
        maxima=settings.sandbox_maxima(),
        allow_unsandboxed=settings.allow_unsandboxed_environments,
        venvs=settings.venv_builder(),
    )
    sandbox.start()
    return sandbox


def python_graders(settings: Settings) -> PythonGraders:
    """Python graders' sandboxes, within the operator's limits (a context manager)."""
    from envsdk.python_grader import PythonGraders

    return PythonGraders(
        allow_unsandboxed=settings.allow_unsandboxed_environments, maxima=settings.sandbox_maxima()
    )

"""``environment.toml``: the manifest of an environment package, validated with pydantic.

::

    name = "arithmetic"
    version = "0.1.0"
    entrypoint = "arithmetic_env:ArithmeticEnv"
    description = "Exact-answer arithmetic."
    requirements = ["sympy==1.14.0"]   # optional: each pinned with ==; before any [table]

    [limits]
    timeout_s = 30      # wall-clock seconds per call into the sandbox
    memory_mb = 1024    # address space (RLIMIT_AS)
    cpu_s = 120         # CPU seconds for the sandbox's life (RLIMIT_CPU)
    max_turns = 8       # multi-turn episodes

The operator's :class:`Maxima` cap every limit: a sandbox runs under the smaller of the package's and the
operator's value.
"""

from __future__ import annotations

import logging
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from envsdk.errors import PackageError
from envsdk.requirements import normalise_requirements

logger = logging.getLogger(__name__)

MANIFEST_NAME = "environment.toml"


class Limits(BaseModel):
    """Resource limits of one sandboxed environment process."""

    model_config = ConfigDict(extra="forbid")

    timeout_s: float = Field(30.0, gt=0, le=3600)
    """Wall-clock seconds allowed per call (a whole batch is one call)."""
    startup_timeout_s: float = Field(30.0, gt=0, le=600)
    """Wall-clock seconds allowed to start the process and import the entrypoint."""
    memory_mb: int = Field(1024, ge=64, le=65536)
    """Address-space limit (RLIMIT_AS) in MiB."""
    cpu_s: int = Field(600, ge=1, le=86400)
    """CPU seconds for the process's whole life (RLIMIT_CPU)."""
    max_turns: int = Field(8, ge=1, le=1000)
    """Most assistant turns per multi-turn episode."""
    nproc: int = Field(32, ge=1, le=4096)
    """Processes/threads the sandbox's uid may own (RLIMIT_NPROC)."""
    nofile: int = Field(256, ge=16, le=65536)
    """Open file descriptors (RLIMIT_NOFILE)."""
    fsize_mb: int = Field(64, ge=1, le=65536)
    """Largest file the sandbox may write (RLIMIT_FSIZE), in MiB."""
    disk_mb: int = Field(256, ge=1, le=65536)
    """Bytes the sandbox may hold in its scratch (``/scratch``, also ``/tmp`` and ``HOME``) in all, in MiB:
    the scratch is a tmpfs of this size (memory, counted apart from ``memory_mb``)."""

    def capped(self, ceiling: Limits | Maxima) -> Limits:
        """These limits, each lowered to at most ``ceiling``'s (the operator's :class:`Maxima`, or other
        limits); a limit ``ceiling`` does not name stays as it is."""
        values = {
            name: min(getattr(self, name), getattr(ceiling, name, getattr(self, name)))
            for name in type(self).model_fields
        }
        return Limits(**values)


@dataclass(frozen=True)
class Maxima:
    """The operator's ceilings on every package's ``[limits]``: a sandbox runs under the smaller of each.

    The defaults are conservative; the gateway, the worker and the trainer fill these from their settings
    (``TUNEGATE_SANDBOX_MAX_*``) and pass them to every :class:`~envsdk.sandbox.Sandbox` they make. A sandbox
    made without them is held to these defaults.
    """

    timeout_s: float = 60.0
    """Wall-clock seconds one call may take."""
    startup_timeout_s: float = 30.0
    """Wall-clock seconds to start the process and import the entrypoint (also all an upload check waits)."""
    memory_mb: int = 2048
    """Address space (RLIMIT_AS), in MiB."""
    cpu_s: int = 600
    """CPU seconds for the process's whole life (RLIMIT_CPU)."""
    nproc: int = 64
    """Processes and threads of the sandbox's uid (RLIMIT_NPROC)."""
    nofile: int = 1024
    """Open file descriptors (RLIMIT_NOFILE)."""
    fsize_mb: int = 256
    """Largest single file (RLIMIT_FSIZE), in MiB."""
    disk_mb: int = 512
    """Size of the scratch tmpfs: all the bytes the sandbox may write, in MiB."""

    def __post_init__(self) -> None:
        # Each maximum must itself be a valid limit's value (at least what a package may declare).
        for name, value in asdict(self).items():
            for bound in Limits.model_fields[name].metadata:
                low, strict = getattr(bound, "ge", None), False
                if low is None:
                    low, strict = getattr(bound, "gt", None), True
                if low is not None and (value <= low if strict else value < low):
                    relation = ">" if strict else ">="
                    raise ValueError(f"sandbox maximum {name} must be {relation} {low}, got {value}")

    def as_limits(self) -> Limits:
        """These maxima as :class:`Limits` (each within a limit's own range, ``max_turns`` at its largest),
        for an API that takes its ceiling as limits (``inspect_package(limits=...)``)."""
        values: dict[str, Any] = {}
        for name, field in Limits.model_fields.items():
            high = min(bound.le for bound in field.metadata if hasattr(bound, "le"))
            values[name] = min(getattr(self, name, high), high)
        return Limits(**values)

    def as_dict(self) -> dict[str, Any]:
        """The maxima as a JSON object (how they travel to the trainer in its spec)."""
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Maxima:
        """Maxima from :meth:`as_dict`'s object (keys it lacks keep their defaults)."""
        return cls(**(data or {}))


class TRLOptions(BaseModel):
    """``[trl]``: how to find what ``GRPOTrainer`` would be given besides ``environment_factory``."""

    model_config = ConfigDict(extra="forbid")

    reward_funcs: list[str] = Field(default_factory=list, max_length=32)
    """``module:name`` of each reward function, or of a list of them (``reward_funcs``' own shapes)."""


class OpenEnvOptions(BaseModel):
    """``[openenv]``: how the model's turns become the OpenEnv server's Actions."""

    model_config = ConfigDict(extra="forbid")

    tool_name: str = Field("step", pattern=r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
    """Name of the one tool whose arguments are the Action (its JSON schema from the server's ``/schema``)."""
    text_field: str | None = Field(None, pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    """The Action's field that a plain-text reply fills (``{text_field: reply}``); without it, a reply that
    is neither a tool call nor a JSON object ends the episode."""


class Manifest(BaseModel):
    """The parsed ``environment.toml``."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
    """Package name: letters, digits, ``_ . -``; at most 64 characters."""
    version: str = Field(pattern=r"^[0-9A-Za-z][0-9A-Za-z.+_-]{0,31}$")
    """Free-form version string such as ``0.1.0``."""
    entrypoint: str = Field(pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$")
    """``module:Class`` -- the environment class, importable from the package directory."""
    description: str = Field("", max_length=2000)
    """One-paragraph description."""
    limits: Limits = Field(default_factory=Limits)  # type: ignore[arg-type]
    """Resource limits (each capped by the operator's maxima)."""
    config: dict[str, object] = Field(default_factory=dict)
    """Default config passed to the environment (a job's ``config`` overrides keys)."""
    requirements: list[str] = Field(default_factory=list, max_length=200)
    """Packages the environment imports, each pinned with ``==`` (``"sympy==1.14.0"``): installed into a
    venv built outside the sandbox (from the registry, or from the package's ``wheels/`` folder) and mounted
    read-only into it (:mod:`envsdk.venvs`)."""

    requirements_exact: bool = False
    """The requirements are the whole set the environment imports (a lock, every dependency pinned too):
    installed as listed, with none of their own dependencies added (``pip --no-deps``). For frameworks whose
    declared dependencies reach far beyond what an environment imports."""
    format: Literal["envsdk", "trl", "openenv", "verifiers", "atropos"] = "envsdk"
    """The framework the environment is written for: ``envsdk`` (the entrypoint is an envsdk class),
    ``trl`` (the entrypoint is TRL's ``environment_factory``; ``[trl]`` names its ``reward_funcs``),
    ``openenv`` (the entrypoint is the ASGI app of OpenEnv's ``create_app``, ``server.app:app``) or
    ``verifiers`` (the entrypoint is the module's ``load_environment``, called with ``config`` as its
    keyword arguments) or ``atropos`` (the entrypoint is an ``atroposlib`` ``BaseEnv`` subclass; ``config``
    updates its ``config_init()``'s env config). Its code runs unchanged through an adapter
    (:mod:`envsdk.formats`)."""
    trl: TRLOptions | None = None
    """``[trl]``: options of the ``trl`` format."""
    openenv: OpenEnvOptions | None = None
    """``[openenv]``: options of the ``openenv`` format."""

    def format_options(self) -> dict[str, Any]:
        """The options of the package's format, as the sandboxed host receives them."""
        table = getattr(self, self.format, None) if self.format != "envsdk" else None
        return table.model_dump() if table is not None else {}

    @field_validator("requirements")
    @classmethod
    def _pinned(cls, value: list[str]) -> list[str]:
        try:
            normalise_requirements(value)
        except PackageError as exc:
            raise ValueError(exc.message) from None
        return value


def parse_manifest(text: str) -> Manifest:
    """Parse and validate manifest text; raises :class:`PackageError` (``invalid_manifest``)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise PackageError(f"{MANIFEST_NAME} is not valid TOML: {exc}", "invalid_manifest") from exc
    try:
        return Manifest.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in err['loc']) or '(root)'}: {err['msg']}" for err in exc.errors()
        )
        raise PackageError(f"invalid {MANIFEST_NAME}: {problems}", "invalid_manifest") from exc


def load_manifest(package_dir: Path) -> Manifest:
    """Read ``environment.toml`` from a package directory (which must not be a symlink)."""
    path = Path(package_dir) / MANIFEST_NAME
    if path.is_symlink() or (path.exists() and not path.is_file()):
        raise PackageError(f"{MANIFEST_NAME} must be a regular file", "invalid_manifest")
    if not path.exists():
        raise PackageError(f"{MANIFEST_NAME} not found in the package", "missing_manifest")
    if path.stat().st_size > 64 * 1024:
        raise PackageError(f"{MANIFEST_NAME} is larger than 64 KiB", "invalid_manifest")
    return parse_manifest(path.read_text(encoding="utf-8", errors="replace"))

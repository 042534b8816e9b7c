"""The requirements of an environment package: each pinned with ``==``, parsed and normalised by
``packaging`` (the key of their venv, :mod:`envsdk.venvs`, is a hash of the normalised set)."""

from __future__ import annotations

from collections.abc import Iterable

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

from envsdk.errors import PackageError

MAX_REQUIREMENTS = 200


class RequirementsError(PackageError):
    """A package's requirements are invalid (``invalid_requirements``) or could not be built
    (``requirements_build_failed``)."""


def normalise_requirements(requirements: Iterable[str]) -> list[str]:
    """The requirements parsed by ``packaging`` and normalised (canonical names, sorted extras), sorted.

    Each must pin one version with ``==`` (no wildcard, no URL); a name may appear once. Raises
    :class:`RequirementsError` naming the offending requirement."""
    seen: dict[str, str] = {}
    for text in requirements:
        try:
            req = Requirement(text)
        except InvalidRequirement as exc:
            raise RequirementsError(
                f"requirement {text!r} is not a valid requirement: {exc}", "invalid_requirements"
            ) from None
        specs = list(req.specifier)
        if req.url or len(specs) != 1 or specs[0].operator != "==" or specs[0].version.endswith(".*"):
            raise RequirementsError(
                f"requirement {text!r} must pin one version with '==' (for example 'sympy==1.14.0')",
                "invalid_requirements",
            )
        name = canonicalize_name(req.name)
        if name in seen:
            raise RequirementsError(
                f"requirement {text!r}: {req.name} is listed twice", "invalid_requirements"
            )
        extras = f"[{','.join(sorted(canonicalize_name(e) for e in req.extras))}]" if req.extras else ""
        marker = f"; {req.marker}" if req.marker else ""
        seen[name] = f"{name}{extras}=={specs[0].version}{marker}"
    if len(seen) > MAX_REQUIREMENTS:
        raise RequirementsError(f"more than {MAX_REQUIREMENTS} requirements", "invalid_requirements")
    return sorted(seen.values())

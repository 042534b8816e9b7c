"""The project's own Python source files, for tests that read the code itself (import rules, sizes)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def source_files(package: str) -> list[Path]:
    """Every ``.py`` file of `package`, sorted; folders whose names start with a dot (virtual environments
    made beside the code, such as the gateway bench's ``bench/.venv-litellm``) are not the project's."""
    return sorted(
        path
        for path in (ROOT / package).rglob("*.py")
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
    )

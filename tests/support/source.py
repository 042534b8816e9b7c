"""The project's own Python source files, for tests that read the code itself (import rules, sizes) or run
its example scripts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def source_files(package: str) -> list[Path]:
    """Every ``.py`` file of `package`, sorted; folders whose names start with a dot (virtual environments
    made beside the code, such as the gateway bench's ``bench/.venv-litellm``) are not the project's."""
    return sorted(
        path
        for path in (ROOT / package).rglob("*.py")
        if not any(part.startswith(".") for part in path.relative_to(ROOT).parts)
    )


def load_script(path: Path, name: str) -> ModuleType:
    """An example script (not a package module) imported as module `name`, registered in `sys.modules` so that
    its dataclasses and chz configs find their module."""
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module

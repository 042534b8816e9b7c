"""Fixtures for envsdk tests: writing small packages and knowing whether a sandbox backend works."""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path

import pytest

from envsdk.sandbox import probe_backend
from envsdk.venvs import VenvBuilder

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "envs"


@pytest.fixture(scope="session")
def sandbox_backend() -> str:
    for name in ("bwrap", "unshare"):
        if probe_backend(name):
            return name
    pytest.skip("no sandbox backend here: install bubblewrap (apt-get install bubblewrap)")


@pytest.fixture(scope="session")
def builder(venv_dir: Path) -> VenvBuilder:
    """The session's venv cache (`venv_dir`), for the sandboxed tests of packages with requirements: each
    set is built once in the whole run."""
    return VenvBuilder(venv_dir)


@pytest.fixture
def make_package(tmp_path: Path) -> Callable[..., Path]:
    """Write ``environment.toml`` + ``env.py`` (class ``Env``) into a fresh directory."""
    counter = iter(range(1000))

    def make(
        code: str, *, limits: str = "timeout_s = 10\n", name: str = "pkg", entrypoint: str = "env:Env"
    ) -> Path:
        root = tmp_path / f"{name}{next(counter)}"
        root.mkdir()
        (root / "environment.toml").write_text(
            f'name = "{name}"\nversion = "0.1.0"\nentrypoint = "{entrypoint}"\n\n[limits]\n{limits}'
        )
        (root / "env.py").write_text(textwrap.dedent(code))
        return root

    return make

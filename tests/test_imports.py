"""Imports point one way: the data planes (`trainer`, `inference`) and `envsdk` never import the gateway, and
the gateway reaches into `trainer` only through its dependency-light contract, `trainer.spec`."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every module each file of `package` imports (absolute names), by file."""
    found: dict[str, set[str]] = {}
    for path in (ROOT / package).rglob("*.py"):
        names: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
        found[str(path.relative_to(ROOT))] = names
    return found


def offenders(package: str, allowed: Callable[[str], bool]) -> list[str]:
    return sorted(
        f"{path}: {name}"
        for path, names in imported_modules(package).items()
        for name in names
        if not allowed(name)
    )


def test_data_planes_and_envsdk_never_import_the_gateway() -> None:
    for package in ("trainer", "inference", "envsdk"):
        assert offenders(package, lambda name: not name.startswith(("gateway", "tunegate"))) == []


def test_envsdk_and_inference_stand_alone() -> None:
    assert offenders("envsdk", lambda name: not name.startswith(("trainer", "inference"))) == []
    assert offenders("inference", lambda name: not name.startswith(("trainer", "envsdk"))) == []


def test_the_gateway_knows_the_trainer_only_by_its_contract() -> None:
    def allowed(name: str) -> bool:
        return not name.startswith("trainer") or name == "trainer.spec"

    assert offenders("gateway", allowed) == []


def test_the_contract_needs_nothing_heavy() -> None:
    names = imported_modules("trainer")["trainer/spec.py"]
    heavy = {n for n in names if n.split(".")[0] in ("torch", "transformers", "trl", "peft", "datasets")}
    assert heavy == set() and not {n for n in names if n.startswith("trainer.")}

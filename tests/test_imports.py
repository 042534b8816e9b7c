"""Imports point one way: the data planes (`trainer`, `inference`) and `envsdk` never import the gateway, the
gateway reaches into `trainer` only through its dependency-light contract, `trainer.contract`, `bench` never
imports `tests`, and no module of the project imports itself through others (no import cycle)."""

from __future__ import annotations

import ast
from collections.abc import Callable
from pathlib import Path

from tests.support.source import source_files

ROOT = Path(__file__).resolve().parents[1]


def imported_modules(package: str) -> dict[str, set[str]]:
    """Every module each file of `package` imports (absolute names), by file."""
    found: dict[str, set[str]] = {}
    for path in source_files(package):
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
        return (
            not name.startswith("trainer")
            or name == "trainer.contract"
            or name.startswith("trainer.contract.")
        )

    assert offenders("gateway", allowed) == []


def test_the_contract_needs_nothing_heavy() -> None:
    found = imported_modules("trainer")
    contract = [path for path in found if path.startswith("trainer/contract/")]
    assert "trainer/contract/__init__.py" in contract
    for path in contract:
        names = found[path]
        heavy = {n for n in names if n.split(".")[0] in ("torch", "transformers", "trl", "peft", "datasets")}
        outside = {n for n in names if n.startswith("trainer.") and not n.startswith("trainer.contract")}
        assert heavy == set() and outside == set(), path


def test_bench_never_imports_the_tests() -> None:
    assert offenders("bench", lambda name: not name.startswith("tests")) == []


PROJECT = ("gateway", "trainer", "inference", "envsdk", "tunegate", "bench", "tests")


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Ids of the nodes under `if TYPE_CHECKING:` (imports for the type checker, never run)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skipped


def import_graph() -> dict[str, set[str]]:
    """Each module of the project -> the project's modules it imports when it runs (imports inside functions
    included, those only for the type checker not). `from a import b` is an import of `a.b` when that is a
    module, else of `a`."""
    paths: dict[str, Path] = {}
    for package in PROJECT:
        for path in source_files(package):
            parts = path.relative_to(ROOT).with_suffix("").parts
            paths[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path

    def known(name: str) -> str | None:
        while name and name not in paths:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {}
    for module, path in paths.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        skipped = _type_checking_only(tree)
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        found: set[str | None] = set()
        for node in ast.walk(tree):
            if id(node) in skipped:
                continue
            if isinstance(node, ast.Import):
                found.update(known(alias.name) for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*anchor, *([node.module] if node.module else [])])
                for alias in node.names:
                    found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in paths else known(base))
        graph[module] = {name for name in found if name is not None and name != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert "tunegate.stack" in graph["tunegate.cli"]  # imports inside functions count
    assert cycles(graph) == []


def test_cycles_are_the_loops_of_a_graph() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]] and cycles({"a": {"b"}, "b": set()}) == []

"""The store boundary and the price table, without a stack: stores return frozen row dataclasses made by
`gateway.db.row_to` (never an `asyncpg.Record`), and a cost's line items add up to what budgets count."""

from __future__ import annotations

import ast
import dataclasses
import importlib
from datetime import UTC, datetime
from pathlib import Path

import pytest

from gateway.db import maybe_row_to, row_to, rows_to
from gateway.models.store import ModelRow
from gateway.settings import ModelPrice, Settings
from gateway.usage import pricing

GATEWAY = Path(__file__).resolve().parents[2] / "gateway"
ROW_MODULES = sorted(p for p in GATEWAY.rglob("*.py") if p.name in ("store.py", "rows.py"))


def _module_name(path: Path) -> str:
    return ".".join(("gateway", *path.relative_to(GATEWAY).with_suffix("").parts))


def test_no_store_function_returns_a_record() -> None:
    assert len(ROW_MODULES) >= 10
    for path in ROW_MODULES:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.returns is not None:
                returns = ast.unparse(node.returns)
                assert "Record" not in returns, f"{path.relative_to(GATEWAY)}: {node.name} -> {returns}"


def test_every_row_class_is_frozen_and_slotted() -> None:
    rows = []
    for path in ROW_MODULES:
        module = importlib.import_module(_module_name(path))
        for value in vars(module).values():
            if (
                dataclasses.is_dataclass(value)
                and isinstance(value, type)
                and value.__module__ == module.__name__
            ):
                rows.append(value)
                assert value.__dataclass_params__.frozen, value  # type: ignore[attr-defined]
                assert "__slots__" in vars(value), value
    assert len(rows) >= 20


def test_row_to_takes_the_fields_by_column_name() -> None:
    now = datetime.now(UTC)
    # Columns in another order, and one the row does not keep (`seq`).
    record = {
        "seq": 7,
        "adapter_path": "/blobs/a",
        "created_at": now,
        "job_id": None,
        "base_model": "tiny-chat",
        "organization_id": "org-1",
        "id": "ft:tiny-chat:org-1::ftjob-1",
        "version": "v-" + "0" * 24,
    }
    row = row_to(ModelRow, record)
    assert row == ModelRow(
        "ft:tiny-chat:org-1::ftjob-1", "org-1", "tiny-chat", None, "/blobs/a", now, "v-" + "0" * 24
    )
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.adapter_path = "/elsewhere"  # type: ignore[misc]
    assert maybe_row_to(ModelRow, None) is None
    assert rows_to(ModelRow, [record, {**record, "id": "m2"}])[1].id == "m2"
    with pytest.raises(KeyError):
        row_to(ModelRow, {"id": "m"})  # a missing column is an error, not a silent default


def test_cost_line_items_add_up_to_the_costs_budgets_use() -> None:
    settings = Settings(
        prices={
            "tiny-chat": ModelPrice(
                input_per_million=0.5, output_per_million=1.5, training_per_million=4.0, training_per_hour=2.0
            )
        }
    )
    inputs = pricing.input_cost(settings, "tiny-chat", 2_000_000)
    outputs = pricing.output_cost(settings, "tiny-chat", 1_000_000)
    assert (inputs, outputs) == (pytest.approx(1.0), pytest.approx(1.5))
    assert pricing.completion_cost(settings, "tiny-chat", 2_000_000, 1_000_000) == pytest.approx(2.5)
    tokens = pricing.training_tokens_cost(settings, "tiny-chat", 500_000)
    hours = pricing.training_time_cost(settings, "tiny-chat", 1800.0)
    assert (tokens, hours) == (pytest.approx(2.0), pytest.approx(1.0))
    assert pricing.training_cost(settings, "tiny-chat", 500_000, 1800.0) == pytest.approx(3.0)
    # A model without prices of its own is priced by the defaults.
    default = ModelPrice()
    assert pricing.input_cost(settings, "other", 1_000_000) == pytest.approx(default.input_per_million)

"""The frozen rows `gateway.evals.store` returns: evals, runs, output items, and what the worker reads."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class EvalRow:
    id: str
    organization_id: str
    name: str
    metadata: dict[str, Any] | None
    data_source_config: dict[str, Any]
    testing_criteria: list[dict[str, Any]]
    created_at: datetime


@dataclass(frozen=True, slots=True)
class RunRow:
    """An eval run, as the API and the worker read it."""

    id: str
    eval_id: str
    organization_id: str
    name: str
    model: str
    metadata: dict[str, Any] | None
    data_source: dict[str, Any]
    testing_criteria: list[dict[str, Any]]
    status: str
    error: dict[str, Any] | None
    result_counts: dict[str, int]
    per_testing_criteria_results: list[dict[str, Any]]
    per_model_usage: list[dict[str, Any]]
    created_at: datetime
    queue_generation: int
    attempts: int


@dataclass(frozen=True, slots=True)
class ItemRow:
    """An output item of a run."""

    id: str
    run_id: str
    eval_id: str
    datasource_item_id: int
    datasource_item: dict[str, Any]
    status: str
    results: list[dict[str, Any]]
    sample: dict[str, Any]
    created_at: datetime


@dataclass(frozen=True, slots=True)
class DoneItem:
    """An output item an earlier attempt of the run recorded (a resumed run skips it)."""

    datasource_item_id: int
    status: str
    results: list[dict[str, Any]]
    usage: dict[str, dict[str, int]]
    sample_error: dict[str, Any] | None

"""Evals API shapes (OpenAI's): evals, runs, output items, and the requests that make them.

Request bodies keep their nested parts as plain JSON (`dict[str, Any]`): `gateway.evals.datasource`
checks them field by field, so a bad one is a 400 whose `param` names the field (`testing_criteria[1].
operation`, `data_source.input_messages.template[0].content`), as OpenAI's errors do.
"""

from __future__ import annotations

from typing import Any, Literal

from gateway.evals.rows import EvalRow, ItemRow, RunRow
from gateway.evals.stored_source import STORED_IDS
from gateway.protocol import OpenAIBaseModel
from gateway.timeutil import ts

RUN_STATES = ("queued", "in_progress", "completed", "failed", "canceled")
OPEN_RUN_STATES = ("queued", "in_progress")
ITEM_STATES = ("pass", "fail", "error")


# -- requests ------------------------------------------------------------------------------------------


class EvalCreate(OpenAIBaseModel):
    """`POST /v1/evals`."""

    data_source_config: dict[str, Any]
    """`{"type": "custom", "item_schema": {...}, "include_sample_schema": bool}`, or `{"type":
    "stored_completions", "metadata": {...}}` (`gateway.evals.stored`)."""
    testing_criteria: list[dict[str, Any]]
    """Graders (`envsdk.graders`), each with an optional `pass_threshold`."""
    name: str | None = None
    metadata: dict[str, Any] | None = None


class EvalUpdate(OpenAIBaseModel):
    """`POST /v1/evals/{eval_id}`: only `name` and `metadata` change."""

    name: str | None = None
    metadata: dict[str, Any] | None = None


class RunCreate(OpenAIBaseModel):
    """`POST /v1/evals/{eval_id}/runs`."""

    data_source: dict[str, Any]
    """`completions` (sample a model over the items, or grade stored completions as they were answered) or
    `jsonl` (items that carry their own sample)."""
    name: str | None = None
    metadata: dict[str, Any] | None = None


# -- responses -----------------------------------------------------------------------------------------


class Eval(OpenAIBaseModel):
    id: str
    object: Literal["eval"] = "eval"
    created_at: int
    name: str
    metadata: dict[str, Any] | None = None
    data_source_config: dict[str, Any]
    testing_criteria: list[dict[str, Any]]

    @classmethod
    def from_row(cls, row: EvalRow) -> Eval:
        return cls(
            id=row.id,
            created_at=ts(row.created_at) or 0,
            name=row.name,
            metadata=row.metadata,
            data_source_config=row.data_source_config,
            testing_criteria=row.testing_criteria,
        )


class EvalDeleted(OpenAIBaseModel):
    object: Literal["eval.deleted"] = "eval.deleted"
    deleted: bool = True
    eval_id: str


class RunError(OpenAIBaseModel):
    code: str
    message: str


class EvalRun(OpenAIBaseModel):
    id: str
    object: Literal["eval.run"] = "eval.run"
    created_at: int
    eval_id: str
    name: str
    model: str
    status: str
    metadata: dict[str, Any] | None = None
    data_source: dict[str, Any]
    """As created (every filter of a `stored_completions` source shown, null where not given)."""
    error: RunError | None = None
    result_counts: dict[str, int]
    """`total`, `errored`, `failed`, `passed` (so far, while the run is in progress)."""
    per_testing_criteria_results: list[dict[str, Any]]
    """`[{"testing_criteria": name, "passed": n, "failed": n}]`, in the eval's order."""
    per_model_usage: list[dict[str, Any]]
    """`[{"model_name", "invocation_count", "prompt_tokens", "completion_tokens", "total_tokens",
    "cached_tokens"}]`: the sampled model and any model graders."""
    report_url: str
    """The API path of the run's output items. The dashboard's evals page lists runs with their pass rates
    but has no page of one run's items to link to."""

    @classmethod
    def from_row(cls, row: RunRow) -> EvalRun:
        return cls(
            id=row.id,
            created_at=ts(row.created_at) or 0,
            eval_id=row.eval_id,
            name=row.name,
            model=row.model,
            status=row.status,
            metadata=row.metadata,
            data_source={k: v for k, v in row.data_source.items() if k != STORED_IDS},
            error=RunError(**row.error) if row.error else None,
            result_counts=row.result_counts,
            per_testing_criteria_results=row.per_testing_criteria_results,
            per_model_usage=row.per_model_usage,
            report_url=f"/v1/evals/{row.eval_id}/runs/{row.id}/output_items",
        )


class EvalRunDeleted(OpenAIBaseModel):
    object: Literal["eval.run.deleted"] = "eval.run.deleted"
    deleted: bool = True
    run_id: str


class OutputItem(OpenAIBaseModel):
    id: str
    object: Literal["eval.run.output_item"] = "eval.run.output_item"
    created_at: int
    run_id: str
    eval_id: str
    status: str
    """`pass` (every criterion passed), `fail`, or `error` (sampling or a grader failed; `sample.error` or
    the result's `error` says why)."""
    datasource_item_id: int
    """The item's index in the data source, from 0."""
    datasource_item: dict[str, Any]
    results: list[dict[str, Any]]
    """Per criterion: `name`, `type`, `score`, `passed`, `sample` (null), and `error` when it could not
    grade."""
    sample: dict[str, Any]
    """`input`, `output`, `finish_reason`, `model`, `usage`, `error`, and the sampling parameters used."""

    @classmethod
    def from_row(cls, row: ItemRow) -> OutputItem:
        return cls(
            id=row.id,
            created_at=ts(row.created_at) or 0,
            run_id=row.run_id,
            eval_id=row.eval_id,
            status=row.status,
            datasource_item_id=row.datasource_item_id,
            datasource_item=row.datasource_item,
            results=row.results,
            sample=row.sample,
        )

"""Evals API: evals (create, list, retrieve, update, delete), their runs (create -> queued for a worker, list,
retrieve, cancel, delete) and each run's output items.

A run create is checked whole before anything is stored: the data source field by field, the file (the
caller's, of purpose `evals` or `fine-tune`), and every item against the eval's item schema and the run's
input messages, so the worker never meets an item it cannot render. The model is not checked here: each
item's completion is asked of the gateway with the run's own key, so a model the organisation may not use
fails its items with the gateway's own 404, exactly as a client's request would.
"""

from __future__ import annotations

from typing import Any

import anyio

from gateway.deps import Resources
from gateway.errors import InvalidRequest, not_found
from gateway.evals import store, stored
from gateway.evals.datasource import (
    FILE_PURPOSES,
    RunSource,
    check_data_source_config,
    check_rows,
    check_run_source,
    check_testing_criteria,
    iter_rows_of_file,
    render_messages,
    required_properties,
    rows_of_content,
)
from gateway.evals.protocol import (
    Eval,
    EvalCreate,
    EvalDeleted,
    EvalRun,
    EvalRunDeleted,
    EvalUpdate,
    OutputItem,
    RunCreate,
)
from gateway.evals.rows import EvalRow, RunRow
from gateway.evals.stored_source import MAX_STORED_ITEMS, STORED_IDS
from gateway.files import store as files_store
from gateway.graders.checks import check_grader
from gateway.jobs.validation import check_metadata
from gateway.protocol import CursorPage
from gateway.queue import RUN_EVAL, enqueue
from gateway.tenancy.keys import Principal

# -- evals -----------------------------------------------------------------------------------------------


async def create_eval(res: Resources, who: Principal, body: EvalCreate) -> Eval:
    check_metadata(body.metadata)
    config = check_data_source_config(body.data_source_config)
    criteria = check_testing_criteria(body.testing_criteria)
    for i, criterion in enumerate(criteria):
        await check_grader(res, who.organization_id, criterion, f"testing_criteria[{i}]")
    row = await store.insert_eval(
        res.pool,
        org_id=who.organization_id,
        name=body.name or "",
        metadata=body.metadata,
        data_source_config=config,
        testing_criteria=criteria,
    )
    return Eval.from_row(row)


async def _eval_row(res: Resources, who: Principal, eval_id: str) -> EvalRow:
    row = await store.get_eval(res.pool, org_id=who.organization_id, eval_id=eval_id)
    if row is None:
        raise not_found("eval", eval_id, param="eval_id")
    return row


async def get_eval(res: Resources, who: Principal, eval_id: str) -> Eval:
    return Eval.from_row(await _eval_row(res, who, eval_id))


async def list_evals(
    res: Resources, who: Principal, *, after: str | None, limit: int, order: str, order_by: str
) -> CursorPage[Eval]:
    rows = await store.list_evals(
        res.pool, org_id=who.organization_id, after=after, limit=limit + 1, order=order, order_by=order_by
    )
    return CursorPage[Eval].of([Eval.from_row(r) for r in rows], limit)


async def update_eval(res: Resources, who: Principal, eval_id: str, body: EvalUpdate) -> Eval:
    check_metadata(body.metadata)
    row = await store.update_eval(
        res.pool, org_id=who.organization_id, eval_id=eval_id, name=body.name, metadata=body.metadata
    )
    if row is None:
        raise not_found("eval", eval_id, param="eval_id")
    return Eval.from_row(row)


async def delete_eval(res: Resources, who: Principal, eval_id: str) -> EvalDeleted:
    """Delete an eval, its runs (a worker running one stops at its next heartbeat) and their items."""
    if not await store.delete_eval(res.pool, org_id=who.organization_id, eval_id=eval_id):
        raise not_found("eval", eval_id, param="eval_id")
    return EvalDeleted(eval_id=eval_id)


# -- runs ------------------------------------------------------------------------------------------------


async def _check_items(res: Resources, who: Principal, run: RunSource, item_schema: dict[str, Any]) -> None:
    """The run's items checked (`check_rows`, in a thread): those of the request itself, or those of the
    caller's file, read line by line as they are checked (a file is never held whole in the gateway)."""
    if run.file_id is None:
        rows = rows_of_content(run.source["content"])
        await anyio.to_thread.run_sync(check_rows, run, rows, item_schema)
        return
    file = await files_store.get(res.pool, org_id=who.organization_id, file_id=run.file_id)
    if file is None:
        raise InvalidRequest(
            f"File '{run.file_id}' does not exist.", param="data_source.source.id", code="invalid_file"
        )
    if file.purpose not in FILE_PURPOSES:
        raise InvalidRequest(
            f"File '{run.file_id}' has purpose '{file.purpose}'; expected one of {', '.join(FILE_PURPOSES)}.",
            param="data_source.source.id",
            code="invalid_file_purpose",
        )
    path = res.blobs.path(file.blob_key)
    max_line, max_depth = res.settings.max_jsonl_line_bytes, res.settings.max_json_depth
    await anyio.to_thread.run_sync(
        lambda: check_rows(
            run, iter_rows_of_file(path, max_line_bytes=max_line, max_depth=max_depth), item_schema
        )
    )


async def _select_stored(res: Resources, who: Principal, run: RunSource, ev: EvalRow) -> list[str]:
    """The ids of the stored completions a run grades (the caller's organisation's only), its items checked
    against the eval's item schema and, where the run samples anew, its input messages."""
    source = run.source
    config = ev.data_source_config
    ids = await stored.select_ids(
        res.pool,
        org_id=who.organization_id,
        eval_metadata=config.get("metadata") or {} if config["type"] == "stored_completions" else {},
        run_metadata=source["metadata"] or {},
        model=source["model"],
        created_after=source["created_after"],
        created_before=source["created_before"],
        limit=source["limit"] or MAX_STORED_ITEMS + 1,  # one more than a run takes: too many to grade
    )
    if len(ids) > MAX_STORED_ITEMS:
        raise InvalidRequest(
            f"More than {MAX_STORED_ITEMS} stored completions match; narrow the filters or set a limit.",
            param="data_source.source.limit",
        )
    if not ids:
        raise InvalidRequest(
            "No stored completions of this organisation match the data source's filters (and the eval's "
            "metadata).",
            param="data_source.source",
        )
    missing = [
        k for k in required_properties(config["schema"]["properties"]["item"]) if k not in stored.ITEM_KEYS
    ]
    if missing:
        raise InvalidRequest(
            f"The items of stored completions lack the properties the eval's item_schema requires: "
            f"{', '.join(missing)}.",
            param="data_source.source",
            code="invalid_item",
        )
    if run.input_messages is not None:
        for start in range(0, len(ids), stored.READ_CHUNK):
            rows = await stored.rows_by_ids(
                res.pool, org_id=who.organization_id, ids=ids[start : start + stored.READ_CHUNK]
            )
            for offset, row in enumerate(rows):
                render_messages(run.input_messages, row.item, index=start + offset)
    return ids


async def create_run(res: Resources, who: Principal, eval_id: str, body: RunCreate) -> EvalRun:
    ev = await _eval_row(res, who, eval_id)
    check_metadata(body.metadata)
    run = check_run_source(body.data_source)
    data_source: dict[str, Any] = {"type": run.type, "source": run.source}
    if run.stored:
        data_source[STORED_IDS] = await _select_stored(res, who, run, ev)
    else:
        await _check_items(res, who, run, ev.data_source_config["schema"]["properties"]["item"])
    if run.type == "completions":
        data_source |= {
            "model": run.model or None,
            "input_messages": run.input_messages,
            "sampling_params": run.sampling if run.model else None,
        }
    row = await store.insert_run(
        res.pool,
        eval_id=eval_id,
        org_id=who.organization_id,
        api_key_id=who.api_key_id,
        name=body.name or run.model or run.type,
        model=run.model or run.source.get("model") or "",
        metadata=body.metadata,
        data_source=data_source,
        testing_criteria=ev.testing_criteria,
    )
    await enqueue(res.queue, res.settings.queue_name, row.id, row.queue_generation, function=RUN_EVAL)
    return EvalRun.from_row(row)


async def _run_row(res: Resources, who: Principal, eval_id: str, run_id: str) -> RunRow:
    row = await store.get_run(res.pool, org_id=who.organization_id, eval_id=eval_id, run_id=run_id)
    if row is None:
        raise not_found("eval run", run_id, param="run_id")
    return row


async def get_run(res: Resources, who: Principal, eval_id: str, run_id: str) -> EvalRun:
    return EvalRun.from_row(await _run_row(res, who, eval_id, run_id))


async def list_runs(
    res: Resources,
    who: Principal,
    eval_id: str,
    *,
    status: str | None,
    after: str | None,
    limit: int,
    order: str,
) -> CursorPage[EvalRun]:
    await _eval_row(res, who, eval_id)
    rows = await store.list_runs(
        res.pool,
        org_id=who.organization_id,
        eval_id=eval_id,
        status=status,
        after=after,
        limit=limit + 1,
        order=order,
    )
    return CursorPage[EvalRun].of([EvalRun.from_row(r) for r in rows], limit)


async def cancel_run(res: Resources, who: Principal, eval_id: str, run_id: str) -> EvalRun:
    """Cancel a queued or running run: its worker starts no item after it sees the change (its next
    heartbeat), keeps the items already graded, and revokes the run's key."""
    row = await store.cancel_run(res.pool, org_id=who.organization_id, eval_id=eval_id, run_id=run_id)
    if row is None:
        current = await _run_row(res, who, eval_id, run_id)  # 404 for unknown or foreign ids
        raise InvalidRequest(
            f"Cannot cancel a run whose status is '{current.status}'.",
            param="run_id",
            code="invalid_state",
        )
    return EvalRun.from_row(row)


async def delete_run(res: Resources, who: Principal, eval_id: str, run_id: str) -> EvalRunDeleted:
    row = await store.delete_run(res.pool, org_id=who.organization_id, eval_id=eval_id, run_id=run_id)
    if row is None:
        raise not_found("eval run", run_id, param="run_id")
    return EvalRunDeleted(run_id=run_id)


# -- output items ----------------------------------------------------------------------------------------


async def list_output_items(
    res: Resources,
    who: Principal,
    eval_id: str,
    run_id: str,
    *,
    status: str | None,
    after: str | None,
    limit: int,
    order: str,
) -> CursorPage[OutputItem]:
    await _run_row(res, who, eval_id, run_id)
    rows = await store.list_items(
        res.pool,
        org_id=who.organization_id,
        run_id=run_id,
        status=status,
        after=after,
        limit=limit + 1,
        order=order,
    )
    return CursorPage[OutputItem].of([OutputItem.from_row(r) for r in rows], limit)


async def get_output_item(
    res: Resources, who: Principal, eval_id: str, run_id: str, item_id: str
) -> OutputItem:
    row = await store.get_item(
        res.pool, org_id=who.organization_id, eval_id=eval_id, run_id=run_id, item_id=item_id
    )
    if row is None:
        raise not_found("output item", item_id, param="output_item_id")
    return OutputItem.from_row(row)

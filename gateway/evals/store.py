"""Evals, runs and output items: plain SQL.

API statements take the caller's organisation and filter by it, so another organisation's ids find
nothing (and answer 404). Worker statements take a run id and the worker's id: a run's state changes are
single statements guarded by its status and its holder, as for fine-tuning jobs, so the API (cancel,
delete), the worker and the reaper cannot race a run into an impossible state. The runs' lease
(`RUN_LEASE`, `gateway.work.lease`) is this table's part of the lifecycle every kind of held work shares.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from gateway.db import Conn, maybe_row_to, row_to, rows_to
from gateway.evals.rows import DoneItem, EvalRow, ItemRow, RunRow
from gateway.ids import new_id
from gateway.queue import RUN_EVAL
from gateway.settings import Settings
from gateway.tenancy import scoped
from gateway.work.lease import Lease, StaleWork

# -- evals -----------------------------------------------------------------------------------------------

INSERT_EVAL = """
INSERT INTO evals (id, organization_id, name, metadata, data_source_config, testing_criteria)
VALUES ($1, $2, $3, $4, $5, $6) RETURNING *"""
GET_EVAL = "SELECT * FROM evals WHERE id = $1 AND organization_id = $2"
UPDATE_EVAL = """
UPDATE evals SET name = coalesce($3, name), metadata = coalesce($4, metadata), updated_at = now()
WHERE id = $1 AND organization_id = $2 RETURNING *"""
DELETE_EVAL = "DELETE FROM evals WHERE id = $1 AND organization_id = $2 RETURNING id"
# A page after the row `$2` (NULL: the first page), by creation or by last update, either way round.
_LIST_EVALS = """
SELECT * FROM evals e
WHERE e.organization_id = $1
  AND ($2::text IS NULL
       OR ({key}) {op} (SELECT {key} FROM evals e WHERE e.id = $2 AND e.organization_id = $1))
ORDER BY {key_order} LIMIT $3"""
LIST_EVALS = {
    (by, order): _LIST_EVALS.format(
        key=key,
        op=">" if order == "asc" else "<",
        key_order=", ".join(f"{k} {order}" for k in key.split(", ")),
    )
    for by, key in (("created_at", "e.seq"), ("updated_at", "e.updated_at, e.seq"))
    for order in ("asc", "desc")
}

# -- runs ------------------------------------------------------------------------------------------------

INSERT_RUN = """
INSERT INTO eval_runs (id, eval_id, organization_id, api_key_id, name, model, metadata, data_source,
    testing_criteria, queue_generation)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, 1) RETURNING *"""
GET_RUN = "SELECT * FROM eval_runs WHERE id = $1 AND eval_id = $2 AND organization_id = $3"
GET_RUN_ANY = "SELECT * FROM eval_runs WHERE id = $1"
_LIST_RUNS = """
SELECT * FROM eval_runs
WHERE eval_id = $1 AND organization_id = $2 AND ($3::text IS NULL OR status = $3)
  AND ($4::text IS NULL OR seq {op} (SELECT seq FROM eval_runs WHERE id = $4 AND eval_id = $1))
ORDER BY seq {order} LIMIT $5"""
LIST_RUNS = {
    order: _LIST_RUNS.format(op=">" if order == "asc" else "<", order=order) for order in ("asc", "desc")
}
CANCEL_RUN = """
UPDATE eval_runs SET status = 'canceled', finished_at = now()
WHERE id = $1 AND eval_id = $2 AND organization_id = $3 AND status IN ('queued', 'in_progress')
RETURNING *"""
DELETE_RUN = "DELETE FROM eval_runs WHERE id = $1 AND eval_id = $2 AND organization_id = $3 RETURNING *"

# -- output items ----------------------------------------------------------------------------------------

_LIST_ITEMS = """
SELECT * FROM eval_run_output_items
WHERE run_id = $1 AND organization_id = $2 AND ($3::text IS NULL OR status = $3)
  AND ($4::text IS NULL OR datasource_item_id {op}
       (SELECT datasource_item_id FROM eval_run_output_items WHERE id = $4 AND run_id = $1))
ORDER BY datasource_item_id {order} LIMIT $5"""
LIST_ITEMS = {
    order: _LIST_ITEMS.format(op=">" if order == "asc" else "<", order=order) for order in ("asc", "desc")
}
GET_ITEM = """
SELECT * FROM eval_run_output_items
WHERE id = $1 AND run_id = $2 AND eval_id = $3 AND organization_id = $4"""

# -- the worker ------------------------------------------------------------------------------------------

CLAIM_RUN = """
UPDATE eval_runs
SET status = 'in_progress', worker_id = $2, heartbeat_at = now(), attempts = attempts + 1,
    started_at = coalesce(started_at, now()), worker_key_id = NULL
WHERE id = $1 AND status = 'queued' AND worker_id IS NULL RETURNING *"""
SET_WORKER_KEY = "UPDATE eval_runs SET worker_key_id = $3 WHERE id = $1 AND worker_id = $2"
# The run's status while this worker holds it; no row when it was taken from it (or deleted).
HEARTBEAT_RUN = """
UPDATE eval_runs SET heartbeat_at = now() WHERE id = $1 AND worker_id = $2 RETURNING status"""
# An item is recorded only while its worker holds the run in progress: the share lock orders it against a
# cancel (or a delete), so no item is recorded after a cancel returned. No row back: the run was let go.
INSERT_ITEM = """
INSERT INTO eval_run_output_items (id, run_id, eval_id, organization_id, datasource_item_id, datasource_item,
    status, results, sample, usage)
SELECT $1, r.id, r.eval_id, r.organization_id, $3, $4, $5, $6, $7, $8
FROM eval_runs r WHERE r.id = $2 AND r.worker_id = $9 AND r.status = 'in_progress'
FOR SHARE
ON CONFLICT (run_id, datasource_item_id) DO NOTHING
RETURNING id"""
UPDATE_SUMMARY = """
UPDATE eval_runs SET result_counts = $3, per_testing_criteria_results = $4, per_model_usage = $5
WHERE id = $1 AND worker_id = $2"""
DONE_ITEMS = """
SELECT datasource_item_id, status, results, usage, sample -> 'error' AS sample_error
FROM eval_run_output_items WHERE run_id = $1 ORDER BY datasource_item_id"""
FINISH_RUN = """
UPDATE eval_runs SET status = $3, error = $4, finished_at = now(), worker_id = NULL
WHERE id = $1 AND worker_id = $2 AND status = 'in_progress' RETURNING *"""
RELEASE_RUN = "UPDATE eval_runs SET worker_id = NULL WHERE id = $1 AND worker_id = $2 RETURNING *"
REQUEUE_OWN_RUN = """
UPDATE eval_runs SET status = 'queued', worker_id = NULL, queue_generation = queue_generation + 1
WHERE id = $1 AND worker_id = $2 AND status = 'in_progress' RETURNING queue_generation"""
QUEUED_UNCLAIMED_RUNS = """
SELECT id, queue_generation FROM eval_runs WHERE status = 'queued' AND worker_id IS NULL
ORDER BY created_at LIMIT 1000"""
STALE_RUNS = """
SELECT id, organization_id, attempts, worker_id, worker_key_id FROM eval_runs
WHERE worker_id IS NOT NULL AND heartbeat_at < now() - make_interval(secs => $1)"""
REQUEUE_STALE_RUN = """
UPDATE eval_runs
SET status = CASE WHEN status = 'in_progress' THEN 'queued' ELSE status END,
    worker_id = NULL,
    queue_generation = queue_generation + CASE WHEN status = 'in_progress' THEN 1 ELSE 0 END
WHERE id = $1 AND worker_id = $2 RETURNING status = 'queued' AS queued, queue_generation"""
FAIL_STALE_RUN = """
UPDATE eval_runs SET status = 'failed', error = $3, finished_at = now(), worker_id = NULL
WHERE id = $1 AND worker_id = $2 AND status = 'in_progress' RETURNING *"""


# -- evals -----------------------------------------------------------------------------------------------


async def insert_eval(
    conn: Conn,
    *,
    org_id: str,
    name: str,
    metadata: dict[str, Any] | None,
    data_source_config: dict[str, Any],
    testing_criteria: list[dict[str, Any]],
) -> EvalRow:
    record = await conn.fetchrow(
        INSERT_EVAL, new_id("eval_"), org_id, name, metadata, data_source_config, testing_criteria
    )
    return row_to(EvalRow, record)


async def get_eval(conn: Conn, *, org_id: str, eval_id: str) -> EvalRow | None:
    return maybe_row_to(EvalRow, await conn.fetchrow(GET_EVAL, eval_id, org_id))


async def update_eval(
    conn: Conn, *, org_id: str, eval_id: str, name: str | None, metadata: dict[str, Any] | None
) -> EvalRow | None:
    return maybe_row_to(EvalRow, await conn.fetchrow(UPDATE_EVAL, eval_id, org_id, name, metadata))


async def delete_eval(conn: Conn, *, org_id: str, eval_id: str) -> bool:
    """Delete an eval with its runs and their output items."""
    return await conn.fetchval(DELETE_EVAL, eval_id, org_id) is not None


async def list_evals(
    conn: Conn, *, org_id: str, after: str | None, limit: int, order: str, order_by: str
) -> list[EvalRow]:
    return rows_to(EvalRow, await conn.fetch(LIST_EVALS[(order_by, order)], org_id, after, limit))


# -- runs ------------------------------------------------------------------------------------------------


async def insert_run(
    conn: Conn,
    *,
    eval_id: str,
    org_id: str,
    api_key_id: str,
    name: str,
    model: str,
    metadata: dict[str, Any] | None,
    data_source: dict[str, Any],
    testing_criteria: list[dict[str, Any]],
) -> RunRow:
    record = await conn.fetchrow(
        INSERT_RUN,
        new_id("evalrun_"),
        eval_id,
        org_id,
        api_key_id,
        name,
        model,
        metadata,
        data_source,
        testing_criteria,
    )
    return row_to(RunRow, record)


async def get_run(conn: Conn, *, org_id: str, eval_id: str, run_id: str) -> RunRow | None:
    return maybe_row_to(RunRow, await conn.fetchrow(GET_RUN, run_id, eval_id, org_id))


async def get_run_any(conn: Conn, *, run_id: str) -> RunRow | None:
    """A run by id alone: for the worker, which acts for every organisation."""
    return maybe_row_to(RunRow, await conn.fetchrow(GET_RUN_ANY, run_id))


async def list_runs(
    conn: Conn, *, org_id: str, eval_id: str, status: str | None, after: str | None, limit: int, order: str
) -> list[RunRow]:
    return rows_to(RunRow, await conn.fetch(LIST_RUNS[order], eval_id, org_id, status, after, limit))


async def cancel_run(conn: Conn, *, org_id: str, eval_id: str, run_id: str) -> RunRow | None:
    return maybe_row_to(RunRow, await conn.fetchrow(CANCEL_RUN, run_id, eval_id, org_id))


async def delete_run(conn: Conn, *, org_id: str, eval_id: str, run_id: str) -> RunRow | None:
    return maybe_row_to(RunRow, await conn.fetchrow(DELETE_RUN, run_id, eval_id, org_id))


# -- output items ----------------------------------------------------------------------------------------


async def list_items(
    conn: Conn, *, org_id: str, run_id: str, status: str | None, after: str | None, limit: int, order: str
) -> list[ItemRow]:
    return rows_to(ItemRow, await conn.fetch(LIST_ITEMS[order], run_id, org_id, status, after, limit))


async def get_item(conn: Conn, *, org_id: str, eval_id: str, run_id: str, item_id: str) -> ItemRow | None:
    return maybe_row_to(ItemRow, await conn.fetchrow(GET_ITEM, item_id, run_id, eval_id, org_id))


# -- the worker ------------------------------------------------------------------------------------------


async def claim_run(conn: Conn, *, run_id: str, worker_id: str) -> RunRow | None:
    return maybe_row_to(RunRow, await conn.fetchrow(CLAIM_RUN, run_id, worker_id))


async def set_worker_key(conn: Conn, *, run_id: str, worker_id: str, key_id: str) -> None:
    await conn.execute(SET_WORKER_KEY, run_id, worker_id, key_id)


async def heartbeat_run(conn: Conn, *, run_id: str, worker_id: str) -> str | None:
    """The run's status, or None when this worker no longer holds it."""
    return await conn.fetchval(HEARTBEAT_RUN, run_id, worker_id)


async def insert_item(
    conn: Conn,
    *,
    run_id: str,
    worker_id: str,
    index: int,
    item: dict[str, Any],
    status: str,
    results: list[dict[str, Any]],
    sample: dict[str, Any],
    usage: dict[str, dict[str, int]],
) -> bool:
    """Record one output item; False when the worker no longer holds the run in progress (canceled,
    deleted, taken back), or the item was already recorded."""
    written = await conn.fetchval(
        INSERT_ITEM, new_id("outputitem_"), run_id, index, item, status, results, sample, usage, worker_id
    )
    return written is not None


async def update_summary(
    conn: Conn,
    *,
    run_id: str,
    worker_id: str,
    result_counts: dict[str, int],
    per_testing_criteria_results: list[dict[str, Any]],
    per_model_usage: list[dict[str, Any]],
) -> None:
    await conn.execute(
        UPDATE_SUMMARY, run_id, worker_id, result_counts, per_testing_criteria_results, per_model_usage
    )


async def done_items(conn: Conn, *, run_id: str) -> list[DoneItem]:
    """The output items a run already has (an earlier attempt's): resumed runs skip them."""
    return rows_to(DoneItem, await conn.fetch(DONE_ITEMS, run_id))


async def finish_run(
    conn: Conn, *, run_id: str, worker_id: str, status: str, error: dict[str, Any] | None
) -> RunRow | None:
    return maybe_row_to(RunRow, await conn.fetchrow(FINISH_RUN, run_id, worker_id, status, error))


async def release_run(conn: Conn, *, run_id: str, worker_id: str) -> RunRow | None:
    return maybe_row_to(RunRow, await conn.fetchrow(RELEASE_RUN, run_id, worker_id))


# -- the lease -------------------------------------------------------------------------------------------


async def _revoke_key(pool: asyncpg.Pool, row: StaleWork) -> None:
    """Revoke the key minted for a lost worker's run (it would live on until it expires)."""
    if row.row["worker_key_id"]:
        await scoped.revoke(pool, row.row["worker_key_id"])


def _give_up(row: StaleWork, settings: Settings) -> dict[str, Any]:
    message = f"The run's worker was lost {row.attempts} times; giving up."
    return {"code": "max_attempts_exceeded", "message": message}


RUN_LEASE = Lease(
    kind="eval_run",
    function=RUN_EVAL,
    claim=CLAIM_RUN,
    heartbeat=HEARTBEAT_RUN,
    release=RELEASE_RUN,
    queued_unclaimed=QUEUED_UNCLAIMED_RUNS,
    stale=STALE_RUNS,
    fail_stale=FAIL_STALE_RUN,
    give_up=_give_up,
    requeue_own=REQUEUE_OWN_RUN,
    requeue_stale=REQUEUE_STALE_RUN,
    on_stale=_revoke_key,
)
"""An eval run held by a worker (`gateway.worker.evals`): a run taken back resumes with the items it lacks."""

"""Eval runs in the worker, in arq's idiom: `run_eval` executes one run. Runs that missed the queue, and
runs of workers that died, are the runs' lease's (`gateway.evals.store.RUN_LEASE`, `gateway.work.lease`).

A run goes through the gateway's own inference path, never to an engine directly. The worker mints a key
of the run's organisation for the run (`gateway.tenancy.scoped`), asks `POST {gateway_url}/v1/chat/
completions` for each item's completion with it, and grades the completion with the eval's criteria
(`gateway.evals.grading`: model graders call the gateway with the same key, python graders run in the
sandbox). So the run's requests are scoped to its organisation (another organisation's model answers the
gateway's 404, which fails the item), rate-limited, held to the budget and metered like a client's, under
the key's own id. The key is renewed by the run's heartbeat and revoked when the run ends; a dead worker's
key expires within `KEY_TTL_S`, and the reaper revokes it when it takes the run back.

A queue message only wakes a worker: `run_eval` claims the run in one SQL statement, so a run is executed
once. An item is recorded only while its worker holds the run in progress, and the heartbeat reads the
run's status, so a cancel (or a delete) stops the run between items. Items are written once each
(`UNIQUE (run_id, datasource_item_id)`), so a run taken back from a dead worker resumes with the items it
lacks.

A run's items file is read as its items are taken (`gateway.worker.eval_items`), never held whole: the
worker holds the items read ahead and those in flight, whatever the size of the file. A run over stored
completions reads them by id the same way (the ids its create selected, of the run's organisation only), and
grades their stored answers as they are unless the run names a model to sample.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import Any

import asyncpg
import httpx

from envsdk.graders import make_sample
from envsdk.inference_client import InferenceClient
from envsdk.python_grader import PythonGraders
from gateway.errors import InvalidRequest
from gateway.evals import store
from gateway.evals.datasource import Row, render_messages
from gateway.evals.grading import Summary, add_usage, grade_item, item_status
from gateway.evals.rows import RunRow
from gateway.evals.samples import sample_of
from gateway.tenancy import scoped
from gateway.work import lease
from gateway.worker.context import JobContext
from gateway.worker.eval_items import ITEMS_IN_FLIGHT, PendingItems

logger = logging.getLogger(__name__)

KEY_TTL_S = 300.0
"""Life of a run's key between renewals (the heartbeat renews it every third of that)."""
SAMPLE_TIMEOUT_S = 300.0
"""Longest wait for one completion."""
SAMPLE_TRIES = 3
"""Attempts of one completion when the gateway is unreachable, answers 5xx, or rate-limits briefly."""
RATE_LIMIT_WAIT_S = 10.0
"""Longest `retry-after` a rate-limited completion waits out before its item errors."""


def _envelope(resp: httpx.Response) -> dict[str, str]:
    """An error answer of the gateway as `{"code", "message"}`."""
    try:
        error = resp.json().get("error") or {}
    except ValueError:
        error = {}
    return {
        "code": str(error.get("code") or f"http_{resp.status_code}"),
        "message": str(error.get("message") or resp.text[:500] or f"HTTP {resp.status_code}"),
    }


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


class EvalRunExecution:
    """One claimed run, from its items to its end."""

    def __init__(self, ctx: JobContext[RunRow]) -> None:
        self.ctx = ctx
        self.criteria: list[dict[str, Any]] = ctx.row.testing_criteria
        self.source: dict[str, Any] = ctx.row.data_source
        self.summary = Summary([c["name"] for c in self.criteria])
        self.stopped: str | None = None
        """Why no new item starts: the run's status when it left `in_progress` (`canceled`), or `lost`."""
        self._write = asyncio.Lock()

    async def execute(self) -> str:
        """Sample and grade every item the run lacks; returns how the run ended."""
        async with scoped.minted(
            self.ctx.pool,
            org_id=self.ctx.org_id,
            kind="eval",
            name=f"eval run {self.ctx.id}",
            ttl_s=KEY_TTL_S,
        ) as key:
            await store.set_worker_key(
                self.ctx.pool, run_id=self.ctx.id, worker_id=self.ctx.worker_id, key_id=key.id
            )
            heartbeat = asyncio.create_task(self._heartbeat(key.id))
            try:
                return await self._execute(key.secret)
            finally:
                heartbeat.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await heartbeat

    async def _execute(self, secret: str) -> str:
        done = set()
        for item in await store.done_items(self.ctx.pool, run_id=self.ctx.id):
            done.add(item.datasource_item_id)
            self.summary.add(item.status, item.results, item.usage, item.sample_error)
        try:
            items = await PendingItems.open(self.ctx, done=done)
        except InvalidRequest as exc:
            return await self._finish(
                "failed", {"code": exc.code or "invalid_data_source", "message": exc.message}
            )
        gateway = self.ctx.settings.internal_gateway_url()
        inference = InferenceClient(f"{gateway}/v1", api_key=secret, timeout=SAMPLE_TIMEOUT_S)
        python = PythonGraders(
            allow_unsandboxed=self.ctx.settings.allow_unsandboxed_environments,
            maxima=self.ctx.settings.sandbox_maxima(),
        )
        http = httpx.AsyncClient(
            base_url=gateway, headers={"Authorization": f"Bearer {secret}"}, timeout=SAMPLE_TIMEOUT_S
        )
        try:

            async def lane() -> None:
                while not self.stopped and (taken := await items.take()) is not None:
                    await self._item(*taken, http, inference, python)

            async with asyncio.TaskGroup() as lanes:  # a lane that fails stops the others
                for _ in range(ITEMS_IN_FLIGHT):
                    lanes.create_task(lane())
        finally:
            items.close()
            await http.aclose()
            await asyncio.to_thread(inference.close)
            await asyncio.to_thread(python.close)
        if items.error is not None and self.stopped is None:
            return await self._finish("failed", items.error)
        return await self._end()

    async def _heartbeat(self, key_id: str) -> None:
        renewed = time.monotonic()
        while self.stopped is None:
            await asyncio.sleep(self.ctx.settings.heartbeat_interval_s)
            try:
                status = await store.heartbeat_run(
                    self.ctx.pool, run_id=self.ctx.id, worker_id=self.ctx.worker_id
                )
                if time.monotonic() - renewed > KEY_TTL_S / 3:
                    await scoped.renew(self.ctx.pool, key_id, ttl_s=KEY_TTL_S)
                    renewed = time.monotonic()
            except (OSError, asyncpg.PostgresError) as exc:
                logger.warning("eval run %s: heartbeat failed: %s", self.ctx.id, exc)
                continue
            if status != "in_progress":
                self.stopped = status or "lost"
                logger.info("eval run %s: stopping (%s)", self.ctx.id, self.stopped)

    async def _sample(
        self, http: httpx.AsyncClient, body: dict[str, Any]
    ) -> tuple[dict[str, Any] | None, dict[str, str] | None]:
        """`(completion, None)` or `(None, {"code", "message"})` — the gateway's own error when it refused."""
        error: dict[str, str] = {"code": "gateway_unreachable", "message": "no attempt was made"}
        for attempt in range(SAMPLE_TRIES):
            last = attempt == SAMPLE_TRIES - 1
            try:
                resp = await http.post("/v1/chat/completions", json=body)
            except httpx.HTTPError as exc:
                error = {"code": "gateway_unreachable", "message": f"{type(exc).__name__}: {exc}"}
                if not last:
                    await asyncio.sleep(1.0 + attempt)
                continue
            if resp.status_code == 200:
                try:
                    return resp.json(), None
                except ValueError:
                    return None, {"code": "invalid_response", "message": resp.text[:500]}
            error = _envelope(resp)
            if resp.status_code == 429 and error["code"] == "rate_limit_exceeded" and not last:
                wait = _seconds(resp.headers.get("retry-after"))
                if wait is not None and wait <= RATE_LIMIT_WAIT_S:
                    await asyncio.sleep(wait)
                    continue
            elif resp.status_code >= 500 and not last:
                await asyncio.sleep(1.0 + attempt)
                continue
            break
        return None, error

    async def _item(
        self, index: int, row: Row, http: httpx.AsyncClient, inference: InferenceClient, python: PythonGraders
    ) -> None:
        sampling: dict[str, Any] = self.source.get("sampling_params") or {}
        usage: dict[str, dict[str, int]] = {}
        results: list[dict[str, Any]] = []
        if row.record is not None and not self.source.get("model"):  # a stored answer, graded as it is
            sample, namespace = row.record, row.sample or {}
        elif self.source["type"] == "jsonl":
            given = row.sample or {}
            text = str(given.get("output_text", ""))
            sample = {
                "input": [],
                "output": [{"role": "assistant", "content": text}],
                "finish_reason": given.get("finish_reason", "stop"),
                "model": given.get("model", ""),
                "usage": dict.fromkeys(
                    ("prompt_tokens", "completion_tokens", "total_tokens", "cached_tokens"), 0
                ),
                "error": None,
            }
            namespace = {**make_sample(text), **given}
        else:
            reply: dict[str, Any] | None = None
            error: dict[str, str] | None
            try:
                messages = render_messages(self.source["input_messages"], row.item, index=index)
            except InvalidRequest as exc:  # a stored completion deleted, or its metadata changed, since
                messages, error = [], {"code": exc.code or "invalid_item", "message": exc.message}
            else:
                body = {"model": self.ctx.row.model, "messages": messages, **sampling}
                reply, error = await self._sample(http, body)
            sample, namespace = sample_of(messages, sampling, reply, error, model=self.ctx.row.model)
            if reply is not None:
                add_usage(usage, self.ctx.row.model, reply.get("usage") or {}, invocations=1)
        if sample["error"] is None:
            results, grader_usage = await asyncio.to_thread(
                grade_item,
                self.criteria,
                namespace,
                row.item,
                inference=inference,
                python=python,
                max_text_chars=self.ctx.settings.grader_max_text_chars,
            )
            for model, tokens in grader_usage.items():
                add_usage(usage, model, tokens, invocations=tokens["invocation_count"])
        status = item_status(results, sample["error"])
        async with self._write:
            written = await store.insert_item(
                self.ctx.pool,
                run_id=self.ctx.id,
                worker_id=self.ctx.worker_id,
                index=index,
                item=row.item,
                status=status,
                results=results,
                sample=sample,
                usage=usage,
            )
            if not written:  # canceled, deleted or taken back (else a duplicate): start no other item
                now = await store.heartbeat_run(
                    self.ctx.pool, run_id=self.ctx.id, worker_id=self.ctx.worker_id
                )
                if now != "in_progress":
                    self.stopped = self.stopped or now or "lost"
                return
            self.summary.add(status, results, usage, sample["error"])
            await self._save_summary()

    async def _save_summary(self, conn: asyncpg.Connection | None = None) -> None:
        await store.update_summary(
            conn or self.ctx.pool,
            run_id=self.ctx.id,
            worker_id=self.ctx.worker_id,
            result_counts=self.summary.result_counts(),
            per_testing_criteria_results=self.summary.per_testing_criteria_results(),
            per_model_usage=self.summary.per_model_usage(),
        )

    async def _end(self) -> str:
        if self.stopped == "lost":
            return "lost"
        if self.stopped is not None:  # canceled: keep what was graded, let the run go
            async with self._write:
                await self._save_summary()
            await store.release_run(self.ctx.pool, run_id=self.ctx.id, worker_id=self.ctx.worker_id)
            return self.stopped
        if self.summary.all_errored():
            first = self.summary.first_error or {"code": "all_items_errored", "message": "every item errored"}
            message = f"Every item of the run errored; the first: {first.get('message')}"
            return await self._finish("failed", {"code": str(first.get("code")), "message": message})
        return await self._finish("completed", None)

    async def _finish(self, status: str, error: dict[str, Any] | None) -> str:
        async with self.ctx.pool.acquire() as conn, conn.transaction():
            await self._save_summary(conn)
            row = await store.finish_run(
                conn, run_id=self.ctx.id, worker_id=self.ctx.worker_id, status=status, error=error
            )
        if row is None:  # canceled or taken back at the last moment
            await store.release_run(self.ctx.pool, run_id=self.ctx.id, worker_id=self.ctx.worker_id)
            return "lost"
        return status


# -- arq tasks -------------------------------------------------------------------------------------------


async def run_eval(ctx: dict[str, Any], run_id: str) -> str:
    """Claim eval run `run_id` and execute it. A worker with every eval slot busy leaves the run queued
    (the lease's `requeue_missed` cron offers it again) rather than holding an arq slot while it waits."""
    slots: asyncio.Semaphore = ctx["eval_slots"]
    if slots.locked():
        return "busy"
    async with slots:
        run = await store.claim_run(ctx["pool"], run_id=run_id, worker_id=ctx["worker_id"])
        if run is None:
            return "nothing to claim"
        execution = EvalRunExecution(
            JobContext(run, ctx["worker_id"], ctx["pool"], ctx["blobs"], ctx["settings"])
        )
        try:
            return await execution.execute()
        except asyncio.CancelledError:  # the worker is shutting down: the run goes back to the queue
            await asyncio.shield(lease.hand_back(ctx, store.RUN_LEASE, run_id))
            raise
        except Exception as exc:
            logger.exception("eval run %s: worker error", run_id)
            await store.finish_run(
                ctx["pool"],
                run_id=run_id,
                worker_id=ctx["worker_id"],
                status="failed",
                error={"code": "worker_error", "message": f"{type(exc).__name__}: {exc}"},
            )
            return "failed"

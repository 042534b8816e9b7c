"""Dashboard: a job with 10,000 steps of metrics opens in under a second.

One job of a tenant gets 10,000 metrics events written straight through the jobs store (train loss, reward,
KL, completion length, learning rate at every step, as the worker writes them). Opening its page in the
dashboard is three requests made one after the other, as the browser makes them: the page itself, the job
(`/dashboard/api/v1/fine_tuning/jobs/{id}`, through the session) and the curves
(`/dashboard/data/jobs/{id}/metrics`, thinned to at most 2,000 points). The baseline, measured in the same
run on the same gateway: the plain job retrieve (`GET /v1/fine_tuning/jobs/{id}` with the key). Each is timed
over several rounds, after one warm-up; medians are reported.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from typing import Any

import asyncpg
import httpx

from bench.common import Options, cores, fmt, ratio
from bench.stack import make_tenant, rig
from gateway.db import Conn
from gateway.jobs import store as jobs_store

logger = logging.getLogger(__name__)

STEPS = 10_000


async def job_with_metrics(db: Conn, org_id: str, points: list[dict[str, Any]]) -> str:
    """A supervised job of `org_id` on tiny-chat with `points` as its metrics events, written through the
    jobs store as the worker writes them; returns its id. The JSONB codec must be set on `db`."""
    method = {"type": "supervised", "supervised": {"hyperparameters": {"max_steps": len(points)}}}
    job = await jobs_store.insert(
        db,
        org_id=org_id,
        api_key_id=None,
        model="tiny-chat",
        training_file="file-bench",
        validation_file=None,
        method=method,
        seed=1,
        suffix=None,
        metadata=None,
        integrations=None,
        idempotency_key=None,
        request_hash=None,
    )
    await jobs_store.add_metric_events(db, job_id=job.id, org_id=org_id, points=points)
    return str(job.id)


async def _job_with_metrics(dsn: str, org_id: str, steps: int) -> str:
    """A job of `org_id` with `steps` metrics events (train loss, reward, KL, completion length, learning
    rate at every step); returns its id."""
    points = [
        {
            "step": step,
            "total_steps": steps,
            "train_loss": 2.0 / (1 + step / 500),
            "reward_mean": step / steps,
            "kl": 0.01 * (step % 97) / 97,
            "completion_length_mean": 40 + step % 13,
            "learning_rate": 1e-4,
        }
        for step in range(1, steps + 1)
    ]
    conn = await asyncpg.connect(dsn)
    try:
        await conn.set_type_codec("jsonb", encoder=json.dumps, decoder=json.loads, schema="pg_catalog")
        return await job_with_metrics(conn, org_id, points)
    finally:
        await conn.close()


def _timed(fn: Any, rounds: int) -> tuple[float, Any]:
    fn()  # warm-up
    times, last = [], None
    for _ in range(rounds):
        t0 = time.perf_counter()
        last = fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), last


def run(opts: Options) -> dict[str, Any]:
    steps = 500 if opts.quick else STEPS
    rounds = 3 if opts.quick else 15
    server_core, load_core = cores()
    with rig(opts.workdir / "dashboard", server_core, load_core) as r:
        org_id, key = make_tenant(r.url, r.settings)
        job_id = asyncio.run(_job_with_metrics(r.services.database_url, org_id, steps))
        with httpx.Client(base_url=r.url, timeout=60, trust_env=False) as http:
            http.post("/dashboard/session", json={"key": key}).raise_for_status()

            def open_page() -> dict[str, Any]:
                http.get(f"/dashboard/jobs/{job_id}").raise_for_status()
                http.get(f"/dashboard/api/v1/fine_tuning/jobs/{job_id}").raise_for_status()
                curves = http.get(f"/dashboard/data/jobs/{job_id}/metrics")
                curves.raise_for_status()
                got: dict[str, Any] = curves.json()
                got["bytes"] = len(curves.content)
                return got

            def retrieve() -> None:
                http.get(
                    f"/v1/fine_tuning/jobs/{job_id}", headers={"authorization": f"Bearer {key}"}
                ).raise_for_status()

            open_s, curves = _timed(open_page, rounds)
            base_s, _ = _timed(retrieve, rounds)
    assert curves["count"] == steps, curves["count"]
    return {
        "steps": steps,
        "rounds": rounds,
        "open_ms": open_s * 1000,
        "retrieve_ms": base_s * 1000,
        "open_vs_retrieve": ratio(open_s, base_s),
        "points_drawn": len(curves["steps"]),
        "stride": curves["stride"],
        "curves_bytes": curves["bytes"],
        "under_one_second": open_s < 1.0,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    stride = report["stride"]
    which = "every step" if stride == 1 else f"every {stride}th step and the last"
    return [
        f"A job with {report['steps']:,} steps of metrics events: opening its dashboard page (the page, the "
        f"job and its curves, one after the other) took {fmt(report['open_ms'], '.1f')} ms (median of "
        f"{report['rounds']}), {fmt(report['open_vs_retrieve'], '.1f')}x a plain job retrieve "
        f"({fmt(report['retrieve_ms'], '.1f')} ms) in the same run. The curves drew "
        f"{report['points_drawn']} points ({which}), "
        f"{report['curves_bytes'] / 1024:.0f} KiB. Under a second: {report['under_one_second']}.",
    ]

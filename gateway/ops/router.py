"""Operations: liveness, readiness (database, Redis and enough live workers) and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.db import ping
from gateway.deps import Resources, ResourcesDep
from gateway.work.presence import alive_workers

router = APIRouter(tags=["operations"])


async def _workers_alive(res: Resources) -> int | None:
    """Workers that stamped their presence lately; None when Redis cannot say."""
    if res.queue is None:
        return None
    try:
        settings = res.settings
        return await asyncio.wait_for(
            alive_workers(res.queue, settings.queue_name, settings.worker_alive_after_s), 2.0
        )
    except Exception:  # noqa: BLE001 - unknown is reported as such
        return None


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(res: ResourcesDep) -> Response:
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(ping(res.pool), 2.0)
        checks["database"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["database"] = f"error: {type(exc).__name__}"
    try:
        if res.queue is None:
            raise RuntimeError("no queue configured")
        await asyncio.wait_for(res.queue.ping(), 2.0)
        checks["redis"] = "ok"
    except Exception as exc:  # noqa: BLE001 - any failure means not ready
        checks["redis"] = f"error: {type(exc).__name__}"
    workers = await _workers_alive(res) if checks["redis"] == "ok" else None
    required = res.settings.ready_min_workers
    if required > 0:
        if workers is None:
            checks["workers"] = "error: unknown (Redis cannot say)"
        elif workers < required:
            checks["workers"] = f"error: {workers} alive, {required} required"
        else:
            checks["workers"] = "ok"
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "checks": checks, "workers_alive": workers},
        status_code=200 if ok else 503,
    )


@router.get("/metrics")
async def metrics(request: Request, res: ResourcesDep) -> Response:
    app_metrics = request.app.state.metrics
    workers = await _workers_alive(res)
    app_metrics.workers_alive.set(float("nan") if workers is None else workers)
    return Response(generate_latest(app_metrics.registry), media_type=CONTENT_TYPE_LATEST)

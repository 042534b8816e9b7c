"""Operations: liveness, readiness (database and Redis reachable) and Prometheus metrics."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from gateway.deps import ResourcesDep

router = APIRouter(tags=["operations"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(res: ResourcesDep) -> Response:
    checks: dict[str, str] = {}
    try:
        await asyncio.wait_for(res.pool.fetchval("SELECT 1"), 2.0)
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
    ok = all(v == "ok" for v in checks.values())
    return JSONResponse(
        {"status": "ok" if ok else "unavailable", "checks": checks}, status_code=200 if ok else 503
    )


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    return Response(generate_latest(request.app.state.metrics.registry), media_type=CONTENT_TYPE_LATEST)

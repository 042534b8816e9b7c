"""The gateway application: `create_app(settings)` builds the FastAPI app; resources live in the lifespan."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Depends, FastAPI
from fastapi.responses import ORJSONResponse
from starlette.types import Receive, Scope, Send

from envsdk.sandbox import remove_stale_dirs
from gateway.aliases.router import router as aliases_router
from gateway.billing.router import router as billing_router
from gateway.blobstore import BlobStore
from gateway.capture.capturer import Capturer
from gateway.capture.episodes_router import router as episodes_router
from gateway.capture.export_router import router as export_router
from gateway.capture.router import admin_router as capture_admin_router
from gateway.capture.router import router as capture_router
from gateway.capture.scoring_router import router as scoring_router
from gateway.dashboard.router import install as install_dashboard
from gateway.db import create_pool, migrate
from gateway.deps import Resources
from gateway.errors import install_error_handlers
from gateway.evals.router import router as evals_router
from gateway.files.router import router as files_router
from gateway.graders.router import router as graders_router
from gateway.jobs.router import router as jobs_router
from gateway.limits.buckets import Buckets, make_limits_redis
from gateway.limits.guard import Guard
from gateway.limits.router import router as limits_router
from gateway.middleware import Metrics, RequestContextMiddleware
from gateway.models.router import router as models_router
from gateway.notices import Notices
from gateway.offload import Offload
from gateway.ops.router import router as ops_router
from gateway.queue import make_queue
from gateway.serving.engines import Engines
from gateway.serving.messages_router import router as messages_router
from gateway.serving.responses_router import router as responses_router
from gateway.serving.router import router as serving_router
from gateway.serving.targets import ModelCache
from gateway.settings import Settings
from gateway.tenancy.keys import Authenticator
from gateway.tenancy.router import router as admin_router
from gateway.tinker import store as tinker_store
from gateway.tinker.router import estimate_router as tinker_estimate_router
from gateway.tinker.router import router as tinker_router
from gateway.usage.buffer import UsageBuffer
from gateway.usage.metrics import UsageCollector
from gateway.usage.router import router as usage_router
from gateway.wire import check_request

logger = logging.getLogger(__name__)


class GatewayApp(FastAPI):
    """FastAPI with the request middleware outermost: it sees every request first, and the proxied
    completions it serves itself never enter Starlette's middleware stack (error, telemetry and body-limit
    layers that the proxy path handles on its own)."""

    def __init__(self, *, metrics: Metrics, max_body_bytes: int | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state.metrics = metrics
        self._outer = RequestContextMiddleware(
            super().__call__, metrics=metrics, max_body_bytes=max_body_bytes
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        scope["app"] = self
        await self._outer(scope, receive, send)


def create_app(settings: Settings) -> FastAPI:
    """The gateway app. Needs `settings.database_url` (migrations run at start-up)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not settings.database_url:
            raise RuntimeError("the gateway needs TUNEGATE_DATABASE_URL (tunegate up provides one)")
        await migrate(settings.database_url)
        await asyncio.to_thread(remove_stale_dirs)  # upload checks' dirs a killed gateway left behind
        pool = await create_pool(
            settings.database_url, min_size=settings.db_pool_min, max_size=settings.db_pool_max
        )
        auth = Authenticator(pool, ttl_s=settings.auth_cache_ttl_s)
        queue = make_queue(settings.redis_url) if settings.redis_url else None
        limits_redis = make_limits_redis(settings.redis_url) if settings.redis_url else None
        res = Resources(
            settings=settings,
            pool=pool,
            blobs=BlobStore(settings.blob_dir),
            auth=auth,
            queue=queue,
            admin_key=settings.admin_key_value(),
            engines=Engines(settings),
            models=ModelCache(ttl_s=max(settings.auth_cache_ttl_s, 1.0)),
            usage=UsageBuffer(
                max_rows=settings.usage_buffer_rows,
                flush_rows=settings.usage_flush_rows,
                flush_interval_s=settings.usage_flush_interval_s,
            ),
            guard=Guard(settings, pool, Buckets(limits_redis) if limits_redis is not None else None),
            offload=Offload(settings),
            started_at=int(time.time()),
            notices=Notices(settings.database_url, (tinker_store.ANSWER_CHANNEL,)),
            capture=Capturer(settings),
        )
        res.usage.start(pool)
        await res.capture.start(pool)
        usage_metrics = UsageCollector(res.usage)
        app.state.metrics.registry.register(usage_metrics)
        app.state.metrics.registry.register(res.engines.metrics)
        app.state.resources = res
        flusher = asyncio.create_task(auth.run_flusher())
        try:
            yield
        finally:
            flusher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await flusher
            with contextlib.suppress(Exception):
                await auth.flush_last_used()
            await res.guard.aclose()  # gives back its budget leases, sends the spend it owes
            await res.usage.aclose()  # writes the usage still waiting in the buffer
            await res.capture.aclose()  # writes the captures still waiting
            await res.engines.aclose()
            app.state.metrics.registry.unregister(usage_metrics)
            app.state.metrics.registry.unregister(res.engines.metrics)
            if limits_redis is not None:
                await limits_redis.aclose()
            if queue is not None:
                await queue.aclose()
            await res.notices.aclose()
            await pool.close()
            await asyncio.to_thread(res.offload.close)

    app = GatewayApp(
        metrics=Metrics(),
        max_body_bytes=settings.max_request_body_bytes,
        title="tunegate",
        version="0.1.0",
        lifespan=lifespan,
        default_response_class=ORJSONResponse,
        dependencies=[Depends(check_request)],  # every parameter and JSON body, by one set of rules
    )
    install_error_handlers(app)
    for router in (
        admin_router,
        files_router,
        jobs_router,
        models_router,
        aliases_router,
        ops_router,
        serving_router,
        usage_router,
        limits_router,
        billing_router,
        capture_admin_router,
        capture_router,
        export_router,
        scoring_router,
        episodes_router,
        responses_router,
        messages_router,
    ):
        app.include_router(router)
    app.include_router(graders_router)
    app.include_router(evals_router)
    install_dashboard(app)
    app.include_router(tinker_router)
    app.include_router(tinker_estimate_router)
    return app

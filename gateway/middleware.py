"""One plain ASGI middleware for every request: an `x-request-id`, Prometheus request metrics, and the
request body cap (`gateway.bodylimit`: a body over it is a 413 before the app reads any of it).

Plain ASGI (not `BaseHTTPMiddleware`) so streamed responses pass through untouched and cheaply. Metric
children are looked up once per (method, route, status) and kept: `labels()` costs more than the update.
The two proxied completion routes go straight to `gateway.serving.router.proxy_asgi` from here, past
FastAPI's routing, exception and dependency layers, which cost more CPU than the proxying itself; they keep
the same metrics labels, request id and error envelope.
"""

from __future__ import annotations

import os
import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway import bodylimit
from gateway.errors import PayloadTooLarge, error_response
from gateway.serving.router import PROXY_PATHS, proxy_asgi


class Metrics:
    """The gateway's Prometheus metrics, in a registry of its own (one per app)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tunegate_http_requests_total",
            "HTTP requests by route and status",
            ["method", "route", "status"],
            registry=self.registry,
        )
        self.latency = Histogram(
            "tunegate_http_request_duration_seconds",
            "Time to the response's first byte",
            ["method", "route"],
            registry=self.registry,
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30),
        )
        self.workers_alive = Gauge(
            "tunegate_workers_alive",
            "Workers whose presence in Redis is recent (NaN while Redis cannot say), read at each scrape",
            registry=self.registry,
        )
        self._counters: dict[tuple[str, str, int], Any] = {}
        self._timers: dict[tuple[str, str], Any] = {}

    def count(self, method: str, route: str, status: int) -> None:
        """One more request of (method, route, status)."""
        key = (method, route, status)
        child = self._counters.get(key)
        if child is None:
            child = self._counters[key] = self.requests.labels(method, route, str(status))
        child.inc()

    def observe(self, method: str, route: str, seconds: float) -> None:
        """Time to first byte of one request."""
        key = (method, route)
        child = self._timers.get(key)
        if child is None:
            child = self._timers[key] = self.latency.labels(method, route)
        child.observe(seconds)


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp, metrics: Metrics, max_body_bytes: int | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        request_id = "req_" + os.urandom(16).hex()
        scope.setdefault("state", {})["request_id"] = request_id
        started = time.perf_counter()
        status = 500
        path: str = scope["path"]
        fast = scope["method"] == "POST" and path in PROXY_PATHS

        async def send_wrapper(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                headers: list[Any] = list(message.get("headers", []))
                headers.append((b"x-request-id", request_id.encode()))
                message["headers"] = headers
                route = path if fast else getattr(scope.get("route"), "path", "unmatched")
                self.metrics.observe(scope["method"], route, time.perf_counter() - started)
            await send(message)

        try:
            if self.max_body_bytes is not None and bodylimit.applies(scope):
                try:
                    capped = await bodylimit.read_capped(scope, receive, self.max_body_bytes)
                except PayloadTooLarge as exc:
                    await error_response(exc)(scope, receive, send_wrapper)
                    return
                if capped is None:  # the client left before its body was complete: nobody to answer
                    return
                receive = capped
            if fast:
                await proxy_asgi(scope, receive, send_wrapper)
            else:
                await self.app(scope, receive, send_wrapper)
        finally:
            route = path if fast else getattr(scope.get("route"), "path", "unmatched")
            self.metrics.count(scope["method"], route, status)

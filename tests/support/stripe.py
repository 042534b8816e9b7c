"""A stand-in of Stripe's meter-event endpoint (`POST /v1/billing/meter_events`), served on a local port for
the real `stripe` SDK: required fields checked, events deduped by `identifier`, a share of calls failed with
429/500 on purpose."""

from __future__ import annotations

import asyncio
import random
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from tests.support.stack import free_port


class StripeStandIn:
    """`POST /v1/billing/meter_events` as Stripe answers it, with dedupe by identifier and injected faults."""

    def __init__(self, fail_rate: float) -> None:
        self.fail_rate = fail_rate
        self.events: dict[str, dict[str, Any]] = {}
        self.calls = 0
        self.failures = 0
        self.duplicates = 0
        self.rng = random.Random(7)
        self.lock = threading.Lock()

    async def meter_events(self, request: Request) -> JSONResponse:
        form = await request.form()
        await asyncio.sleep(0.005)
        with self.lock:
            self.calls += 1
            if self.rng.random() < self.fail_rate:
                self.failures += 1
                status = self.rng.choice([429, 500])
                kind = "rate_limit_error" if status == 429 else "api_error"
                return JSONResponse({"error": {"type": kind, "message": "injected"}}, status_code=status)
            missing = [
                f
                for f in ("event_name", "identifier", "payload[stripe_customer_id]", "payload[value]")
                if not form.get(f)
            ]
            value = str(form.get("payload[value]") or "")
            if missing or not value.isdigit():
                return JSONResponse(
                    {"error": {"type": "invalid_request_error", "message": f"missing {missing}"}},
                    status_code=400,
                )
            ident = str(form["identifier"])
            if ident in self.events:
                self.duplicates += 1
            else:
                self.events[ident] = {
                    "event_name": str(form["event_name"]),
                    "customer": str(form["payload[stripe_customer_id]"]),
                    "value": int(value),
                    "timestamp": int(str(form.get("timestamp") or 0)),
                }
            ev = self.events[ident]
        return JSONResponse(
            {
                "object": "billing.meter_event",
                "created": int(time.time()),
                "event_name": ev["event_name"],
                "identifier": ident,
                "livemode": False,
                "payload": {"stripe_customer_id": ev["customer"], "value": str(ev["value"])},
                "timestamp": ev["timestamp"],
            }
        )

    def totals(self) -> dict[tuple[str, str], int]:
        out: dict[tuple[str, str], int] = defaultdict(int)
        for ev in self.events.values():
            out[(ev["customer"], ev["event_name"])] += ev["value"]
        return dict(out)


@contextmanager
def serve_stripe(fail_rate: float) -> Iterator[tuple[StripeStandIn, str]]:
    """A stand-in failing `fail_rate` of its calls, served until the block ends; with its base URL."""
    standin = StripeStandIn(fail_rate=fail_rate)
    app = Starlette(routes=[Route("/v1/billing/meter_events", standin.meter_events, methods=["POST"])])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.02)
    try:
        yield standin, f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)

"""Gateway throughput with metering and rate limits on vs off, against a fake upstream on loopback that
answers with a pre-rendered OpenAI chat completion. Prints requests per second and their ratio (target
>= 0.9); asserts nothing.

    .venv/bin/python bench/metering.py [--requests 2000] [--concurrency 32]
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import secrets
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import orjson
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tests.support.stack import (  # noqa: E402
    Admin,
    GatewayServer,
    Services,
    drop_database,
    free_port,
    make_database,
    make_settings,
)

logger = logging.getLogger(__name__)

ANSWER = orjson.dumps(
    {
        "id": "chatcmpl-bench",
        "object": "chat.completion",
        "created": 0,
        "model": "tiny-chat",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "ok"},
                "finish_reason": "stop",
                "logprobs": None,
            }
        ],
        "usage": {"prompt_tokens": 12, "completion_tokens": 1, "total_tokens": 13},
    }
)


async def _chat(request: Request) -> Response:
    await request.body()
    return Response(ANSWER, media_type="application/json")


def _serve(app: Any, port: int) -> uvicorn.Server:
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    threading.Thread(target=server.run, daemon=True).start()
    while not server.started:
        time.sleep(0.02)
    return server


async def _load(url: str, key: str, n: int, concurrency: int) -> float:
    body = {"model": "tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {key}"}, trust_env=False) as http:
        for _ in range(20):  # warm up
            (await http.post(f"{url}/v1/chat/completions", json=body)).raise_for_status()
        left = n
        t0 = time.perf_counter()

        async def worker() -> None:
            nonlocal left
            while left > 0:
                left -= 1
                (await http.post(f"{url}/v1/chat/completions", json=body)).raise_for_status()

        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return n / (time.perf_counter() - t0)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="tunegate-bench-"))
    services = Services.start(tmp)
    name = f"tunegate_bench_{secrets.token_hex(4)}"
    dsn = make_database(services.pg_dsn, name)
    up_port = free_port()
    upstream = _serve(Starlette(routes=[Route("/v1/chat/completions", _chat, methods=["POST"])]), up_port)
    settings = make_settings(data_dir=tmp, database_url=dsn, redis_url=services.redis_url, tiny_model=tmp)
    settings.base_models["tiny-chat"].upstreams = [f"http://127.0.0.1:{up_port}"]
    gw = GatewayServer(settings).start()
    try:
        assert settings.admin_key is not None
        admin = Admin(gw.url, settings.admin_key.get_secret_value())
        tenant = admin.tenant("bench")
        app: Any = gw.server.config.app
        state = app.state.resources.serving
        guard = state.guard
        state.guard = None
        off = asyncio.run(_load(gw.url, tenant.key, args.requests, args.concurrency))
        state.guard = guard
        admin.http.post(
            f"/v1/admin/organizations/{tenant.org_id}/limits",
            json={"max_requests_per_1_minute": 10_000_000, "max_tokens_per_1_minute": 1_000_000_000},
        ).raise_for_status()
        admin.http.post(f"/v1/admin/organizations/{tenant.org_id}/billing", json={"monthly_budget_usd": 1e9})
        on = asyncio.run(_load(gw.url, tenant.key, args.requests, args.concurrency))
        print(f"limits+budget off: {off:8.1f} req/s")
        print(f"limits+budget on:  {on:8.1f} req/s")
        print(f"ratio on/off:      {on / off:8.3f}  (target >= 0.9)")
        print(f"usage rows written: {state.usage.written}, dropped: {state.usage.dropped}")
    finally:
        gw.stop()
        upstream.should_exit = True
        drop_database(services.pg_dsn, name)
        services.stop()


if __name__ == "__main__":
    main()

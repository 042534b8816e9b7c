"""Metering: usage rows per second sustained through the gateway with none lost, with and without a monthly
budget, and what the usage buffer alone can write.

Through the gateway (`python -m tunegate gateway` on its own core, the fake upstream and the load generator
on the other): each tenant's load for a few seconds, 32 clients; the chat completions the gateway answered
with 200 (its own request counter on `/metrics`) against the tenant's `completion_usage` rows in PostgreSQL:
one row per answer is zero loss. One tenant has only the default rate limits (admitted from leases), the
other also a monthly budget, which reserves and settles every request's cost in Redis. The gateway's own
`tunegate_usage_rows_dropped_total` is read from `/metrics`.

The buffer alone (`gateway.usage.buffer.UsageBuffer` on a real pool, in the bench process): rows recorded
as fast as its background writer keeps up (never more than half its capacity waiting) for a few seconds,
then flushed; rows per second written and rows counted back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import asyncpg
import httpx

from bench.common import Options, cores, fmt, ratio
from bench.gateway_bench import BODY
from bench.load import run_load
from bench.stack import make_tenant, rig

logger = logging.getLogger(__name__)

CONCURRENCY = 32


def _metric(gateway_url: str, name: str, *labels: str) -> float:
    """The sum of the gateway's `/metrics` samples of `name` that carry all `labels` (`key="value"`)."""
    total = 0.0
    for line in httpx.get(gateway_url + "/metrics", timeout=10, trust_env=False).text.splitlines():
        sample, _, value = line.rpartition(" ")
        if sample.partition("{")[0] == name and all(label in sample for label in labels):
            total += float(value)
    return total


def _answered(gateway_url: str) -> int:
    """Chat completions the gateway has answered with 200 so far (its own request counter)."""
    route, ok = 'route="/v1/chat/completions"', 'status="200"'
    return int(_metric(gateway_url, "tunegate_http_requests_total", route, ok))


async def _rows(dsn: str, org_id: str, expected: int, wait_s: float = 15.0) -> int:
    """The tenant's answered usage rows, waiting up to `wait_s` for the buffer's flushes to reach
    `expected`."""
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            count = int(
                await conn.fetchval(
                    "SELECT count(*) FROM completion_usage WHERE organization_id = $1 AND status = 200",
                    org_id,
                )
            )
            if count >= expected or time.monotonic() > deadline:
                return count
            await asyncio.sleep(0.2)
    finally:
        await conn.close()


async def _buffer_alone(dsn: str, org_id: str, seconds: float) -> dict[str, Any]:
    """Rows per second the usage buffer writes when recording never stops."""
    from gateway.db import create_pool
    from gateway.usage.buffer import UsageBuffer

    pool = await create_pool(dsn, min_size=1, max_size=2)
    buffer = UsageBuffer()
    usage = {"prompt_tokens": 12, "completion_tokens": 6}
    recorded = 0
    try:
        buffer.start(pool)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            if buffer.pending < buffer.max_rows // 2:
                for _ in range(500):
                    buffer.record(org_id, "key_bench", "tiny-chat", usage, base_model="tiny-chat")
                recorded += 500
            await asyncio.sleep(0)
        await buffer.aclose()
        elapsed = time.perf_counter() - t0
    finally:
        await pool.close()
    return {
        "recorded": recorded,
        "written": buffer.written,
        "dropped": buffer.dropped,
        "seconds": elapsed,
        "rows_per_s": buffer.written / elapsed,
        "rows_in_database": await _rows(dsn, org_id, recorded, wait_s=0),
    }


def run(opts: Options) -> dict[str, Any]:
    seconds = 1.0 if opts.quick else 10.0
    server_core, load_core = cores()
    report: dict[str, Any] = {"seconds_per_tenant": seconds, "concurrency": CONCURRENCY}
    # Per-minute limits far above the load: what is measured is metering, not the limits refusing requests.
    with rig(
        opts.workdir / "metering",
        server_core,
        load_core,
        default_requests_per_minute=1_000_000_000,
        default_tokens_per_minute=1_000_000_000_000,
    ) as r:
        assert r.settings.admin_key is not None
        admin = {"authorization": f"Bearer {r.settings.admin_key.get_secret_value()}"}
        tenants = {
            "limits": make_tenant(r.url, r.settings),
            "limits_and_budget": make_tenant(r.url, r.settings),
        }
        httpx.post(
            f"{r.url}/v1/admin/organizations/{tenants['limits_and_budget'][0]}/billing",
            json={"monthly_budget_usd": 1e9},
            headers=admin,
            trust_env=False,
        ).raise_for_status()
        for name, (org_id, key) in tenants.items():
            before = _answered(r.url)
            load = run_load(
                r.url + "/v1/chat/completions",
                BODY,
                connections=CONCURRENCY,
                seconds=seconds,
                token=key,
                core=load_core,
            )
            answered = _answered(r.url) - before
            rows = asyncio.run(_rows(r.services.database_url, org_id, answered))
            report[name] = {
                "load": load.to_dict(),
                "answered": answered,
                "usage_rows": rows,
                "lost": answered - rows,
                "rows_per_s": rows / load.seconds,
            }
        report["gateway_dropped"] = _metric(r.url, "tunegate_usage_rows_dropped_total")
        report["budget_vs_limits_only"] = ratio(
            report["limits_and_budget"]["rows_per_s"], report["limits"]["rows_per_s"]
        )
        org_id, _ = make_tenant(r.url, r.settings)
        report["buffer_alone"] = asyncio.run(
            _buffer_alone(r.services.database_url, org_id, 1.0 if opts.quick else 5.0)
        )
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"Each tenant's load through the gateway for {report['seconds_per_tenant']:.0f} s, "
        f"{report['concurrency']} clients (`bench.load`); the answers the gateway counted (its own 200s) "
        "against the tenant's usage rows in PostgreSQL.",
        "",
        "| tenant | answered | usage rows | lost | rows/s sustained |",
        "|---|---|---|---|---|",
    ]
    for name, label in (("limits", "default limits"), ("limits_and_budget", "limits and a monthly budget")):
        t = report[name]
        lines.append(
            f"| {label} | {t['answered']} | {t['usage_rows']} | {t['lost']} | {t['rows_per_s']:.0f} |"
        )
    b = report["buffer_alone"]
    lines += [
        "",
        "Throughput with a budget (each request's cost held against it, mostly from the gateway's budget "
        "lease) relative to limits "
        f"alone: {fmt(report['budget_vs_limits_only'], '.2f')}. Rows the gateway dropped: "
        f"{fmt(report['gateway_dropped'], '.0f')}. The usage buffer alone wrote {b['rows_per_s']:.0f} rows/s "
        f"({b['written']} of {b['recorded']} recorded, {b['rows_in_database']} in the database, "
        f"{b['dropped']} dropped): the ceiling of metering on this machine, far above what one gateway "
        "serves.",
    ]
    return lines

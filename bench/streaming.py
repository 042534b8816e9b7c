"""Streaming: time to first token (the first content delta) through the gateway vs straight from the
fake upstream, one client, requests back to back, measured in the same run.
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

import httpx

from bench.common import Options, cores, ratio, summary_ms
from bench.stack import make_tenant, rig

logger = logging.getLogger(__name__)

BODY = json.dumps(
    {"model": "tiny-chat", "messages": [{"role": "user", "content": "Say hello."}], "stream": True}
).encode()


def _ttft(client: httpx.Client, url: str, token: str | None, n: int) -> tuple[list[float], list[float], int]:
    """(times to first content delta, times to the end of the stream, failures) of `n` streamed requests."""
    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    first: list[float] = []
    total: list[float] = []
    failures = 0
    for _ in range(n):
        t0 = time.perf_counter()
        got: float | None = None
        with client.stream("POST", url, content=BODY, headers=headers) as resp:
            if resp.status_code != 200:
                failures += 1
                resp.read()
                continue
            for line in resp.iter_lines():
                if got is None and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                    event = json.loads(line[6:])
                    if event.get("choices") and event["choices"][0]["delta"].get("content"):
                        got = time.perf_counter() - t0
        if got is None:
            failures += 1
            continue
        first.append(got)
        total.append(time.perf_counter() - t0)
    return first, total, failures


def run(opts: Options) -> dict[str, Any]:
    n = 30 if opts.quick else 1000
    server_core, load_core = cores()
    with rig(opts.workdir / "streaming", server_core, load_core) as r:
        _, key = make_tenant(r.url, r.settings)
        with httpx.Client(timeout=30, trust_env=False) as client:
            _ttft(client, r.url + "/v1/chat/completions", key, 20)  # warm caches and connections
            d_first, d_total, d_fail = _ttft(client, r.upstream_url + "/v1/chat/completions", None, n)
            g_first, g_total, g_fail = _ttft(client, r.url + "/v1/chat/completions", key, n)
    direct, gateway = summary_ms(d_first), summary_ms(g_first)
    return {
        "requests": n,
        "client": "httpx.Client in the bench process, one request at a time",
        "direct_ttft": direct,
        "gateway_ttft": gateway,
        "direct_stream_total": summary_ms(d_total),
        "gateway_stream_total": summary_ms(g_total),
        "added_ttft_p50_ms": gateway["p50_ms"] - direct["p50_ms"],
        "added_ttft_p99_ms": gateway["p99_ms"] - direct["p99_ms"],
        "ttft_ratio_p50": ratio(gateway["p50_ms"], direct["p50_ms"]),
        "failures": {"direct": d_fail, "gateway": g_fail},
    }


def markdown(report: dict[str, Any]) -> list[str]:
    d, g = report["direct_ttft"], report["gateway_ttft"]
    return [
        f"{report['requests']} streamed chat completions each way ({report['client']}).",
        "",
        "| path | TTFT p50 ms | TTFT p99 ms | whole stream p50 ms | failures |",
        "|---|---|---|---|---|",
        f"| direct | {d['p50_ms']:.2f} | {d['p99_ms']:.2f} | {report['direct_stream_total']['p50_ms']:.2f} "
        f"| {report['failures']['direct']} |",
        f"| gateway | {g['p50_ms']:.2f} | {g['p99_ms']:.2f} | {report['gateway_stream_total']['p50_ms']:.2f} "
        f"| {report['failures']['gateway']} |",
        "",
        f"Added time to first token: p50 {report['added_ttft_p50_ms']:.2f} ms, "
        f"p99 {report['added_ttft_p99_ms']:.2f} ms.",
    ]

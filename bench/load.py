"""Load generation: Debian's `wrk` (with a Lua script for POST bodies) pinned to its own core, or an async
httpx client when wrk is not installed. Both report the same shape (`LoadResult`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import subprocess
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench.common import percentile, pinned

logger = logging.getLogger(__name__)

LUA = """
wrk.method = "POST"
wrk.body = %(body)s
wrk.headers["Content-Type"] = "application/json"
%(auth)s
function done(summary, latency, requests)
  local e = summary.errors
  io.write(string.format(
    '\\nBENCH_JSON {"requests":%%d,"duration_us":%%d,"p50_us":%%d,"p99_us":%%d,"mean_us":%%f,' ..
    '"errors":%%d,"non2xx":%%d}\\n',
    summary.requests, summary.duration, latency:percentile(50), latency:percentile(99), latency.mean,
    e.connect + e.read + e.write + e.timeout, e.status))
end
"""


@dataclass
class LoadResult:
    """One load run against one URL at one concurrency."""

    tool: str
    """`wrk` or `httpx`."""
    connections: int
    requests: int
    seconds: float
    rps: float
    p50_ms: float
    p99_ms: float
    mean_ms: float
    errors: int
    """Socket errors and timeouts plus answers that were not 2xx/3xx."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def have_wrk() -> bool:
    return shutil.which("wrk") is not None


def _lua_string(text: str) -> str:
    return json.dumps(text)  # a JSON string literal is a valid Lua string literal for ASCII text


def run_wrk(
    url: str, body: bytes, *, connections: int, seconds: float, token: str | None, core: int | None
) -> LoadResult:
    auth = f'wrk.headers["Authorization"] = {_lua_string("Bearer " + token)}' if token else ""
    with tempfile.NamedTemporaryFile("w", suffix=".lua", delete=False) as fh:
        fh.write(LUA % {"body": _lua_string(body.decode()), "auth": auth})
        script = fh.name
    try:
        cmd = pinned(
            [
                "wrk",
                "-t1",
                f"-c{connections}",
                f"-d{max(1, round(seconds))}s",
                "--timeout",
                "10s",
                "-s",
                script,
                url,
            ],
            core,
        )
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 60, check=True).stdout
    finally:
        Path(script).unlink(missing_ok=True)
    line = next(x for x in out.splitlines() if x.startswith("BENCH_JSON "))
    data = json.loads(line[len("BENCH_JSON ") :])
    secs = data["duration_us"] / 1e6
    return LoadResult(
        tool="wrk",
        connections=connections,
        requests=data["requests"],
        seconds=secs,
        rps=data["requests"] / secs if secs else 0.0,
        p50_ms=data["p50_us"] / 1000,
        p99_ms=data["p99_us"] / 1000,
        mean_ms=data["mean_us"] / 1000,
        errors=data["errors"] + data["non2xx"],
    )


async def _httpx_load(
    url: str, body: bytes, *, connections: int, seconds: float, token: str | None
) -> LoadResult:
    import httpx

    headers = {"content-type": "application/json"}
    if token:
        headers["authorization"] = f"Bearer {token}"
    latencies: list[float] = []
    errors = 0
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    async with httpx.AsyncClient(limits=limits, timeout=10.0, trust_env=False) as client:
        deadline = time.perf_counter() + seconds

        async def one_client() -> None:
            nonlocal errors
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    resp = await client.post(url, content=body, headers=headers)
                    ok = resp.status_code < 400
                except httpx.HTTPError:
                    ok = False
                latencies.append(time.perf_counter() - t0)
                errors += not ok

        started = time.perf_counter()
        await asyncio.gather(*(one_client() for _ in range(connections)))
        elapsed = time.perf_counter() - started
    return LoadResult(
        tool="httpx",
        connections=connections,
        requests=len(latencies),
        seconds=elapsed,
        rps=len(latencies) / elapsed,
        p50_ms=percentile(latencies, 50) * 1000,
        p99_ms=percentile(latencies, 99) * 1000,
        mean_ms=sum(latencies) / max(1, len(latencies)) * 1000,
        errors=errors,
    )


def run_load(
    url: str,
    body: bytes,
    *,
    connections: int,
    seconds: float,
    token: str | None = None,
    core: int | None = None,
) -> LoadResult:
    """Closed-loop load: `connections` clients each sending `body` back to back for `seconds`."""
    if have_wrk():
        return run_wrk(url, body, connections=connections, seconds=seconds, token=token, core=core)
    return asyncio.run(_httpx_load(url, body, connections=connections, seconds=seconds, token=token))

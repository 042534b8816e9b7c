"""Capture's cost on the request path: the same chat load through the gateway for an organisation with
capture off and for one with capture on, at 1 and 32 clients, whole and streamed answers, p50 and p99 side
by side in one run.

Both organisations send the same requests: `store: true`, `metadata` and an `X-Episode-Id` header (an
episode per client, a new one every `TURNS_PER_EPISODE` calls), so the one difference is the organisation's
capture setting. With it off the gateway forwards them untouched; with it on it asks the engine for token
ids and log-probabilities, takes them out of the answer again, accumulates a stream on the side and hands
the record to its background writer (which writes to PostgreSQL from the gateway's own process, on the
gateway's core: part of what is measured).

The engine is a stand-in (`bench.capture_upstream`): pre-rendered answers like `bench.upstream`'s, with a
fresh id each (capture keys its records by the answer's id), that carry `prompt_token_ids`, each choice's
`token_ids` and `logprobs` when the request asks for them, as vLLM and tunegate's own engine answer. So the
capture arm pays for the larger answers it asks for too.

The two arms are interleaved: `ROUNDS` slices of `slice_s` seconds each, in the order off-on, on-off, ...,
their latencies pooled per arm; the gateway's CPU time (from /proc, per request) is read around each slice.
The load is closed-loop: N clients of one `httpx.AsyncClient` in the bench process, each sending its next
request when its last one ended (whole answers read, streams read to their end). The gateway is pinned to
one core, the stand-in engine and the load to the other. After the load, the captured records are counted
against the capture arm's answers.

`python -m bench.capture --run [--quick] [--profile]` prints the report and its table (and writes it to
`--results-dir`, as `capture.json`); `--profile` also samples the gateway with py-spy under the capture arm.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import asyncpg
import httpx

from bench import profile
from bench.capture_upstream import start_upstream
from bench.common import (
    RESULTS_DIR,
    Options,
    cores,
    cpu_seconds,
    fmt,
    machine,
    percentile,
    ratio,
)
from bench.stack import Process, Services, bench_settings, make_tenant, start_gateway

logger = logging.getLogger(__name__)

CLIENTS = (1, 32)
ROUNDS = 8
"""Slices per arm at each point (alternating which arm goes first)."""
TURNS_PER_EPISODE = 16
MODES = ("whole", "streamed")
MESSAGES = [{"role": "user", "content": "Say hello."}]
BODIES = {
    "whole": {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 16, "store": True},
    "streamed": {"model": "tiny-chat", "messages": MESSAGES, "max_tokens": 16, "store": True, "stream": True},
}
for _body in BODIES.values():
    _body["metadata"] = {"bench": "capture"}

# -- the load -------------------------------------------------------------------------------------------


async def _slice(
    client: httpx.AsyncClient,
    url: str,
    key: str,
    body: bytes,
    *,
    clients: int,
    seconds: float,
    streamed: bool,
    episode: str,
) -> tuple[list[float], int]:
    """Latencies of `clients` closed-loop clients for `seconds`, and the failures."""
    latencies: list[float] = []
    failures = 0
    deadline = time.perf_counter() + seconds

    async def one(n: int) -> None:
        nonlocal failures
        for i in itertools.count():
            if time.perf_counter() >= deadline:
                return
            headers = {
                "authorization": f"Bearer {key}",
                "content-type": "application/json",
                "x-episode-id": f"{episode}-{n}-{i // TURNS_PER_EPISODE}",
            }
            t0 = time.perf_counter()
            try:
                if streamed:
                    async with client.stream("POST", url, content=body, headers=headers) as resp:
                        async for _ in resp.aiter_raw():
                            pass
                else:
                    resp = await client.post(url, content=body, headers=headers)
                ok = resp.status_code == 200
            except httpx.HTTPError:
                ok = False
            latencies.append(time.perf_counter() - t0)
            failures += not ok

    await asyncio.gather(*(one(n) for n in range(clients)))
    return latencies, failures


async def _point(
    url: str,
    keys: dict[str, str],
    gateway_pid: int,
    *,
    mode: str,
    clients: int,
    slice_s: float,
    rounds: int,
    tag: str,
) -> dict[str, Any]:
    body = json.dumps(BODIES[mode]).encode()
    arms: dict[str, dict[str, Any]] = {a: {"lat": [], "failures": 0, "cpu": 0.0, "s": 0.0} for a in keys}
    warm_answered = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client:
        # unmeasured warm-up of both arms: connections, caches, the writer's first batches
        for arm, key in keys.items():
            lat, failed = await _slice(
                client,
                url,
                key,
                body,
                clients=clients,
                seconds=min(1.0, slice_s),
                streamed=mode == "streamed",
                episode=f"{tag}-warm-{arm}",
            )
            if arm == "on":
                warm_answered = len(lat) - failed
        order = list(keys)
        for r in range(rounds):
            for arm in order if r % 2 == 0 else reversed(order):
                cpu0, t0 = cpu_seconds(gateway_pid), time.perf_counter()
                lat, failed = await _slice(
                    client,
                    url,
                    keys[arm],
                    body,
                    clients=clients,
                    seconds=slice_s,
                    streamed=mode == "streamed",
                    episode=f"{tag}-{arm}-{r}",
                )
                a = arms[arm]
                a["s"] += time.perf_counter() - t0
                a["cpu"] += cpu_seconds(gateway_pid) - cpu0
                a["lat"].extend(lat)
                a["failures"] += failed
    out: dict[str, Any] = {"mode": mode, "clients": clients}
    for arm, a in arms.items():
        n = len(a["lat"])
        out[arm] = {
            "requests": n,
            "rps": n / a["s"] if a["s"] else 0.0,
            "p50_ms": percentile(a["lat"], 50) * 1000,
            "p99_ms": percentile(a["lat"], 99) * 1000,
            "cpu_ms_per_request": a["cpu"] * 1000 / n if n else None,
            "failures": a["failures"],
        }
    off, on = out["off"], out["on"]
    out["added_p50_ms"] = on["p50_ms"] - off["p50_ms"]
    out["added_p99_ms"] = on["p99_ms"] - off["p99_ms"]
    out["added_cpu_ms_per_request"] = (
        on["cpu_ms_per_request"] - off["cpu_ms_per_request"]
        if on["cpu_ms_per_request"] is not None and off["cpu_ms_per_request"] is not None
        else None
    )
    out["throughput_on_vs_off"] = ratio(on["rps"], off["rps"])
    out["on_answered"] = warm_answered + on["requests"] - on["failures"]
    return out


async def _profiled(url: str, key: str, pid: int, seconds: float, out: Path) -> dict[str, Any] | None:
    """py-spy's samples of the gateway while the capture arm's 32 clients send whole requests."""
    sampler = profile.start(pid, seconds + 1, out)
    await asyncio.sleep(0.5)  # py-spy attached before the load starts
    limits = httpx.Limits(max_connections=32, max_keepalive_connections=32)
    async with httpx.AsyncClient(limits=limits, timeout=30, trust_env=False) as client:
        body = json.dumps(BODIES["whole"]).encode()
        await _slice(client, url, key, body, clients=32, seconds=seconds, streamed=False, episode="profile")
    summary = await asyncio.to_thread(profile.finish, sampler, out)
    return None if summary is None else {**summary, **_capture_share(out)}


def _capture_share(path: Path) -> dict[str, Any]:
    """The share of py-spy's samples (collapsed stacks) taken in or below capture's modules, and in or below
    each of capture's functions."""
    total, inside = 0, 0
    below: dict[str, int] = {}
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        total += int(count)
        frames = {f.split(":")[0] + ")" for f in stack.split(";") if "gateway/capture/" in f}
        inside += int(count) if frames else 0
        for frame in frames:
            below[frame] = below.get(frame, 0) + int(count)
    pct = (lambda n: round(100 * n / total, 1)) if total else (lambda n: 0.0)
    top = sorted(below.items(), key=lambda kv: -kv[1])[:8]
    return {"capture_pct": pct(inside), "capture_functions": [[pct(n), f] for f, n in top]}


async def _captured(dsn: str, org_id: str, expected: int, wait_s: float = 20.0) -> int:
    """The capture organisation's records, waiting up to `wait_s` for the writer to reach `expected`."""
    conn = await asyncpg.connect(dsn)
    try:
        deadline = time.monotonic() + wait_s
        while True:
            count = int(
                await conn.fetchval(
                    "SELECT count(*) FROM captured_completions WHERE organization_id = $1", org_id
                )
            )
            if count >= expected or time.monotonic() > deadline:
                return count
            await asyncio.sleep(0.2)
    finally:
        await conn.close()


def run(opts: Options) -> dict[str, Any]:
    slice_s = 0.3 if opts.quick else 1.0
    rounds = 2 if opts.quick else ROUNDS
    server_core, load_core = cores()
    work = opts.workdir / "capture"
    work.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "slice_s": slice_s,
        "rounds": rounds,
        "server_core": server_core,
        "load_core": load_core,
        "turns_per_episode": TURNS_PER_EPISODE,
        "points": [],
    }
    services = Services.start(work, redis=True)
    procs: list[Process] = []
    try:
        upstream, upstream_url = start_upstream(work / "upstream.log", load_core)
        procs.append(upstream)
        # Per-minute limits far above the load: what is measured is capture, not the limits refusing.
        settings = bench_settings(
            services,
            work / "data",
            upstreams=[upstream_url],
            default_requests_per_minute=1_000_000_000,
            default_tokens_per_minute=1_000_000_000_000,
        )
        gateway = start_gateway(settings, work / "gateway.log", server_core)
        procs.append(gateway)
        url = f"http://127.0.0.1:{settings.port}"
        (_, off_key), (on_org, on_key) = make_tenant(url, settings), make_tenant(url, settings)
        assert settings.admin_key is not None
        httpx.post(
            f"{url}/v1/admin/organizations/{on_org}/capture",
            json={"enabled": True},
            headers={"authorization": f"Bearer {settings.admin_key.get_secret_value()}"},
            trust_env=False,
        ).raise_for_status()
        keys = {"off": off_key, "on": on_key}
        for mode in MODES:
            for clients in CLIENTS:
                point = asyncio.run(
                    _point(
                        url + "/v1/chat/completions",
                        keys,
                        gateway.pid,
                        mode=mode,
                        clients=clients,
                        slice_s=slice_s,
                        rounds=rounds,
                        tag=f"{mode}-{clients}",
                    )
                )
                report["points"].append(point)
                logger.info(
                    "capture %s x%d: p50 %+.3f ms, p99 %+.3f ms",
                    mode,
                    clients,
                    point["added_p50_ms"],
                    point["added_p99_ms"],
                )
        # every answer of the capture arm (warm-ups included) is a record: count them back
        answered = sum(p["on_answered"] for p in report["points"])
        report["capture_answers"] = answered
        report["captured_records"] = asyncio.run(_captured(services.database_url, on_org, answered))
        if opts.profile:
            out = work / "capture-profile.txt"
            report["profile"] = asyncio.run(
                _profiled(url + "/v1/chat/completions", on_key, gateway.pid, 1.0 if opts.quick else 5.0, out)
            )
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        "The same chat requests (`store: true`, `metadata`, an `X-Episode-Id`) through the gateway for an "
        "organisation with capture off and one with it on, against a stand-in engine that returns token ids "
        f"and logprobs when asked (as vLLM does); {report['rounds']} interleaved slices of "
        f"{report['slice_s']:.1f} s per arm and point, latencies pooled; closed-loop `httpx` clients in the "
        f"bench process. Gateway on core {report['server_core']}, engine and load on core "
        f"{report['load_core']}; the gateway's CPU per request from /proc (PostgreSQL's own is not in it).",
        "",
        "| answers | clients | off p50 / p99 ms | on p50 / p99 ms | added p50 / p99 ms | gateway CPU ms/req "
        "off / on | rps off / on | failures |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        off, on = p["off"], p["on"]
        lines.append(
            f"| {p['mode']} | {p['clients']} | {off['p50_ms']:.2f} / {off['p99_ms']:.2f} "
            f"| {on['p50_ms']:.2f} / {on['p99_ms']:.2f} "
            f"| {p['added_p50_ms']:+.2f} / {p['added_p99_ms']:+.2f} "
            f"| {fmt(off['cpu_ms_per_request'], '.3f')} / {fmt(on['cpu_ms_per_request'], '.3f')} "
            f"| {off['rps']:.0f} / {on['rps']:.0f} | {off['failures'] + on['failures']} |"
        )
    lines += [
        "",
        f"Records written for the capture arm: {report['captured_records']} "
        f"(of {report['capture_answers']} calls the gateway captured). Goal: at most +0.2 ms p50.",
    ]
    prof = report.get("profile")
    if prof:
        funcs = ", ".join(f"`{func}` {share}%" for share, func in prof["capture_functions"])
        lines += [
            "",
            f"Profile of the gateway under the capture arm, 32 clients, whole answers (py-spy, "
            f"{prof['samples']} samples): {prof['capture_pct']}% of its samples in or below "
            f"`gateway/capture/`; by function (in or below): {funcs or 'none'}.",
        ]
    return lines


def main(argv: list[str] | None = None) -> int:
    """`python -m bench.capture --run [--quick]`: run the bench, print and save its report."""
    args = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(prog="python -m bench.capture", description=__doc__.splitlines()[0])
    parser.add_argument("--run", action="store_true", required=True)
    parser.add_argument("--quick", action="store_true", help="slices of 0.3 s, 2 rounds: checks that it runs")
    parser.add_argument("--profile", action="store_true", help="also sample the gateway with py-spy")
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    parsed = parser.parse_args(args)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(Options(quick=parsed.quick, workdir=parsed.results_dir / "work", profile=parsed.profile))
    report["machine"] = machine()
    parsed.results_dir.mkdir(parents=True, exist_ok=True)
    (parsed.results_dir / "capture.json").write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))
    print("\n".join(markdown(report)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

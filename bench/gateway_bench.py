"""The gateway's overhead: the same load on the fake upstream directly, through the bare proxy
(`bench.nullproxy`, the floor), through tunegate's gateway and through LiteLLM's proxy, at 1, 32 and 256
concurrent clients.

Per concurrency: p50/p99 latency of each path, the latency the proxies add (proxy minus direct, same run),
and what the gateway adds over the bare proxy (the machine's own cost of one more process hop taken out),
throughput relative to direct and to LiteLLM, errors, the proxies' CPU time per request (from
/proc/<pid>/stat: user + system, divided by the requests served) and the time the hypervisor stole from the
proxies' core meanwhile. The gateway runs as `python -m tunegate gateway` with a real database, API-key auth,
rate limits and metering; the proxies are pinned to one core, the load generator and the fake upstream to
the other. With `--profile`, py-spy samples the gateway during a 32-client run of its own.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import httpx

from bench import litellm_ref, profile
from bench.common import Options, cores, cpu_seconds, fmt, ratio, steal_seconds
from bench.load import LoadResult, have_wrk, run_load
from bench.stack import Process, make_tenant, rig, start_nullproxy

logger = logging.getLogger(__name__)

BODY = json.dumps(
    {"model": "tiny-chat", "messages": [{"role": "user", "content": "Say hello."}], "max_tokens": 16}
).encode()


def _measured(
    url: str,
    token: str | None,
    proc: Process | None,
    *,
    connections: int,
    seconds: float,
    core: int | None,
    server_core: int | None,
    warm_s: float = 0.0,
) -> dict[str, Any]:
    if warm_s:  # the same load first, unmeasured: the point is the steady state, not the ramp to it
        run_load(url, BODY, connections=connections, seconds=warm_s, token=token, core=core)
    before = cpu_seconds(proc.pid) if proc is not None else 0.0
    stolen = steal_seconds(server_core)
    result: LoadResult = run_load(url, BODY, connections=connections, seconds=seconds, token=token, core=core)
    out = result.to_dict()
    out["steal_pct"] = (
        100 * (steal_seconds(server_core) - stolen) / result.seconds if result.seconds else None
    )
    if proc is not None:
        used = cpu_seconds(proc.pid) - before
        out["cpu_ms_per_request"] = used * 1000 / result.requests if result.requests else None
    return out


def _warm(url: str, token: str | None, n: int = 50) -> None:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    with httpx.Client(timeout=30, trust_env=False) as http:
        for _ in range(n):
            resp = http.post(url, content=BODY, headers={**headers, "content-type": "application/json"})
            resp.raise_for_status()


def run(opts: Options) -> dict[str, Any]:
    concurrencies = [1, 32] if opts.quick else [1, 32, 256]
    seconds = 1.0 if opts.quick else 5.0
    warm_s = 0.0 if opts.quick else 1.0
    server_core, load_core = cores()
    work = opts.workdir / "gateway"
    report: dict[str, Any] = {
        "load_generator": "wrk (Debian package), 1 thread, pinned with taskset"
        if have_wrk()
        else "httpx AsyncClient in the bench process (wrk not installed)",
        "seconds_per_point": seconds,
        "warm_up_s": warm_s,
        "server_core": server_core,
        "load_core": load_core,
        "points": [],
    }
    # Limits and metering on as deployed (every request takes from its key's buckets), with per-minute limits
    # high enough that the load itself is never refused.
    with rig(
        work,
        server_core,
        load_core,
        default_requests_per_minute=1_000_000_000,
        default_tokens_per_minute=1_000_000_000_000,
    ) as r:
        settings, gateway, procs = r.settings, r.gateway, r.procs
        floor, floor_url = start_nullproxy(r.upstream_url, work / "nullproxy.log", server_core)
        procs.append(floor)
        upstream_url = r.upstream_url
        gateway_url = f"http://127.0.0.1:{settings.port}"
        _, key = make_tenant(gateway_url, settings)

        litellm_proc: Process | None = None
        litellm_url = ""
        exe, note = litellm_ref.ensure_installed(install=not opts.quick)
        report["litellm"] = {"status": note, "version": litellm_ref.version()}
        if exe is not None:
            try:
                litellm_proc, litellm_url = litellm_ref.start(
                    exe, upstream_url, work / "litellm", server_core
                )
                procs.append(litellm_proc)
                _warm(litellm_url + "/v1/chat/completions", litellm_ref.MASTER_KEY, 20)
            except (RuntimeError, httpx.HTTPError) as exc:
                report["litellm"]["status"] = f"did not start: {exc}"
                litellm_proc = None

        direct = upstream_url + "/v1/chat/completions"
        through = gateway_url + "/v1/chat/completions"
        bare = floor_url + "/v1/chat/completions"
        _warm(direct, None)
        _warm(bare, None)
        _warm(through, key, 200)
        for c in concurrencies:
            point: dict[str, Any] = {"connections": c}

            def measure(url: str, token: str | None, proc: Process | None, c: int = c) -> dict[str, Any]:
                return _measured(
                    url,
                    token,
                    proc,
                    connections=c,
                    seconds=seconds,
                    core=load_core,
                    server_core=server_core,
                    warm_s=warm_s,
                )

            point["direct"] = measure(direct, None, None)
            point["nullproxy"] = measure(bare, None, floor)
            point["gateway"] = measure(through, key, gateway)
            if litellm_proc is not None:
                point["litellm"] = measure(
                    litellm_url + "/v1/chat/completions", litellm_ref.MASTER_KEY, litellm_proc
                )
            point.update(_ratios(point))
            report["points"].append(point)
            time.sleep(0.2)
        if opts.profile:
            out = work / "gateway-profile.txt"
            sampler = profile.start(gateway.pid, seconds + 1, out)
            time.sleep(0.5)  # py-spy attached before the load starts
            run_load(through, BODY, connections=32, seconds=seconds, token=key, core=load_core)
            report["profile"] = profile.finish(sampler, out)
    return report


def _ratios(point: dict[str, Any]) -> dict[str, Any]:
    d, n, g, ll = point["direct"], point["nullproxy"], point["gateway"], point.get("litellm")
    out: dict[str, Any] = {
        "gateway_added_p50_ms": g["p50_ms"] - d["p50_ms"],
        "gateway_added_p99_ms": g["p99_ms"] - d["p99_ms"],
        "nullproxy_added_p50_ms": n["p50_ms"] - d["p50_ms"],
        "nullproxy_added_p99_ms": n["p99_ms"] - d["p99_ms"],
        "gateway_over_floor_p50_ms": g["p50_ms"] - n["p50_ms"],
        "gateway_over_floor_p99_ms": g["p99_ms"] - n["p99_ms"],
        "gateway_throughput_vs_direct": ratio(g["rps"], d["rps"]),
    }
    if ll is not None:
        out["litellm_added_p50_ms"] = ll["p50_ms"] - d["p50_ms"]
        out["litellm_added_p99_ms"] = ll["p99_ms"] - d["p99_ms"]
        out["litellm_throughput_vs_direct"] = ratio(ll["rps"], d["rps"])
        out["gateway_throughput_vs_litellm"] = ratio(g["rps"], ll["rps"])
    return out


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"Load generator: {report['load_generator']}. {report['seconds_per_point']:.0f} s per point, "
        f"after {report.get('warm_up_s', 0):.0f} s of the same load unmeasured (a jump from 32 to 256 "
        "clients first costs the gateway a second of new connections and longer queues); "
        f"proxies on core {report['server_core']}, load and fake upstream on core {report['load_core']}. "
        f"LiteLLM: {report['litellm']['status']} (version {report['litellm']['version']}). Floor: "
        "`bench/nullproxy.py`, a bare uvloop proxy on the gateway's core (no auth, limits or metering): "
        "what one more process hop costs on this machine.",
        "",
        "| clients | direct rps | gateway rps | LiteLLM rps | gateway/LiteLLM | CPU ms/req gateway / LiteLLM "
        "/ floor | errors g / l |",
        "|---|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        ll = p.get("litellm") or {}
        lines.append(
            f"| {p['connections']} | {p['direct']['rps']:.0f} | {p['gateway']['rps']:.0f} "
            f"| {fmt(ll.get('rps'), '.0f')} | {fmt(p.get('gateway_throughput_vs_litellm'), '.1f')}x "
            f"| {fmt(p['gateway'].get('cpu_ms_per_request'), '.3f')} "
            f"/ {fmt(ll.get('cpu_ms_per_request'), '.3f')} "
            f"/ {fmt(p['nullproxy'].get('cpu_ms_per_request'), '.3f')} "
            f"| {p['gateway']['errors']} / {ll.get('errors', '-')} |"
        )
    lines += [
        "",
        "Latency added over direct (p50 / p99, ms), and the gateway's over the floor; steal: share of the "
        "proxies' core the hypervisor took during the gateway's run.",
        "",
        "| clients | floor | gateway | LiteLLM | gateway over floor | steal % |",
        "|---|---|---|---|---|---|",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['connections']} | {p['nullproxy_added_p50_ms']:.2f} / {p['nullproxy_added_p99_ms']:.2f} "
            f"| {p['gateway_added_p50_ms']:.2f} / {p['gateway_added_p99_ms']:.2f} "
            f"| {fmt(p.get('litellm_added_p50_ms'))} / {fmt(p.get('litellm_added_p99_ms'))} "
            f"| {p['gateway_over_floor_p50_ms']:.2f} / {p['gateway_over_floor_p99_ms']:.2f} "
            f"| {fmt(p['gateway'].get('steal_pct'), '.1f')} |"
        )
    prof = report.get("profile")
    if prof:
        lines += [
            "",
            f"Profile of the gateway at 32 clients (py-spy, {prof['samples']} samples; "
            f"`{Path(prof['file']).name}` in the results' work directory). Most samples of their own:",
            "",
            "| % self | frame | % below | project function |",
            "|---|---|---|---|",
        ]
        for (own, frame), (below, func) in zip(
            prof["self"][:10], prof["project_inclusive"][:10], strict=False
        ):
            lines.append(f"| {own} | `{frame}` | {below} | `{func}` |")
    return lines

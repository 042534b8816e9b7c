"""Sandbox: reward calls per second through `envsdk.Sandbox` (batched JSON-lines RPC to an isolated
process) vs the same environment run in-process (`envsdk.host.InProcessRunner`), same tasks, same batches.

Both sides run on one core (the bench pins itself, and so the sandbox it starts, where it can): a reward call
is sequential work either way, and on a virtual machine a round trip between two cores costs the hypervisor's
wake-up latency, which would be measured instead of the sandbox.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from typing import Any

from bench.common import ROOT, Options, cores, ratio

logger = logging.getLogger(__name__)

PACKAGE = ROOT / "examples" / "envs" / "arithmetic"


def _items(n: int) -> list[dict[str, Any]]:
    tasks = [json.loads(line) for line in (PACKAGE / "tasks.jsonl").read_text().splitlines() if line.strip()]
    answers = ["4", "The answer is 12", "no idea", "7"]
    return [{"task": tasks[i % len(tasks)], "completion": answers[i % len(answers)]} for i in range(n)]


def _rate(call: Any, items: list[dict[str, Any]], batch: int, seconds: float) -> tuple[float, int, list[Any]]:
    done = 0
    first: list[Any] = []
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        out = call(items[:batch])
        assert len(out) == batch
        if not first:
            first = out
        done += batch
    return done / (time.perf_counter() - t0), done, first


def run(opts: Options) -> dict[str, Any]:
    core = cores()[1]
    affinity = os.sched_getaffinity(0)
    if core is not None:
        os.sched_setaffinity(0, {core})
    try:
        return _run(opts, core)
    finally:
        os.sched_setaffinity(0, affinity)


def _run(opts: Options, core: int | None) -> dict[str, Any]:
    from envsdk.host import InProcessRunner
    from envsdk.manifest import load_manifest
    from envsdk.sandbox import Sandbox, detect_backend

    seconds = 0.5 if opts.quick else 3.0
    batches = [1, 64] if opts.quick else [1, 16, 64, 256]
    items = _items(max(batches))
    try:
        backend = detect_backend()
        allow = False
    except Exception as exc:  # noqa: BLE001 - no isolation available here: measure the bare process
        logger.warning("no sandbox backend (%s); measuring the unsandboxed process", exc)
        backend, allow = "none", True
    points = []
    manifest = load_manifest(PACKAGE)
    if str(PACKAGE) not in sys.path:
        sys.path.insert(0, str(PACKAGE))  # the in-process runner imports the entry point like the sandbox
    box = Sandbox(PACKAGE, backend=backend, allow_unsandboxed=allow)
    t_start = time.perf_counter()
    box.start()
    started_s = time.perf_counter() - t_start
    try:
        with InProcessRunner(manifest.entrypoint, manifest.config) as local:
            for b in batches:
                s_rate, s_n, s_first = _rate(box.reward_batch, items, b, seconds)
                l_rate, l_n, l_first = _rate(local.reward_batch, items, b, seconds)
                same = [r["reward"] for r in s_first] == [r["reward"] for r in l_first]
                points.append(
                    {
                        "batch": b,
                        "sandbox_rewards_per_s": s_rate,
                        "in_process_rewards_per_s": l_rate,
                        "sandbox_vs_in_process": ratio(s_rate, l_rate),
                        "same_rewards": same,
                        "calls": {"sandbox": s_n, "in_process": l_n},
                    }
                )
    finally:
        box.close()
    return {
        "backend": backend,
        "core": core,
        "start_s": started_s,
        "seconds_per_point": seconds,
        "points": points,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"Environment `examples/envs/arithmetic`, sandbox backend `{report['backend']}`; "
        f"{report['seconds_per_point']} s per point; both sides on core {report.get('core')}.",
        "",
        "| batch | sandbox rewards/s | in-process rewards/s | sandbox / in-process | same rewards |",
        "|---|---|---|---|---|",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['batch']} | {p['sandbox_rewards_per_s']:.0f} | {p['in_process_rewards_per_s']:.0f} "
            f"| {p['sandbox_vs_in_process']:.3f} | {p['same_rewards']} |"
        )
    return lines

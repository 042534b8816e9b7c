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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from bench.common import ROOT, Options, cores, ratio

logger = logging.getLogger(__name__)

PACKAGE = ROOT / "examples" / "envs" / "arithmetic"
ROUNDS = 10
"""Alternating slices per point and side."""


def _items(n: int) -> list[dict[str, Any]]:
    tasks = [json.loads(line) for line in (PACKAGE / "tasks.jsonl").read_text().splitlines() if line.strip()]
    answers = ["4", "The answer is 12", "no idea", "7"]
    return [{"task": tasks[i % len(tasks)], "completion": answers[i % len(answers)]} for i in range(n)]


@dataclass
class _Side:
    call: Callable[[list[dict[str, Any]]], list[dict[str, Any]]]
    done: int = 0
    elapsed: float = 0.0
    first: list[dict[str, Any]] = field(default_factory=list)

    @property
    def rate(self) -> float:
        return self.done / self.elapsed


def _interleaved(sides: list[_Side], items: list[dict[str, Any]], batch: int, seconds: float) -> None:
    """Each side's rewards per second, measured in ``ROUNDS`` alternating slices of ``seconds / ROUNDS``
    (a slow spell of a shared machine then falls on both sides alike, not on whichever ran in it)."""
    for _ in range(ROUNDS):
        for side in sides:
            t0 = time.perf_counter()
            while (now := time.perf_counter()) - t0 < seconds / ROUNDS:
                out = side.call(items[:batch])
                assert len(out) == batch
                side.first = side.first or out
                side.done += batch
            side.elapsed += now - t0


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
                box_side, local_side = _Side(box.reward_batch), _Side(local.reward_batch)
                _interleaved([box_side, local_side], items, b, seconds)
                same = [r["reward"] for r in box_side.first] == [r["reward"] for r in local_side.first]
                points.append(
                    {
                        "batch": b,
                        "sandbox_rewards_per_s": box_side.rate,
                        "in_process_rewards_per_s": local_side.rate,
                        "sandbox_vs_in_process": ratio(box_side.rate, local_side.rate),
                        "same_rewards": same,
                        "calls": {"sandbox": box_side.done, "in_process": local_side.done},
                    }
                )
    finally:
        box.close()
    return {
        "backend": backend,
        "core": core,
        "start_s": started_s,
        "seconds_per_point": seconds,
        "rounds": ROUNDS,
        "points": points,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"Environment `examples/envs/arithmetic`, sandbox backend `{report['backend']}`; "
        f"{report['seconds_per_point']} s per point and side, in {report.get('rounds', 1)} slices taken "
        f"in turn with the other side's; both sides on core {report.get('core')}. The host encodes each "
        "batch with orjson, each distinct task once; the sandboxed child has only the standard library.",
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

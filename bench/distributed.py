"""Training on two processes against one: the same supervised job, the same global batch, the same seed.

One process: `python -m trainer run SPEC.json`, as a worker runs a one-device job. Two: the same spec with
`gpus: 2`, launched exactly as a worker launches a two-device job (`gateway.work.devices.launch`: DDP over
gloo on two CPU processes, each with its share of the cores). The batch is global, so both take the same
optimiser steps and should follow the same loss curve (DDP averages the gradients of the two halves of each
batch); the report gives the largest difference per step and the wall-time ratio. On a 2-core machine two
processes are not faster: the point is that the curve is the same and what the second process costs.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from bench.common import Options, fmt, free_port, ratio
from gateway.work.devices import cpu_devices, launch

ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"What is {a} plus {b}? Reply with the number only."},
            {"role": "assistant", "content": str(a + b)},
        ]
    }
    for a in range(8)
    for b in range(8)
]


def _spec(work: Path, model: Path, gpus: int, steps: int) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    train = work / "train.jsonl"
    train.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    spec = {
        "job_id": f"ftjob-bench-{gpus}",
        "method": "supervised",
        "base_model": str(model),
        "training_file": str(train),
        "output_dir": str(work / "out"),
        "seed": 7,
        "collective_timeout_s": 300,
        "hyperparameters": {
            "gpus": gpus,
            "batch_size": 8,
            "n_epochs": 50,
            "max_steps": steps,
            "checkpoint_every": steps,
        },
    }
    path = work / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def _run(spec: Path, devices: int) -> dict[str, Any]:
    plan = launch(cpu_devices(devices), str(spec), parameters=0, port=free_port())
    env = {**os.environ, **plan.env, "PYTHONUNBUFFERED": "1"}
    cores = plan.cpus or set(os.sched_getaffinity(0))
    t0 = time.perf_counter()
    proc = subprocess.run(
        plan.argv,
        env=env,
        cwd=spec.parent,
        capture_output=True,
        text=True,
        timeout=1800,
        preexec_fn=lambda: os.sched_setaffinity(0, cores),
        check=False,
    )
    seconds = time.perf_counter() - t0
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    losses = {e["step"]: e["data"]["train_loss"] for e in events if e["type"] == "metrics"}
    result = [e for e in events if e["type"] == "result"]
    return {
        "seconds": seconds,
        "returncode": proc.returncode,
        "steps": result[0]["steps"] if result else None,
        "losses": [losses[s] for s in sorted(losses)],
        "stderr_tail": proc.stderr.strip().splitlines()[-3:] if proc.returncode else [],
    }


def run(opts: Options) -> dict[str, Any]:
    from trainer.tiny import make_tiny_model

    steps = 4 if opts.quick else 24
    model = Path(make_tiny_model(str(opts.workdir / "tiny-chat")))
    work = opts.workdir / "distributed"
    one = _run(_spec(work / "one", model, 1, steps), 1)
    two = _run(_spec(work / "two", model, 2, steps), 2)
    gaps = [abs(a - b) for a, b in zip(one["losses"], two["losses"], strict=False)]
    return {
        "steps": steps,
        "one_process": one,
        "two_processes": two,
        "same_steps": one["steps"] == two["steps"] == steps,
        "max_loss_gap": max(gaps) if gaps else None,
        "first_loss": one["losses"][0] if one["losses"] else None,
        "last_loss": one["losses"][-1] if one["losses"] else None,
        "time_ratio": ratio(two["seconds"], one["seconds"]),
    }


def markdown(report: dict[str, Any]) -> list[str]:
    one, two = report["one_process"], report["two_processes"]
    return [
        f"The same supervised job (tiny-chat, global batch 8, seed 7, {report['steps']} steps) in one "
        "process and in two (DDP over gloo, launched as a worker launches a two-device job).",
        "",
        "| | one process | two processes |",
        "|---|---|---|",
        f"| optimiser steps | {one['steps']} | {two['steps']} |",
        f"| wall time (s) | {one['seconds']:.1f} | {two['seconds']:.1f} |",
        f"| loss, first / last step | {fmt(one['losses'][0] if one['losses'] else None, '.4f')} / "
        f"{fmt(one['losses'][-1] if one['losses'] else None, '.4f')} | "
        f"{fmt(two['losses'][0] if two['losses'] else None, '.4f')} / "
        f"{fmt(two['losses'][-1] if two['losses'] else None, '.4f')} |",
        "",
        f"Largest difference of the loss at any step: {fmt(report['max_loss_gap'], '.2e')}. Two processes "
        f"took {fmt(report['time_ratio'])}x the wall time of one, on the same cores: a second process to "
        "start and an all-reduce of the adapter's gradients every step, against two processes' share of a "
        "machine that other work also uses.",
    ]

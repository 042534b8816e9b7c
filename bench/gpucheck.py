"""`scripts/gpu-check`: the GPU path of training, checked in a few minutes on one machine with GPUs.

Each check runs the trainer exactly as a worker launches it (`gateway.work.devices.launch`) on `tiny-chat`:

1. supervised fine-tuning in bf16 on one GPU;
2. GRPO (a string-check grader) in bf16 on one GPU;
3. where two GPUs exist: the supervised job on two (DDP);
4. where vLLM is installed: GRPO generating with vLLM inside the trainer (colocate), and, with two GPUs,
   on a `trl vllm-serve` of its own on the second GPU (server mode).

It prints one line per check (passed / failed / skipped, with its time and why) and exits 1 when a check
that could run failed. docs/operations.md says how to read it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bench.distributed import ROWS
from gateway.work.devices import Device, free_port, launch

RFT = [
    {
        "messages": [{"role": "user", "content": f"Say yes, then the number {i}."}],
        "answer": "yes",
    }
    for i in range(16)
]
SFT = ROWS[:16]
GRADER = {
    "type": "string_check",
    "name": "yes",
    "input": "{{sample.output_text}}",
    "operation": "ilike",
    "reference": "yes",
}


def _spec(work: Path, model: Path, method: str, gpus: int, **extra: Any) -> Path:
    work.mkdir(parents=True, exist_ok=True)
    rows = SFT if method == "supervised" else RFT
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    hp: dict[str, Any] = {
        "gpus": gpus,
        "max_steps": 4,
        "n_epochs": 10,
        "checkpoint_every": 4,
        "batch_size": 4,
    }
    if method == "reinforcement":
        hp.update(num_generations=4, max_completion_length=16)
    spec = {
        "job_id": f"ftjob-gpucheck-{work.name}",
        "method": method,
        "base_model": str(model),
        "training_file": str(work / "train.jsonl"),
        "output_dir": str(work / "out"),
        "hyperparameters": hp,
        "collective_timeout_s": 300,
        **({"grader": GRADER} if method == "reinforcement" else {}),
        **extra,
    }
    (work / "spec.json").write_text(json.dumps(spec))
    return work / "spec.json"


def _train(spec: Path, devices: list[Device]) -> tuple[bool, str]:
    plan = launch(devices, str(spec), parameters=0, port=free_port())
    t0 = time.perf_counter()
    proc = subprocess.run(
        plan.argv,
        env={**os.environ, **plan.env},
        cwd=spec.parent,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    seconds = time.perf_counter() - t0
    events = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    result = [e for e in events if e["type"] == "result"]
    errors = [e["message"] for e in events if e["type"] == "error"]
    if proc.returncode == 0 and result:
        loaded = next((e["message"] for e in events if e.get("message", "").startswith("Loaded model")), "")
        return True, f"{result[0]['steps']} steps in {seconds:.0f}s ({loaded.rpartition(' on ')[2]})"
    why = errors[-1] if errors else " ".join(proc.stderr.strip().splitlines()[-2:])
    return False, f"exit {proc.returncode} after {seconds:.0f}s: {why[-300:]}"


@contextlib.contextmanager
def _server(device: Device, model: Path, work: Path) -> Iterator[str]:
    from gateway.worker.job.generation import generation_server

    loop = asyncio.new_event_loop()
    manager = generation_server([device], str(model), work)
    address = loop.run_until_complete(manager.__aenter__())
    try:
        yield address
    finally:
        loop.run_until_complete(manager.__aexit__(None, None, None))
        loop.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check", description=__doc__.split("\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("bench/results/gpu-check"))
    args = parser.parse_args(argv)
    import torch

    from trainer.tiny import make_tiny_model

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to check")
        return 1
    count = torch.cuda.device_count()
    name = torch.cuda.get_device_name(0)
    print(f"gpu-check: {count} x {name}, torch {torch.__version__}")
    model = Path(make_tiny_model(str(args.workdir / "tiny-chat")))
    gpu = [Device("cuda", i) for i in range(count)]
    has_vllm = importlib.util.find_spec("vllm") is not None
    checks: list[tuple[str, Any]] = [
        ("bf16 SFT, 1 GPU", lambda w: _train(_spec(w, model, "supervised", 1), gpu[:1])),
        ("bf16 GRPO, 1 GPU", lambda w: _train(_spec(w, model, "reinforcement", 1), gpu[:1])),
        (
            "bf16 SFT, 2 GPUs (DDP)",
            (lambda w: _train(_spec(w, model, "supervised", 2), gpu[:2])) if count > 1 else "one GPU",
        ),
        (
            "GRPO, vLLM colocate",
            (lambda w: _train(_spec(w, model, "reinforcement", 1, use_vllm=True), gpu[:1]))
            if has_vllm
            else "vLLM not installed",
        ),
    ]
    if has_vllm and count > 1:

        def server_mode(work: Path) -> tuple[bool, str]:
            with _server(gpu[1], model, work) as address:
                return _train(
                    _spec(work, model, "reinforcement", 1, use_vllm=True, vllm_server=address), gpu[:1]
                )

        checks.append(("GRPO, vLLM server mode", server_mode))
    else:
        checks.append(("GRPO, vLLM server mode", "needs vLLM and two GPUs"))
    failed = 0
    for i, (title, check) in enumerate(checks):
        if isinstance(check, str):
            print(f"  skipped  {title}: {check}")
            continue
        try:
            ok, detail = check(args.workdir / f"check-{i}")
        except Exception as exc:  # noqa: BLE001 - a check that breaks is reported, the others still run
            ok, detail = False, f"{type(exc).__name__}: {exc}"
        failed += not ok
        print(f"  {'passed ' if ok else 'FAILED '} {title}: {detail}")
    print("gpu-check:", "all checks that could run passed" if not failed else f"{failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

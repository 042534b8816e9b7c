"""Training overhead: the same tiny GRPO run through tunegate and as a plain TRL script, and the time from a
job's success to the first streamed token of its model.

tunegate: the gateway, the queue, a worker, the trainer process and its events, the adapter published to
the embedded engine (`python -m tunegate inference`), all as separate processes on real PostgreSQL and Redis;
timed from `fine_tuning.jobs.create` to the job reading `succeeded`. Plain TRL: `GRPOTrainer` with the same
LoRA (r 8, alpha 16, all linear layers), data, hyperparameters, seed and checkpoint interval in one process
(`python -m bench.training plain SPEC.json`), timed from its start to its end (imports and model load
included on both sides). Then: the first token of the new `ft:` model streamed through the gateway, timed
from the moment the job was seen `succeeded` (polled every 50 ms).
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Options, fmt, free_port, ratio, wait_port
from bench.stack import (
    Process,
    Services,
    bench_settings,
    make_tenant,
    start_gateway,
    start_worker,
)

logger = logging.getLogger(__name__)

TASKS = [{"messages": [{"role": "user", "content": f"Say yes ({i})"}], "answer": "yes"} for i in range(8)]
GRADER = {
    "type": "string_check",
    "name": "yes",
    "input": "{{ sample.output_text }}",
    "reference": "y",
    "operation": "like",
}
SEED = 1


def hyperparameters(steps: int) -> dict[str, Any]:
    return {
        "batch_size": 2,
        "num_generations": 4,
        "max_completion_length": 8,
        "learning_rate_multiplier": 3000,
        "max_steps": steps,
        "n_epochs": 50,
        "temperature": 1.0,
    }


# ---------------------------------------------------------------------------------------------- plain TRL
def plain(spec_path: Path) -> dict[str, Any]:
    """The baseline: one process, GRPOTrainer + LoRA directly (the trainer's settings, no tunegate)."""
    spec = json.loads(spec_path.read_text())
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from gateway.jobs.validation import BASE_LEARNING_RATE

    hp = spec["hyperparameters"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    data = Dataset.from_list([{"prompt": t["messages"], "answer": t["answer"]} for t in TASKS])

    def contains_y(completions: list[Any], **_: Any) -> list[float | None]:
        texts = [c[-1]["content"] if isinstance(c, list) else str(c) for c in completions]
        return [1.0 if "y" in t else 0.0 for t in texts]

    config = GRPOConfig(
        output_dir=spec["output_dir"],
        num_train_epochs=hp["n_epochs"],
        max_steps=hp["max_steps"],
        learning_rate=hp["learning_rate_multiplier"] * BASE_LEARNING_RATE["reinforcement"],
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=5,
        report_to=[],
        seed=SEED,
        data_seed=SEED,
        use_cpu=True,
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=hp["batch_size"] * hp["num_generations"],
        num_generations=hp["num_generations"],
        max_completion_length=hp["max_completion_length"],
        temperature=hp["temperature"],
        beta=0.0,
        remove_unused_columns=False,
    )
    lora = LoraConfig(
        r=8, lora_alpha=16, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[contains_y],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
    )
    t0 = time.perf_counter()
    trainer.train()
    trainer.save_model(str(Path(spec["output_dir"]) / "adapter"))
    lengths = [
        e["completions/mean_length"] for e in trainer.state.log_history if "completions/mean_length" in e
    ]
    return {
        "train_s": time.perf_counter() - t0,
        "steps": trainer.state.global_step,
        "completion_length_mean": sum(lengths) / len(lengths) if lengths else None,
    }


def _run_plain(model: Path, work: Path, steps: int) -> dict[str, Any]:
    spec = {"model": str(model), "output_dir": str(work / "plain"), "hyperparameters": hyperparameters(steps)}
    spec_path = work / "plain-spec.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.training", "plain", str(spec_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"plain TRL run failed: {proc.stderr[-2000:]}")
    inner = json.loads(proc.stdout.strip().splitlines()[-1])
    return {"wall_s": wall, **inner}


# ---------------------------------------------------------------------------------------------- tunegate
def _start_engine(model: Path, log_path: Path) -> tuple[Process, str]:
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "tunegate",
        "inference",
        "--model",
        f"tiny-chat={model}",
        "--port",
        str(port),
    ]
    proc = Process(cmd, log_path)
    wait_port(port, 120, proc.proc)
    return proc, f"http://127.0.0.1:{port}"


def _through_tunegate(model: Path, work: Path, steps: int) -> dict[str, Any]:
    import openai

    services = Services.start(work, redis=True)
    procs: list[Process] = []
    try:
        engine, engine_url = _start_engine(model, work / "engine.log")
        procs.append(engine)
        settings = bench_settings(services, work / "data", upstreams=[engine_url], model_path=model)
        procs.append(start_gateway(settings, work / "gateway.log", None))
        procs.append(start_worker(settings, work / "worker.log"))
        url = f"http://127.0.0.1:{settings.port}"
        _, key = make_tenant(url, settings)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        data = "\n".join(json.dumps(t) for t in TASKS).encode()
        file_id = client.files.create(file=("tasks.jsonl", data), purpose="fine-tune").id
        t0 = time.perf_counter()
        method: Any = {
            "type": "reinforcement",
            "reinforcement": {"grader": GRADER, "hyperparameters": hyperparameters(steps)},
        }
        job = client.fine_tuning.jobs.create(
            model="tiny-chat", training_file=file_id, seed=SEED, method=method
        )
        running_at: float | None = None
        while job.status not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.05)
            job = client.fine_tuning.jobs.retrieve(job.id)
            if running_at is None and job.status == "running":
                running_at = time.perf_counter() - t0
        succeeded_at = time.perf_counter()
        if job.status != "succeeded" or not job.fine_tuned_model:
            raise RuntimeError(f"job {job.id} ended {job.status}: {job.error}")
        stream = client.chat.completions.create(
            model=job.fine_tuned_model,
            messages=[{"role": "user", "content": "Say yes (1)"}],
            max_tokens=4,
            stream=True,
        )
        first_token_s: float | None = None
        for chunk in stream:
            if first_token_s is None and chunk.choices and chunk.choices[0].delta.content:
                first_token_s = time.perf_counter() - succeeded_at
        events = client.fine_tuning.jobs.list_events(job.id, limit=1000).data
        lengths = [
            e.data["completion_length_mean"]
            for e in events
            if e.type == "metrics" and isinstance(e.data, dict) and "completion_length_mean" in e.data
        ]
        return {
            "completion_length_mean": sum(lengths) / len(lengths) if lengths else None,
            "wall_s": succeeded_at - t0,
            "running_after_s": running_at,
            "success_to_first_token_ms": first_token_s * 1000 if first_token_s is not None else None,
            "model": job.fine_tuned_model,
        }
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()


def run(opts: Options) -> dict[str, Any]:
    from trainer.tiny import make_tiny_model

    steps = 2 if opts.quick else 20
    work = opts.workdir / "training"
    work.mkdir(parents=True, exist_ok=True)
    model = Path(make_tiny_model(opts.workdir / "tiny-chat"))
    # Plain, tunegate, plain again: the baseline is the mean of the runs either side, so that a machine
    # that speeds up or slows down over the minutes does not favour one side.
    runs = [_run_plain(model, work, steps)]
    tunegate = _through_tunegate(model, work, steps)
    if not opts.quick:
        runs.append(_run_plain(model, work, steps))
    wall = sum(r["wall_s"] for r in runs) / len(runs)
    lengths = [r["completion_length_mean"] for r in runs if r.get("completion_length_mean") is not None]
    baseline = {
        "runs": runs,
        "wall_s": wall,
        "train_s": sum(r["train_s"] for r in runs) / len(runs),
        "steps": runs[0]["steps"],
        "completion_length_mean": sum(lengths) / len(lengths) if lengths else None,
    }
    return {
        "steps": steps,
        "hyperparameters": hyperparameters(steps),
        "plain_trl": baseline,
        "tunegate": tunegate,
        "overhead_ratio": ratio(tunegate["wall_s"], wall),
        "overhead_s": tunegate["wall_s"] - wall,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    t, p = report["tunegate"], report["plain_trl"]
    first = t.get("success_to_first_token_ms")
    runs = p.get("runs") or [p]
    walls = " and ".join(f"{r['wall_s']:.1f}" for r in runs)
    return [
        f"The same GRPO run ({report['steps']} steps, tiny-chat, string_check grader, LoRA r 8, batch "
        f"{report['hyperparameters']['batch_size']} x {report['hyperparameters']['num_generations']} "
        "generations, CPU) through tunegate (gateway, queue, worker, trainer process, events, adapter "
        "published to the engine) and as a plain TRL script in one process, run before and after "
        "tunegate's (the baseline is their mean).",
        "",
        "| path | wall s | of which training s | mean completion tokens | ratio |",
        "|---|---|---|---|---|",
        f"| plain TRL ({walls}) | {p['wall_s']:.1f} | {p['train_s']:.1f} "
        f"| {fmt(p.get('completion_length_mean'))} | 1.00 |",
        f"| tunegate (create -> succeeded) | {t['wall_s']:.1f} | - | {fmt(t.get('completion_length_mean'))} "
        f"| {report['overhead_ratio']:.2f} |",
        "",
        f"Overhead {report['overhead_s']:.1f} s; job running {t.get('running_after_s') or 0:.2f} s after "
        f"create. Job success -> first streamed token of `ft:` model through the gateway: "
        f"{fmt(first, '.1f')} ms. A GRPO step's time follows the lengths of the completions it samples, so "
        "the mean completion tokens of both sides show whether they did the same work.",
    ]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "plain":
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(plain(Path(sys.argv[2]))))
    else:
        sys.exit("usage: python -m bench.training plain SPEC.json")

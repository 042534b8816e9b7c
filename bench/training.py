"""Training through tunegate against a plain TRL script: the same GRPO run must learn the same and cost no
more, and a job's model must answer at once.

The run: `tiny-chat` on the arithmetic example (70 single-digit additions, rewarded by the example
environment's own reward: 1 for exactly the number, 0.5 for a text holding it, 0.1 for any digits), with
tunegate's default hyperparameters, judged on the 30 held-out problems (greedy exact answers).

tunegate: the gateway, the queue, a worker, the trainer process with the environment in its sandbox, its
events and evaluations, the adapter published to the embedded engine (`python -m tunegate inference`), all
separate processes on real PostgreSQL and Redis; timed from `fine_tuning.jobs.create` to `succeeded`.
Plain TRL: `GRPOTrainer` in one process (`python -m bench.training plain SPEC.json`) with the same LoRA (all
linear layers), the hyperparameters the tunegate job resolved and reported, the same data, seed and reward
code (the environment's class, called in-process), timed from its start to its end (imports and model load
included on both sides). Learning parity: both sides' reward per step, and the held-out exact-match rate of
each adapter, over the same seeds. Then: the first token of the new `ft:` model streamed through the
gateway, timed from the moment the job was seen `succeeded` (polled every 50 ms).
"""

from __future__ import annotations

import importlib.util
import json
import logging
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Options, fmt, free_port, ratio
from bench.stack import (
    Process,
    Services,
    bench_settings,
    make_tenant,
    start_gateway,
    start_worker,
)
from tunegate.role_processes import EngineProcess

logger = logging.getLogger(__name__)

ARITHMETIC = ROOT / "examples" / "envs" / "arithmetic"
SEEDS = (1, 2)
QUICK_STEPS = 2


def _rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (ARITHMETIC / name).read_text().splitlines() if line.strip()]


def _pairs(rows: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """(a, b) of each "What is a + b? ..." task."""
    out = []
    for row in rows:
        words = row["messages"][0]["content"].replace("?", "").split()
        out.append((int(words[2]), int(words[4])))
    return out


# ---------------------------------------------------------------------------------------------- plain TRL
def _environment_reward() -> Any:
    """The arithmetic environment's own reward, as a TRL reward function called in this process."""
    spec = importlib.util.spec_from_file_location("arithmetic_env", ARITHMETIC / "arithmetic_env.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    env = module.ArithmeticEnv(config={"partial_credit": True})

    def environment(completions: list[Any], answer: list[str], **_: Any) -> list[float | None]:
        return [env.reward({"answer": a}, c) for c, a in zip(completions, answer, strict=True)]

    return environment


def plain(spec_path: Path) -> dict[str, Any]:
    """The baseline: one process, GRPOTrainer + LoRA directly (the job's hyperparameters, no tunegate)."""
    spec = json.loads(spec_path.read_text())
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from trainer.tiny import addition_exact

    hp, seed = spec["hyperparameters"], spec["seed"]
    tokenizer = AutoTokenizer.from_pretrained(spec["model"])
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec["model"])
    data = Dataset.from_list([{"prompt": t["messages"], "answer": t["answer"]} for t in _rows("tasks.jsonl")])
    config = GRPOConfig(
        output_dir=spec["output_dir"],
        num_train_epochs=hp["n_epochs"],
        max_steps=hp["max_steps"] or -1,
        learning_rate=hp["learning_rate"],
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="steps",
        save_steps=hp["checkpoint_every"],
        report_to=[],
        seed=seed,
        data_seed=seed,
        use_cpu=True,
        gradient_checkpointing=False,
        disable_tqdm=True,
        dataloader_num_workers=0,
        per_device_train_batch_size=hp["batch_size"] * hp["num_generations"],
        num_generations=hp["num_generations"],
        max_completion_length=hp["max_completion_length"],
        temperature=hp["temperature"],
        beta=hp["kl_beta"],
        remove_unused_columns=False,
    )
    lora = LoraConfig(
        r=hp["lora_r"],
        lora_alpha=hp["lora_alpha"],
        lora_dropout=0.0,
        target_modules="all-linear",
        bias="none",
        task_type="CAUSAL_LM",
    )
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[_environment_reward()],
        args=config,
        train_dataset=data,
        processing_class=tokenizer,
        peft_config=lora,
    )
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    adapter = Path(spec["output_dir"]) / "adapter"
    trainer.save_model(str(adapter))
    logs = trainer.state.log_history
    return {
        "train_s": train_s,
        "steps": trainer.state.global_step,
        "rewards": [e["reward"] for e in logs if "reward" in e],
        "completion_length_mean": statistics.fmean(
            e["completions/mean_length"] for e in logs if "completions/mean_length" in e
        ),
        "heldout_exact": addition_exact(spec["model"], _pairs(_rows("heldout.jsonl")), adapter=adapter),
    }


def _run_plain(model: Path, work: Path, seed: int, hyperparameters: dict[str, Any]) -> dict[str, Any]:
    spec = {
        "model": str(model),
        "output_dir": str(work / f"plain-{seed}"),
        "seed": seed,
        "hyperparameters": hyperparameters,
    }
    spec_path = work / f"plain-spec-{seed}.json"
    spec_path.write_text(json.dumps(spec))
    t0 = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "bench.training", "plain", str(spec_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"plain TRL run failed: {proc.stderr[-2000:]}")
    return {"wall_s": wall, "seed": seed, **json.loads(proc.stdout.strip().splitlines()[-1])}


# ---------------------------------------------------------------------------------------------- tunegate
def _start_engine(model: Path, log_path: Path) -> tuple[Process, str]:
    engine = EngineProcess({"tiny-chat": model}, free_port(), log_path).wait_ready(120)
    return engine, engine.url


def _heldout_exact(client: Any, model: str) -> float:
    """Greedy exact answers of `model`, served by the gateway, on the held-out problems."""
    rows = _rows("heldout.jsonl")
    right = 0
    for row in rows:
        reply = client.chat.completions.create(
            model=model, messages=row["messages"], max_tokens=16, temperature=0.0
        )
        right += (reply.choices[0].message.content or "").strip() == row["answer"]
    return right / len(rows)


def _tunegate_job(client: Any, env_file: str, tasks: str, heldout: str, seed: int, steps: int | None) -> Any:
    hp: dict[str, Any] = {"max_steps": steps} if steps else {}
    method: Any = {
        "type": "reinforcement",
        "reinforcement": {"environment": {"file_id": env_file, "config": {}}, "hyperparameters": hp},
    }
    t0 = time.perf_counter()
    job = client.fine_tuning.jobs.create(
        model="tiny-chat", training_file=tasks, validation_file=heldout, seed=seed, method=method
    )
    running_at: float | None = None
    while job.status not in ("succeeded", "failed", "cancelled"):
        time.sleep(0.05)
        job = client.fine_tuning.jobs.retrieve(job.id)
        if running_at is None and job.status == "running":
            running_at = time.perf_counter() - t0
    if job.status != "succeeded" or not job.fine_tuned_model:
        raise RuntimeError(f"job {job.id} ended {job.status}: {job.error}")
    return job, time.perf_counter() - t0, running_at, time.perf_counter()


def _through_tunegate(model: Path, work: Path, seeds: tuple[int, ...], steps: int | None) -> list[dict]:
    import openai

    from envsdk.archive import pack

    services = Services.start(work, redis=True)
    procs: list[Process] = []
    runs: list[dict[str, Any]] = []
    try:
        engine, engine_url = _start_engine(model, work / "engine.log")
        procs.append(engine)
        settings = bench_settings(services, work / "data", upstreams=[engine_url], model_path=model)
        procs.append(start_gateway(settings, work / "gateway.log", None))
        procs.append(start_worker(settings, work / "worker.log"))
        url = f"http://127.0.0.1:{settings.port}"
        _, key = make_tenant(url, settings)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=60)
        archive, _ = pack(ARITHMETIC, work / "arithmetic.tar.gz")
        env_file = client.files.create(
            file=(archive.name, archive.read_bytes()),
            purpose="environment",  # type: ignore[arg-type]  # tunegate's purpose for packages
        ).id
        tasks, heldout = (
            client.files.create(file=(name, (ARITHMETIC / name).read_bytes()), purpose="fine-tune").id
            for name in ("tasks.jsonl", "heldout.jsonl")
        )
        base_exact = _heldout_exact(client, "tiny-chat")
        for seed in seeds:
            job, wall, running_at, succeeded_at = _tunegate_job(client, env_file, tasks, heldout, seed, steps)
            stream = client.chat.completions.create(
                model=job.fine_tuned_model,
                messages=[{"role": "user", "content": "What is 2 + 2? Reply with the number only."}],
                max_tokens=4,
                stream=True,
            )
            first_token_s: float | None = None
            for chunk in stream:
                if first_token_s is None and chunk.choices and chunk.choices[0].delta.content:
                    first_token_s = time.perf_counter() - succeeded_at
            events = client.fine_tuning.jobs.list_events(job.id, limit=100)
            points: list[dict[str, Any]] = sorted(
                (dict(e.data) for e in events if e.type == "metrics" and isinstance(e.data, dict)),
                key=lambda d: d["step"],
            )
            runs.append(
                {
                    "seed": seed,
                    "wall_s": wall,
                    "running_after_s": running_at,
                    "success_to_first_token_ms": first_token_s * 1000 if first_token_s is not None else None,
                    "model": job.fine_tuned_model,
                    "hyperparameters": job.method.reinforcement.hyperparameters.model_dump(),
                    "rewards": [d["reward_mean"] for d in points if "reward_mean" in d],
                    "completion_length_mean": statistics.fmean(
                        d["completion_length_mean"] for d in points if "completion_length_mean" in d
                    ),
                    "base_heldout_exact": base_exact,
                    "heldout_exact": _heldout_exact(client, job.fine_tuned_model),
                }
            )
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()
    return runs


def _curve_gap(a: list[Any], b: list[Any]) -> float:
    """Largest difference of the two sides' mean reward over any tenth of the run."""
    n = min(len(r) for r in a + b)
    width = max(1, n // 10)
    gaps = []
    for start in range(0, n - width + 1, width):
        mean_a = statistics.fmean(statistics.fmean(r[start : start + width]) for r in a)
        mean_b = statistics.fmean(statistics.fmean(r[start : start + width]) for r in b)
        gaps.append(abs(mean_a - mean_b))
    return max(gaps)


def run(opts: Options) -> dict[str, Any]:
    from trainer.tiny import make_tiny_model

    seeds = SEEDS[:1] if opts.quick else SEEDS
    steps = QUICK_STEPS if opts.quick else None
    work = opts.workdir / "training"
    work.mkdir(parents=True, exist_ok=True)
    model = Path(make_tiny_model(opts.workdir / "tiny-chat"))
    tunegate = _through_tunegate(model, work, seeds, steps)
    hp = {k: v for k, v in tunegate[0]["hyperparameters"].items() if v is not None} | {"max_steps": steps}
    plain_runs = [_run_plain(model, work, seed, hp) for seed in seeds]
    t_wall = statistics.fmean(r["wall_s"] for r in tunegate)
    p_wall = statistics.fmean(r["wall_s"] for r in plain_runs)
    return {
        "seeds": list(seeds),
        "steps": plain_runs[0]["steps"],
        "hyperparameters": hp,
        "plain_trl": {
            "runs": plain_runs,
            "wall_s": p_wall,
            "train_s": statistics.fmean(r["train_s"] for r in plain_runs),
            "steps": plain_runs[0]["steps"],
            "completion_length_mean": statistics.fmean(r["completion_length_mean"] for r in plain_runs),
            "heldout_exact": statistics.fmean(r["heldout_exact"] for r in plain_runs),
        },
        "tunegate": {
            "runs": tunegate,
            "wall_s": t_wall,
            "completion_length_mean": statistics.fmean(r["completion_length_mean"] for r in tunegate),
            "success_to_first_token_ms": tunegate[0]["success_to_first_token_ms"],
            "running_after_s": tunegate[0]["running_after_s"],
            "model": tunegate[0]["model"],
            "base_heldout_exact": tunegate[0]["base_heldout_exact"],
            "heldout_exact": statistics.fmean(r["heldout_exact"] for r in tunegate),
        },
        "overhead_ratio": ratio(t_wall, p_wall),
        "overhead_s": t_wall - p_wall,
        "reward_curve_gap": _curve_gap([r["rewards"] for r in tunegate], [r["rewards"] for r in plain_runs]),
    }


def markdown(report: dict[str, Any]) -> list[str]:
    t, p = report["tunegate"], report["plain_trl"]
    hp = report["hyperparameters"]
    first = t.get("success_to_first_token_ms")

    def per_seed(side: dict[str, Any], key: str, spec: str = ".0%") -> str:
        return " / ".join(format(r[key], spec) for r in side["runs"])

    return [
        f"The same GRPO run ({report['steps']} steps, tiny-chat, the arithmetic example with its "
        f"environment's reward, tunegate's default hyperparameters: {hp['batch_size']} prompts x "
        f"{hp['num_generations']} answers a step, lr {hp['learning_rate']:.1e}, LoRA r {hp['lora_r']}; "
        "CPU) through tunegate (gateway, queue, worker, trainer process, sandboxed environment, "
        "evaluations, adapter published to the engine) and as a plain TRL script in one process, with the "
        f"same seeds ({', '.join(str(s) for s in report['seeds'])}).",
        "",
        "| path | wall s | of which training s | mean completion tokens | held-out exact, per seed | ratio |",
        "|---|---|---|---|---|---|",
        f"| plain TRL | {p['wall_s']:.1f} | {p['train_s']:.1f} | {fmt(p.get('completion_length_mean'))} "
        f"| {per_seed(p, 'heldout_exact')} | 1.00 |",
        f"| tunegate (create -> succeeded) | {t['wall_s']:.1f} | - | {fmt(t.get('completion_length_mean'))} "
        f"| {per_seed(t, 'heldout_exact')} | {report['overhead_ratio']:.2f} |",
        "",
        f"Learning parity: held-out exact answers go from {t['base_heldout_exact']:.0%} (base) to "
        f"{t['heldout_exact']:.0%} through tunegate and {p['heldout_exact']:.0%} with plain TRL (means over "
        f"the seeds); the two sides' mean reward differs by at most {report['reward_curve_gap']:.3f} over "
        "any tenth of the run.",
        "",
        f"Overhead {report['overhead_s']:.1f} s a run (tunegate also scores the held-out set greedily before "
        f"the first step and at each checkpoint); job running {t.get('running_after_s') or 0:.2f} s after "
        f"create. Job success -> first streamed token of `ft:` model through the gateway: "
        f"{fmt(first, '.1f')} ms.",
    ]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "plain":
        logging.basicConfig(level=logging.WARNING)
        print(json.dumps(plain(Path(sys.argv[2]))))
    else:
        sys.exit("usage: python -m bench.training plain SPEC.json")

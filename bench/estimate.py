"""Estimate accuracy: what `POST /v1/fine_tuning/jobs/estimate` says a job will cost against what the job
then cost, on reference jobs on `tiny-chat`.

The references: a supervised job (32 chats of varied length, 2 epochs of batches of 4), a DPO job (16
preference pairs, 2 epochs of batches of 4) and the quickstart's reinforcement job (GRPO on the arithmetic
environment, `examples/envs/arithmetic`: its 70 tasks, its 30 held-out problems as the validation file,
every hyperparameter left to its default), each estimated and then run to the end through the gateway, an
embedded engine serving `tiny-chat` (the reinforcement estimate's pilot samples through it), a worker and
the trainer process on real PostgreSQL and Redis. The actual cost is the job's own `cost.accrued` once it
succeeded (its recorded training usage, priced by the price table); the ratio is the estimate's expected
cost over it (1.00: exact), with the trained tokens beside it (the estimate's against the job's
`trained_tokens`). Prices are the defaults (per trained token; no hourly price), so the cost ratio is the
token ratio. For the reinforcement job the pilot's measured completion length is shown beside the mean
length the job's completions had (`completion_length_mean` of its metrics events, averaged over its steps).

`python -m bench.estimate [--quick]` prints the report and the ratios.
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import time
from pathlib import Path
from typing import Any

from bench.common import RESULTS_DIR, ROOT, Options, fmt, free_port, ratio
from bench.stack import Process, Services, bench_settings, make_tenant, start_gateway, start_worker
from tunegate.role_processes import EngineProcess

logger = logging.getLogger(__name__)

WORDS = (
    "the quick brown fox jumps over a lazy dog while seven small birds sing about rain on the old red roof "
    "near quiet water and tall green trees"
).split()


def _sentence(rng: random.Random, most: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, most))).capitalize() + "."


def reference_rows(method: str, n: int, seed: int = 7) -> list[dict[str, Any]]:
    """Rows of varied length for `method` (the same for a seed)."""
    rng = random.Random(seed)
    rows: list[dict[str, Any]] = []
    for _ in range(n):
        prompt = [{"role": "user", "content": "Repeat: " + _sentence(rng, 24)}]
        if method == "supervised":
            rows.append({"messages": [*prompt, {"role": "assistant", "content": _sentence(rng, 30)}]})
        else:
            rows.append(
                {
                    "input": {"messages": prompt},
                    "preferred_output": [{"role": "assistant", "content": _sentence(rng, 20)}],
                    "non_preferred_output": [{"role": "assistant", "content": _sentence(rng, 20)}],
                }
            )
    return rows


REFERENCES: dict[str, dict[str, Any]] = {
    "supervised": {"rows": 32, "hyperparameters": {"n_epochs": 2, "batch_size": 4}},
    "dpo": {"rows": 16, "hyperparameters": {"n_epochs": 2, "batch_size": 4}},
    "reinforcement": {"rows": 70, "hyperparameters": {}},  # the quickstart's job: every default
}
ARITHMETIC = ROOT / "examples" / "envs" / "arithmetic"
QUICK_RL_STEPS = 4


def _wait(client: Any, job_id: str, timeout_s: float = 900) -> Any:
    deadline = time.monotonic() + timeout_s
    job = client.fine_tuning.jobs.retrieve(job_id)
    while job.status not in ("succeeded", "failed", "cancelled"):
        if time.monotonic() > deadline:
            raise RuntimeError(f"job {job_id} still {job.status} after {timeout_s:.0f} s")
        time.sleep(0.3)
        job = client.fine_tuning.jobs.retrieve(job_id)
    if job.status != "succeeded":
        raise RuntimeError(f"job {job_id} ended {job.status}: {job.error}")
    return job


def _upload(client: Any, name: str, data: bytes, purpose: str = "fine-tune") -> str:
    return str(client.files.create(file=(name, data), purpose=purpose).id)


def _body(client: Any, method: str, quick: bool, work: Path) -> tuple[dict[str, Any], int]:
    """The create's body of a reference job, and the rows of its training file."""
    ref = REFERENCES[method]
    if method == "reinforcement":
        from envsdk.archive import pack

        archive, _ = pack(ARITHMETIC, work / "arithmetic.tar.gz")
        env = _upload(client, archive.name, archive.read_bytes(), "environment")
        tasks, heldout = (
            _upload(client, name, (ARITHMETIC / name).read_bytes())
            for name in ("tasks.jsonl", "heldout.jsonl")
        )
        hp = {"max_steps": QUICK_RL_STEPS} if quick else dict(ref["hyperparameters"])
        rl = {"environment": {"file_id": env, "config": {"partial_credit": True}}, "hyperparameters": hp}
        rows = len((ARITHMETIC / "tasks.jsonl").read_text().splitlines())
        body = {
            "model": "tiny-chat",
            "training_file": tasks,
            "validation_file": heldout,
            "method": {"type": method, method: rl},
        }
        return body, rows
    data_rows = reference_rows(method, 8 if quick else ref["rows"])
    data = "\n".join(json.dumps(r) for r in data_rows).encode()
    hp = {**ref["hyperparameters"], **({"n_epochs": 1} if quick else {})}
    body = {
        "model": "tiny-chat",
        "training_file": _upload(client, f"{method}.jsonl", data),
        "method": {"type": method, method: {"hyperparameters": hp}},
    }
    return body, len(data_rows)


def _completion_mean(client: Any, job_id: str) -> float | None:
    """The mean of the job's `completion_length_mean` metrics over its steps (reinforcement)."""
    values = [
        float(e.data["completion_length_mean"])
        for e in client.fine_tuning.jobs.list_events(job_id, limit=1000)
        if e.type == "metrics" and isinstance(e.data, dict) and "completion_length_mean" in e.data
    ]
    return sum(values) / len(values) if values else None


def _reference(client: Any, method: str, quick: bool, work: Path) -> dict[str, Any]:
    body, rows = _body(client, method, quick, work)
    t0 = time.perf_counter()
    estimate = client.post("/fine_tuning/jobs/estimate", body=body, cast_to=object)
    estimate_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    job = _wait(client, client.fine_tuning.jobs.create(**body).id)
    wall = time.perf_counter() - t0
    extra = job.model_extra or {}
    actual = float(extra["cost"]["accrued"])
    expected = float(estimate["cost"]["expected"])
    assumed = {a["name"]: a["value"] for a in estimate["assumptions"]}
    return {
        "method": method,
        "rows": rows,
        "hyperparameters": estimate["hyperparameters"],
        "estimate_s": estimate_s,
        "pilot": assumed.get("pilot"),
        "estimated_completion": assumed.get("completion_tokens"),
        "job_completion_mean": _completion_mean(client, job.id) if method == "reinforcement" else None,
        "steps": estimate["steps"],
        "estimated_tokens": estimate["tokens"]["trained"]["expected"],
        "trained_tokens": job.trained_tokens,
        "estimated_usd": expected,
        "estimated_usd_low": float(estimate["cost"]["low"]),
        "estimated_usd_high": float(estimate["cost"]["high"]),
        "actual_usd": actual,
        "cost_ratio": ratio(expected, actual),
        "token_ratio": ratio(estimate["tokens"]["trained"]["expected"], job.trained_tokens or 0),
        "estimated_seconds": estimate["compute_seconds"]["expected"],
        "training_seconds": extra.get("usage", {}).get("training_seconds"),
        "job_wall_s": wall,
    }


def run(opts: Options) -> dict[str, Any]:
    import openai

    from trainer.tiny import make_tiny_model

    work = opts.workdir / "estimate"
    work.mkdir(parents=True, exist_ok=True)
    model = Path(make_tiny_model(opts.workdir / "tiny-chat"))
    services = Services.start(work, redis=True)
    procs: list[Process] = []
    try:
        engine = EngineProcess({"tiny-chat": model}, free_port(), work / "engine.log").wait_ready(120)
        procs.append(engine)
        settings = bench_settings(services, work / "data", upstreams=[engine.url], model_path=model)
        procs.append(start_gateway(settings, work / "gateway.log", None))
        procs.append(start_worker(settings, work / "worker.log"))
        url = f"http://127.0.0.1:{settings.port}"
        _, key = make_tenant(url, settings)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        jobs = [_reference(client, method, opts.quick, work) for method in REFERENCES]
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()
    return {"jobs": jobs, "worst_cost_error": max(abs((j["cost_ratio"] or 0) - 1) for j in jobs)}


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        "Each reference job estimated (`POST /v1/fine_tuning/jobs/estimate`), then run to the end on "
        "tiny-chat (gateway, embedded engine, worker, trainer process; CPU); actual cost is the finished "
        "job's `cost.accrued` (default prices: per trained token).",
        "",
        "| job | rows x epochs, batch | steps | estimated tokens | trained tokens | estimated $ (low-high) "
        "| actual $ | estimate / actual | estimate took s | estimated s | training s |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for j in report["jobs"]:
        hp = j["hyperparameters"]
        lines.append(
            f"| {j['method']} | {j['rows']} x {hp['n_epochs']}, {hp['batch_size']} | {j['steps']} "
            f"| {j['estimated_tokens']:,.0f} | {j['trained_tokens'] or 0:,} | {j['estimated_usd']:.6f} "
            f"({j['estimated_usd_low']:.6f}-{j['estimated_usd_high']:.6f}) "
            f"| {j['actual_usd']:.6f} | {fmt(j['cost_ratio'], '.3f')} | {j['estimate_s']:.2f} "
            f"| {j['estimated_seconds']:.1f} | {fmt(j['training_seconds'], '.1f')} |"
        )
    for j in report["jobs"]:
        pilot, completion = j.get("pilot"), j.get("estimated_completion")
        if not pilot or not completion:
            continue
        hp = j["hyperparameters"]
        ran = (
            f"{pilot['completions']} completions ({pilot['prompts']} prompts x "
            f"{pilot['completions_per_prompt']}, temperature {pilot['temperature']:g}, at most "
            f"{pilot['max_completion_tokens']} tokens) in {pilot['seconds']:.2f} s, "
            f"{pilot['usage']['prompt_tokens'] + pilot['usage']['completion_tokens']} tokens metered "
            f"(${pilot['cost_usd']:.6f})"
            if pilot.get("ran")
            else f"not run ({pilot.get('reason')})"
        )
        lines += [
            "",
            f"{j['method']}: {hp['num_generations']} completions a prompt, at most "
            f"{hp['max_completion_length']} tokens. The pilot: {ran}. Completion tokens estimated "
            f"{completion['expected']:.2f} (low {completion['low']:.2f}, high {completion['high']:.2f}); "
            f"the job's completions averaged {fmt(j['job_completion_mean'], '.2f')} over its steps.",
        ]
    lines += [
        "",
        f"Worst cost error: {report['worst_cost_error']:.1%} (the issue asks for at most 15%). Compute "
        "seconds are not priced here; without recorded training of the model and method the estimate assumes "
        "a GPU's throughput (`DEFAULT_TOKENS_PER_SECOND`), and from an organisation's second job on it uses "
        "the throughput its own jobs measured.",
    ]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.estimate", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="8 rows, one epoch, 4 reinforcement steps: checks that it runs"
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS_DIR)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    report = run(Options(quick=args.quick, workdir=args.results_dir / "work"))
    print(json.dumps(report, indent=2))
    print("\n".join(markdown(report)))
    for j in report["jobs"]:
        print(f"{j['method']}: estimate / actual cost = {fmt(j['cost_ratio'], '.3f')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

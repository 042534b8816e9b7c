"""Estimate accuracy: what `POST /v1/fine_tuning/jobs/estimate` says a job will cost against what the job
then cost, on reference jobs on `tiny-chat`.

The references: a supervised job (32 chats of varied length, 2 epochs of batches of 4) and a DPO job (16
preference pairs, 2 epochs of batches of 4), each estimated and then run to the end through the gateway, a
worker and the trainer process on real PostgreSQL and Redis. The actual cost is the job's own
`cost.accrued` once it succeeded (its recorded training usage, priced by the price table); the ratio is
the estimate's expected cost over it (1.00: exact), with the trained tokens beside it (the estimate's against
the job's `trained_tokens`). Prices are the defaults (per trained token; no hourly price), so the cost ratio
is the token ratio. Reinforcement is not here: its cost hangs on the completions' lengths, which the estimate
can only bound.

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

from bench.common import RESULTS_DIR, Options, fmt, ratio
from bench.stack import Process, Services, bench_settings, make_tenant, start_gateway, start_worker

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
}


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


def _reference(client: Any, method: str, quick: bool) -> dict[str, Any]:
    ref = REFERENCES[method]
    rows = reference_rows(method, 8 if quick else ref["rows"])
    data = "\n".join(json.dumps(r) for r in rows).encode()
    training = client.files.create(file=(f"{method}.jsonl", data), purpose="fine-tune").id
    hp = {**ref["hyperparameters"], **({"n_epochs": 1} if quick else {})}
    body = {
        "model": "tiny-chat",
        "training_file": training,
        "method": {"type": method, method: {"hyperparameters": hp}},
    }
    estimate = client.post("/fine_tuning/jobs/estimate", body=body, cast_to=object)
    t0 = time.perf_counter()
    job = _wait(client, client.fine_tuning.jobs.create(**body).id)
    wall = time.perf_counter() - t0
    extra = job.model_extra or {}
    actual = float(extra["cost"]["accrued"])
    expected = float(estimate["cost"]["expected"])
    return {
        "method": method,
        "rows": len(rows),
        "hyperparameters": hp,
        "steps": estimate["steps"],
        "estimated_tokens": estimate["tokens"]["trained"]["expected"],
        "trained_tokens": job.trained_tokens,
        "estimated_usd": expected,
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
        settings = bench_settings(services, work / "data", upstreams=[], model_path=model)
        procs.append(start_gateway(settings, work / "gateway.log", None))
        procs.append(start_worker(settings, work / "worker.log"))
        url = f"http://127.0.0.1:{settings.port}"
        _, key = make_tenant(url, settings)
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        jobs = [_reference(client, method, opts.quick) for method in REFERENCES]
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()
    return {"jobs": jobs, "worst_cost_error": max(abs((j["cost_ratio"] or 0) - 1) for j in jobs)}


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        "Each reference job estimated (`POST /v1/fine_tuning/jobs/estimate`), then run to the end on "
        "tiny-chat (gateway, worker, trainer process; CPU); actual cost is the finished job's `cost.accrued` "
        "(default prices: per trained token).",
        "",
        "| job | rows x epochs, batch | steps | estimated tokens | trained tokens | estimated $ | actual $ "
        "| estimate / actual | estimated s | training s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for j in report["jobs"]:
        hp = j["hyperparameters"]
        lines.append(
            f"| {j['method']} | {j['rows']} x {hp['n_epochs']}, {hp['batch_size']} | {j['steps']} "
            f"| {j['estimated_tokens']:,.0f} | {j['trained_tokens'] or 0:,} | {j['estimated_usd']:.6f} "
            f"| {j['actual_usd']:.6f} | {fmt(j['cost_ratio'], '.3f')} | {j['estimated_seconds']:.1f} "
            f"| {fmt(j['training_seconds'], '.1f')} |"
        )
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
    parser.add_argument("--quick", action="store_true", help="8 rows, one epoch: checks that it runs")
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

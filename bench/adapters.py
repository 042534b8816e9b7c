"""Adapters on both engines side by side: the embedded engine (`python -m inference`) and vLLM (its CPU
build where that is what is installed), each started as `tunegate up` starts it, measured over HTTP in one
run on the same model (tiny-chat, float32) and the same adapters (rank 8 on every linear layer, random B).

- Throughput: `REQUESTS` chats of exactly `MAX_TOKENS` tokens (`ignore_eos`), `IN_FLIGHT` at a time, to the
  base model alone and spread over 1, 8, 32 and 128 distinct adapters, each count with uniform popularity
  (request `i` to adapter `i mod count`) and with Zipf popularity (adapter `k` drawn with weight
  `1/(k+1)^ZIPF_S`, one seeded draw shared by both engines). Both engines batch `MAX_LORAS` adapters, so 128
  means eviction and reloads on a miss (the embedded engine's loads in a round are counted; vLLM does not
  say).
- Cold adapter load: `POST /v1/load_lora_adapter` of an adapter the engine has never seen, until the first
  streamed token from it (the load call alone too); p50/p99 over several adapters.
- Job `succeeded` -> first streamed token of its `ft:` model: a gateway and a worker in front of each
  engine; a supervised job of a few steps, polled every 50 ms; the first token streamed through the gateway.

The machine is shared, so the engines take turns and never generate at once: every repetition of every row
runs on the embedded engine, then on vLLM, then the next (the same for cold loads and jobs), so a drift of
load hits both; the figures are medians, and each row's ratio embedded/vLLM is of medians. The CPU time an
engine spent while the other one was measured is reported (it should be about nothing). Where vLLM is not
installed, the embedded engine is measured alone and the report says why vLLM was left out.
"""

from __future__ import annotations

import asyncio
import logging
import random
import statistics
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from bench.common import Options, fmt, ratio, summary_ms
from bench.engines import (
    BASE,
    EngineStack,
    adapter_loads,
    cold_load,
    http_client,
    job_to_first_token,
    load_adapter,
    start_engine,
    start_front,
    throughput,
    upload_rows,
    vllm_label,
)
from inference.vllm import VllmUnavailable, find_vllm

logger = logging.getLogger(__name__)

REQUESTS, IN_FLIGHT, MAX_TOKENS = 128, 128, 16
"""Every request of a round in flight at once, so up to 128 distinct adapters are in flight together."""
ADAPTER_COUNTS = (1, 8, 32, 128)
POPULARITY = ("uniform", "zipf")
ZIPF_S = 1.1
MAX_LORAS = 32
"""`--max-loras` of both engines (`engine_max_loras`): the most distinct adapters in one round."""
RANK = 8
REPETITIONS = 2
COLD_LOADS = 8
JOBS, JOB_STEPS = 5, 2

QUICK = {
    "requests": 8,
    "in_flight": 4,
    "max_tokens": 4,
    "counts": (1, 4),
    "repetitions": 1,
    "cold": 2,
    "jobs": 1,
}
"""The smoke test's sizes; vLLM is left out (its start alone takes a minute or more on a busy machine)."""


def tiny_model(workdir: Path) -> Path:
    """tiny-chat in `workdir/tiny-chat` (made there when missing)."""
    from trainer.tiny import make_tiny_model

    return Path(make_tiny_model(workdir / "tiny-chat"))


def make_adapters(base_dir: Path, out_root: Path, count: int, rank: int = RANK) -> list[Path]:
    """`count` LoRA adapters of `rank` on every linear layer, each with random B matrices of its own (so each
    changes the outputs), made from one PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [out_root / f"lora{i}" for i in range(count)]
    if all((p / "adapter_config.json").exists() for p in paths):
        return paths
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear"),
    )
    for i, path in enumerate(paths):
        torch.manual_seed(1000 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.5)
        model.save_pretrained(str(path))
    return paths


def request_models(count: int, popularity: str, requests: int, seed: int = 0) -> list[str]:
    """The model of each request of a round over `count` adapters (`lora0`...): `uniform` takes them in
    turn, `zipf` draws adapter `k` with weight `1/(k+1)^ZIPF_S` (seeded: the same list on every engine and
    repetition); `count` 0 is the base model alone."""
    if count == 0:
        return [BASE] * requests
    if popularity == "uniform":
        return [f"lora{i % count}" for i in range(requests)]
    weights = [1.0 / (k + 1) ** ZIPF_S for k in range(count)]
    picks = random.Random(seed * 1000 + count).choices(range(count), weights=weights, k=requests)
    return [f"lora{k}" for k in picks]


def vllm_or_reason(opts: Options) -> tuple[bool, str]:
    """Whether vLLM is measured, and why not where it is not."""
    if opts.quick:
        return False, "quick mode leaves vLLM out (its start alone takes a minute or more on a busy machine)"
    try:
        find_vllm()
    except VllmUnavailable as exc:
        return False, str(exc)
    return True, ""


async def _in_turns(
    stacks: list[EngineStack],
    repetitions: int,
    measure: Callable[[EngineStack, int], Awaitable[Any]],
    idle_cpu: dict[str, float],
) -> dict[str, list[Any]]:
    """`measure(stack, repetition)` for every repetition, the stacks in turn within each; the CPU time the
    other engines spent meanwhile is added to `idle_cpu` (by kind)."""
    out: dict[str, list[Any]] = {s.kind: [] for s in stacks}
    for rep in range(repetitions):
        for stack in stacks:
            others = [s for s in stacks if s is not stack]
            before = [s.cpu_seconds() for s in others]
            out[stack.kind].append(await measure(stack, rep))
            for other, cpu in zip(others, before, strict=True):
                idle_cpu[other.kind] = idle_cpu.get(other.kind, 0.0) + other.cpu_seconds() - cpu
    return out


def _median_row(runs: list[dict[str, Any]]) -> dict[str, Any]:
    loads = [r["adapter_loads"] for r in runs]
    return {
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in runs),
        "runs_tokens_per_s": [r["tokens_per_s"] for r in runs],
        "tokens": sum(r["tokens"] for r in runs),
        "every_request_exact": all(r["every_request_exact"] for r in runs),
        "request_p50_s": statistics.median(r["request_p50_s"] for r in runs),
        "adapter_loads_per_round": None if None in loads else statistics.median(loads),
    }


async def _measure_engines(
    stacks: list[EngineStack], adapters: list[Path], sizes: dict[str, Any], idle_cpu: dict[str, float]
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    counts: tuple[int, ...] = sizes["counts"]
    async with http_client(sizes["in_flight"]) as http:
        for stack in stacks:  # the throughput rounds' adapters, loaded once on each engine
            for i in range(max(counts)):
                await load_adapter(http, stack.url, f"lora{i}", adapters[i])
        rows = []
        mixes = [(0, "uniform")] + [
            (count, popularity) for count in counts for popularity in POPULARITY[: 2 if count > 1 else 1]
        ]
        for count, popularity in mixes:
            models = request_models(count, popularity, sizes["requests"])

            async def round_of(stack: EngineStack, rep: int, models: list[str] = models) -> dict[str, Any]:
                before = await adapter_loads(http, stack.url)
                out = await throughput(
                    http,
                    stack.url,
                    models,
                    requests=sizes["requests"],
                    in_flight=sizes["in_flight"],
                    max_tokens=sizes["max_tokens"],
                )
                after = await adapter_loads(http, stack.url)
                out["adapter_loads"] = None if before is None or after is None else after - before
                return out

            warm = list(dict.fromkeys(models))[:MAX_LORAS]

            async def warm_up(stack: EngineStack, rep: int, warm: list[str] = warm) -> dict[str, Any]:
                # the mix's first adapters made resident (as many as fit), its first batches run
                return await throughput(
                    http, stack.url, warm, requests=len(warm), in_flight=len(warm), max_tokens=2
                )

            await _in_turns(stacks, 1, warm_up, idle_cpu)
            runs = await _in_turns(stacks, sizes["repetitions"], round_of, idle_cpu)
            row: dict[str, Any] = {
                "adapters": count,
                "popularity": popularity,
                "distinct": len(set(models)),
                **{k: _median_row(v) for k, v in runs.items()},
            }
            if "vllm" in row:
                row["embedded_vs_vllm"] = ratio(row["embedded"]["tokens_per_s"], row["vllm"]["tokens_per_s"])
            rows.append(row)
        cold_paths = adapters[max(counts) :]

        async def cold(stack: EngineStack, rep: int) -> dict[str, float]:
            return await cold_load(http, stack.url, f"cold{rep}", cold_paths[rep])

        colds = await _in_turns(stacks, len(cold_paths), cold, idle_cpu)
    cold_report: dict[str, Any] = {
        kind: {
            "load": summary_ms([r["load_s"] for r in runs]),
            "load_to_first_token": summary_ms([r["load_to_first_token_s"] for r in runs]),
        }
        for kind, runs in colds.items()
    }
    if "vllm" in cold_report:
        cold_report["embedded_vs_vllm_p50"] = ratio(
            cold_report["embedded"]["load_to_first_token"]["p50_ms"],
            cold_report["vllm"]["load_to_first_token"]["p50_ms"],
        )
    for row in rows:
        base = next(r for r in rows if r["adapters"] == 0)
        for kind in colds:
            row[kind]["vs_base"] = ratio(row[kind]["tokens_per_s"], base[kind]["tokens_per_s"])
    return rows, cold_report


async def _jobs(
    stacks: list[EngineStack], samples: int, steps: int, idle_cpu: dict[str, float]
) -> dict[str, Any]:
    files = {s.kind: await asyncio.to_thread(upload_rows, s) for s in stacks}

    async def job(stack: EngineStack, rep: int) -> dict[str, Any]:
        return await asyncio.to_thread(job_to_first_token, stack, files[stack.kind], steps)

    runs = await _in_turns(stacks, samples, job, idle_cpu)
    out: dict[str, Any] = {
        kind: {
            "success_to_first_token": summary_ms([r["success_to_first_token_s"] for r in v]),
            "samples_ms": [round(r["success_to_first_token_s"] * 1000, 1) for r in v],
            "job_s_median": statistics.median(r["job_s"] for r in v),
            "model": v[0]["model"],
        }
        for kind, v in runs.items()
    }
    if "vllm" in out:
        out["embedded_vs_vllm_p50"] = ratio(
            out["embedded"]["success_to_first_token"]["p50_ms"],
            out["vllm"]["success_to_first_token"]["p50_ms"],
        )
    out["steps"] = steps
    return out


def _goal(rows: list[dict[str, Any]], with_vllm: bool) -> dict[str, Any]:
    """The engine `tunegate up` picks here (`engine: auto`: vLLM where installed and able to run) against
    vLLM's rate, over every row: the goal is at least 1.0x."""
    try:
        picked = vllm_label(find_vllm())
        engine = "vllm"
    except VllmUnavailable:
        picked, engine = "the embedded engine", "embedded"
    if not with_vllm:
        return {"engine": engine, "picked": picked, "min_vs_vllm": None, "met": None}
    key = "vllm" if engine == "vllm" else "embedded"
    least = min(ratio(r[key]["tokens_per_s"], r["vllm"]["tokens_per_s"]) or 0.0 for r in rows)
    return {"engine": engine, "picked": picked, "min_vs_vllm": least, "met": least >= 1.0}


def run(opts: Options) -> dict[str, Any]:
    sizes: dict[str, Any] = (
        QUICK
        if opts.quick
        else {
            "requests": REQUESTS,
            "in_flight": IN_FLIGHT,
            "max_tokens": MAX_TOKENS,
            "counts": ADAPTER_COUNTS,
            "repetitions": REPETITIONS,
            "cold": COLD_LOADS,
            "jobs": JOBS,
        }
    )
    work = opts.workdir / "adapters"
    base = tiny_model(work)
    adapters = make_adapters(base, work / "loras", max(sizes["counts"]) + sizes["cold"])
    with_vllm, skipped = vllm_or_reason(opts)
    kinds = ["embedded", "vllm"] if with_vllm else ["embedded"]
    idle_cpu: dict[str, float] = {}
    stacks: list[EngineStack] = []
    try:
        for kind in kinds:  # started together (neither generates yet), waited for in turn
            stacks.append(start_engine(kind, base, work / kind, max_loras=MAX_LORAS))
        for stack in stacks:
            start_front(stack)
        rows, cold = asyncio.run(_measure_engines(stacks, adapters, sizes, idle_cpu))
        try:
            jobs = asyncio.run(_jobs(stacks, sizes["jobs"], JOB_STEPS, idle_cpu))
        except Exception as exc:  # the rows and cold loads measured so far are kept, the failure reported
            logger.exception("adapters bench: the jobs failed")
            jobs = {"error": f"{type(exc).__name__}: {exc}"[:1000]}
        engines = {s.kind: s.label for s in stacks}
    finally:
        for stack in stacks:
            stack.stop()
    return {
        "model": f"{BASE}, float32",
        "adapter_rank": RANK,
        "max_loras": MAX_LORAS,
        "requests": sizes["requests"],
        "in_flight": sizes["in_flight"],
        "max_tokens": sizes["max_tokens"],
        "repetitions": sizes["repetitions"],
        "zipf_s": ZIPF_S,
        "engines": engines,
        "vllm_skipped": skipped or None,
        "rows": rows,
        "cold_load": cold,
        "jobs": jobs,
        "idle_cpu_s": idle_cpu,
        "goal": _goal(rows, with_vllm),
    }


def _cell(row: dict[str, Any], kind: str) -> str:
    side = row.get(kind)
    return "-" if side is None else f"{side['tokens_per_s']:.0f} ({fmt(side['vs_base'])})"


def _loads(row: dict[str, Any]) -> str:
    side = row.get("embedded")
    loads = None if side is None else side.get("adapter_loads_per_round")
    return "-" if loads is None else f"{loads:.0f}"


def markdown(report: dict[str, Any]) -> list[str]:
    engines = report["engines"]
    lines = [
        f"{' and '.join(engines.values())}, each started as `tunegate up` starts it with `--max-loras "
        f"{report['max_loras']}`, on {report['model']}, adapters of rank {report['adapter_rank']} on every "
        f"linear layer. {report['requests']} chats of exactly {report['max_tokens']} tokens (`ignore_eos`), "
        f"{report['in_flight']} in flight, over HTTP to the engine, to the base model or spread over N "
        f"adapters with uniform or Zipf (s={report['zipf_s']}) popularity; the engines take turns (never "
        f"generating at once), {report['repetitions']} repetitions interleaved; medians.",
    ]
    if report["vllm_skipped"]:
        lines += ["", f"vLLM left out: {report['vllm_skipped']}."]
    lines += [
        "",
        "| adapters | popularity (distinct used) | embedded tok/s (vs base) | vLLM tok/s (vs base) "
        "| embedded / vLLM | embedded adapter loads a round | every request exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in report["rows"]:
        name = "base only" if row["adapters"] == 0 else str(row["adapters"])
        popularity = "-" if row["adapters"] == 0 else f"{row['popularity']} ({row['distinct']})"
        exact = all(row[k]["every_request_exact"] for k in engines)
        lines.append(
            f"| {name} | {popularity} | {_cell(row, 'embedded')} | {_cell(row, 'vllm')} "
            f"| {fmt(row.get('embedded_vs_vllm'))} | {_loads(row)} | {exact} |"
        )
    cold, jobs = report["cold_load"], report["jobs"]

    def pair(part: dict[str, Any], kind: str, key: str) -> str:
        side = part.get(kind)
        return "-" if side is None else f"{side[key]['p50_ms']:.0f} / {side[key]['p99_ms']:.0f}"

    timings = [
        ("cold adapter: the load call", cold, "load", None),
        ("cold adapter: load -> first token", cold, "load_to_first_token", cold.get("embedded_vs_vllm_p50")),
    ]
    if "error" not in jobs:
        timings.append(
            (
                "job `succeeded` -> first token of its `ft:` model, through the gateway",
                jobs,
                "success_to_first_token",
                jobs.get("embedded_vs_vllm_p50"),
            )
        )
    lines += ["", "| ms, p50 / p99 | n | embedded | vLLM | embedded / vLLM (p50) |", "|---|---|---|---|---|"]
    for name, part, key, part_ratio in timings:
        sides = " | ".join(pair(part, kind, key) for kind in ("embedded", "vllm"))
        lines.append(f"| {name} | {part['embedded'][key]['n']} | {sides} | {fmt(part_ratio)} |")
    if "error" in jobs:
        lines += ["", f"Jobs not measured: {jobs['error']}"]
    else:
        samples = "; ".join(
            f"{kind} {', '.join(f'{ms:.0f}' for ms in jobs[kind]['samples_ms'])}" for kind in engines
        )
        lines += ["", f"Job samples (ms, in turn): {samples}."]
    idle = ", ".join(f"{k} {v:.1f} s" for k, v in report["idle_cpu_s"].items())
    goal = report["goal"]
    lines += [""]
    if idle:
        lines.append(f"CPU time of an engine while the other was measured: {idle}.")
    if goal["met"] is None:
        lines.append(
            f"Goal (the engine `tunegate up` picks here, {goal['picked']}, at >= 1.0x vLLM): not measured."
        )
    else:
        lines.append(
            f"Goal: the engine `tunegate up` picks here ({goal['picked']}) serves at least 1.0x vLLM's rate: "
            f"{'met' if goal['met'] else 'NOT met'} (lowest row {goal['min_vs_vllm']:.2f}x)."
        )
    return lines

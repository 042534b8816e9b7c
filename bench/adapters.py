"""Adapters on the embedded engine (tiny-chat, CPU): cold adapter load time, first token of a freshly loaded
adapter, and generation throughput with 1, 8 and 32 distinct adapters in flight relative to the base model
alone (same requests, same lengths, same run).
"""

from __future__ import annotations

import asyncio
import logging
import time
from pathlib import Path
from typing import Any

from bench.common import Options, ratio, summary_ms

logger = logging.getLogger(__name__)


def tiny_model(workdir: Path) -> Path:
    from trainer.tiny import make_tiny_model

    return Path(make_tiny_model(workdir / "tiny-chat"))


def make_adapters(base_dir: Path, out_root: Path, count: int, rank: int = 8) -> list[Path]:
    """`count` LoRA adapters with random B matrices (each changes the outputs), made from one PEFT model."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    paths = [out_root / f"lora{i}" for i in range(count)]
    if all((p / "adapter_config.json").exists() for p in paths):
        return paths
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=["q_proj", "v_proj"]),
    )
    for i, path in enumerate(paths):
        torch.manual_seed(1000 + i)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.normal_(0.0, 0.5)
        model.save_pretrained(str(path))
    return paths


async def _generate(
    engine: Any, prompt: list[int], adapter: str | None, max_tokens: int, seed: int
) -> tuple[int, float]:
    """(tokens generated, seconds to the first token) of one request."""
    from inference.engine import GenerationRequest
    from inference.sampling import SamplingParams

    req = GenerationRequest(prompt_ids=list(prompt), params=SamplingParams(max_tokens=max_tokens, seed=seed))
    req.adapter = engine.resolve(adapter) if adapter else None
    t0 = time.perf_counter()
    first: float | None = None
    tokens = 0
    async for event in engine.submit(req).events():
        if event.token_ids and first is None:
            first = time.perf_counter() - t0
        tokens += len(event.token_ids)
    return tokens, first if first is not None else float("nan")


async def _throughput(
    engine: Any, prompt: list[int], names: list[str | None], n: int, max_tokens: int
) -> dict[str, Any]:
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(_generate(engine, prompt, names[i % len(names)], max_tokens, seed=i) for i in range(n))
    )
    elapsed = time.perf_counter() - t0
    tokens = sum(r[0] for r in results)
    return {
        "requests": n,
        "distinct_models": len(set(names)),
        "tokens": tokens,
        "seconds": elapsed,
        "tokens_per_s": tokens / elapsed,
        "ttft": summary_ms([r[1] for r in results]),
    }


async def _run(opts: Options) -> dict[str, Any]:
    from inference.engine import ModelEngine

    work = opts.workdir / "adapters"
    base = tiny_model(work)
    counts = [1, 4] if opts.quick else [1, 8, 32]
    paths = make_adapters(base, work / "loras", max(counts) + 1)
    n = 8 if opts.quick else 64
    max_tokens = 4 if opts.quick else 24
    engine = ModelEngine("tiny-chat", str(base), max_loras=max(counts) + 1, max_batch_size=32, device="cpu")
    engine.start()
    try:
        prompt: list[int] = list(engine.tokenizer.encode("user: Tell me about the sea.\nassistant:"))
        await _throughput(engine, prompt, [None], 4, 2)  # warm-up
        # a cold adapter: loaded from disk, then its first token
        t0 = time.perf_counter()
        await asyncio.to_thread(engine.load_adapter, "cold", str(paths[-1]))
        load_s = time.perf_counter() - t0
        _, first_token_s = await _generate(engine, prompt, "cold", 2, seed=0)
        base_first = (await _generate(engine, prompt, None, 2, seed=0))[1]
        loads = []
        for i, path in enumerate(paths[: max(counts)]):
            t0 = time.perf_counter()
            await asyncio.to_thread(engine.load_adapter, f"lora{i}", str(path))
            loads.append(time.perf_counter() - t0)
        await _throughput(engine, prompt, [None], n, max_tokens)  # warm the batched path at full size
        base_point = await _throughput(engine, prompt, [None], n, max_tokens)
        points = []
        for k in counts:
            point = await _throughput(engine, prompt, [f"lora{i}" for i in range(k)], n, max_tokens)
            point["vs_base"] = ratio(point["tokens_per_s"], base_point["tokens_per_s"])
            points.append(point)
    finally:
        await engine.stop()
    return {
        "engine": "embedded engine, tiny-chat, CPU, max_batch_size 32",
        "cold_load_s": load_s,
        "cold_first_token_ms": first_token_s * 1000,
        "base_first_token_ms": base_first * 1000,
        "load": summary_ms(loads),
        "base": base_point,
        "points": points,
    }


def run(opts: Options) -> dict[str, Any]:
    return asyncio.run(_run(opts))


def markdown(report: dict[str, Any]) -> list[str]:
    b = report["base"]
    lines = [
        f"{report['engine']}. Cold adapter load {report['cold_load_s'] * 1000:.1f} ms (loads of the rest: "
        f"p50 {report['load']['p50_ms']:.1f} ms); first token on it {report['cold_first_token_ms']:.1f} ms "
        f"vs {report['base_first_token_ms']:.1f} ms on the base model.",
        "",
        "| models in flight | requests | tokens/s | vs base | TTFT p50 ms |",
        "|---|---|---|---|---|",
        f"| base only | {b['requests']} | {b['tokens_per_s']:.0f} | 1.00 | {b['ttft']['p50_ms']:.1f} |",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['distinct_models']} adapters | {p['requests']} | {p['tokens_per_s']:.0f} "
            f"| {p['vs_base']:.2f} | {p['ttft']['p50_ms']:.1f} |"
        )
    return lines

"""The Tinker API's cost over the computation it serves, on `tiny-chat`, through the official `tinker` SDK.

Training: one step (`forward_backward` with cross-entropy, then `optim_step`, both submitted before either
result is awaited, as Tinker's own loops do) through a running stack (gateway, worker holding the model in a
`trainer.tinker_session` process, engine), against the same step computed in this process by the same
`trainer.tinker_session.Session` (PEFT, same rank, same data, the same number of threads) with no API around
it. Measured at two batch sizes; the in-process figure is taken before and after the API's (the mean of the
two), so a machine that changes speed meanwhile shows in the spread.

Sampling: generated tokens per second of the same requests (`num_samples` completions of one prompt,
several requests in flight) three ways: to the engine directly (`/v1/completions` with the prompt's token
ids), through the gateway's OpenAI route, and through the Tinker API (`SamplingClient.sample`, which goes
through that route). The base model and a saved sampler adapter (LoRA) both.
"""

from __future__ import annotations

import asyncio
import os
import random
import statistics
import time
from pathlib import Path
from typing import Any

import httpx

from bench.common import Options, fmt, free_port, ratio
from bench.stack import Process, Services, bench_settings, make_tenant, start_gateway, start_worker
from tunegate.role_processes import EngineProcess

RANK = 8
SEQ_LEN = 64
PROMPT = "What is 3 plus 4? Reply with the number only."


def _batch(size: int, vocab: int, seed: int) -> list[list[int]]:
    rnd = random.Random(seed)
    return [[rnd.randrange(10, vocab) for _ in range(SEQ_LEN + 1)] for _ in range(size)]


def _session_payload(batch: list[list[int]]) -> list[dict[str, Any]]:
    """The batch as the worker hands it to `trainer.tinker_session` (next-token targets, weights 1)."""
    return [{"tokens": t[:-1], "inputs": {"target_tokens": t[1:], "weights": [1.0] * SEQ_LEN}} for t in batch]


def _in_process(model: Path, batch: list[list[int]], steps: int, threads: int) -> list[float]:
    """Seconds per step of the bare computation: `Session.forward_backward` + `Session.optim_step`."""
    import torch

    from trainer.tinker_session import Session

    torch.set_num_threads(threads)
    session = Session({"base_path": str(model), "rank": RANK, "seed": 0})
    fb: dict[str, Any] = {"loss_fn": "cross_entropy", "loss_fn_config": None, "forward_only": False}
    fb["data"] = _session_payload(batch)
    optim = {"learning_rate": 1e-4, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
    times = []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        session.forward_backward(fb)
        session.optim_step(optim)
        if i:  # the first step warms up
            times.append(time.perf_counter() - t0)
    return times


def _through_api(training: Any, batch: list[list[int]], steps: int) -> tuple[list[float], list[float]]:
    """Seconds per step through the SDK, and the loss of each step."""
    from tinker import types

    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints(t[:-1]),
            loss_fn_inputs={"target_tokens": t[1:], "weights": [1.0] * SEQ_LEN},  # type: ignore[dict-item]
        )  # the SDK turns lists into its TensorData
        for t in batch
    ]
    adam = types.AdamParams(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-8)
    times, losses = [], []
    for i in range(steps + 1):
        t0 = time.perf_counter()
        fb = training.forward_backward(data, "cross_entropy")
        step = training.optim_step(adam)
        out = fb.result()
        step.result()
        if i:
            times.append(time.perf_counter() - t0)
            losses.append(out.metrics["loss:sum"])
    return times, losses


async def _engine_rate(
    url: str, headers: dict[str, str], model: str, prompt: list[int], n: int, max_tokens: int, requests: int
) -> float:
    """Generated tokens per second of `requests` completions requests (all in flight at once)."""
    body = {"model": model, "prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": 1.0}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=300, trust_env=False) as http:

        async def one() -> int:
            resp = await http.post("/v1/completions", json=body)
            resp.raise_for_status()
            return int(resp.json()["usage"]["completion_tokens"])

        t0 = time.perf_counter()
        counts = await asyncio.gather(*(one() for _ in range(requests)))
        return sum(counts) / (time.perf_counter() - t0)


def _tinker_rate(sampler: Any, prompt: list[int], n: int, max_tokens: int, requests: int) -> float:
    from tinker import types

    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0)
    model_input = types.ModelInput.from_ints(prompt)
    t0 = time.perf_counter()
    futures = [sampler.sample(model_input, num_samples=n, sampling_params=params) for _ in range(requests)]
    tokens = sum(len(s.tokens) for f in futures for s in f.result().sequences)
    return tokens / (time.perf_counter() - t0)


def _sampling(
    engine_url: str, gateway_url: str, key: str, served: str, sampler: Any, prompt: list[int], opts: Options
) -> dict[str, Any]:
    n, max_tokens, requests = (2, 8, 2) if opts.quick else (8, 48, 8)
    auth = {"Authorization": f"Bearer {key}"}
    rates: dict[str, list[float]] = {"engine": [], "gateway": [], "tinker": []}
    # the adapter loaded, paths warm; the engine knows it by its version, which the answer names
    warm = httpx.post(
        f"{gateway_url}/v1/completions",
        json={"model": served, "prompt": prompt, "max_tokens": 1},
        headers=auth,
        timeout=300,
        trust_env=False,
    )
    warm.raise_for_status()
    version = warm.json()["system_fingerprint"]
    _tinker_rate(sampler, prompt, 1, 1, 1)
    for _ in range(1 if opts.quick else 3):  # alternate, so that drift hits all three
        rates["engine"].append(
            asyncio.run(_engine_rate(engine_url, {}, version, prompt, n, max_tokens, requests))
        )
        rates["gateway"].append(
            asyncio.run(_engine_rate(gateway_url, auth, served, prompt, n, max_tokens, requests))
        )
        rates["tinker"].append(_tinker_rate(sampler, prompt, n, max_tokens, requests))
    mean = {k: statistics.fmean(v) for k, v in rates.items()}
    return {
        "num_samples": n,
        "max_tokens": max_tokens,
        "requests_in_flight": requests,
        "tokens_per_s": mean,
        "tinker_vs_engine": ratio(mean["tinker"], mean["engine"]),
        "gateway_vs_engine": ratio(mean["gateway"], mean["engine"]),
    }


def run(opts: Options) -> dict[str, Any]:
    import tinker
    from transformers import AutoTokenizer

    from trainer.tiny import make_tiny_model

    model = Path(make_tiny_model(str(opts.workdir / "tiny-chat")))
    tokenizer = AutoTokenizer.from_pretrained(str(model))
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )
    prompt = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    vocab = int(tokenizer.vocab_size)
    sizes = (2, 8) if opts.quick else (4, 32)
    steps = 2 if opts.quick else 8
    threads = len(os.sched_getaffinity(0))
    work = opts.workdir / "tinker"
    services = Services.start(work, redis=True)
    procs: list[Process] = []
    result: dict[str, Any] = {"rank": RANK, "seq_len": SEQ_LEN, "steps": steps, "threads": threads}
    try:
        before = {size: _in_process(model, _batch(size, vocab, size), steps, threads) for size in sizes}
        engine = EngineProcess({"tiny-chat": model}, free_port(), work / "engine.log").wait_ready(120)
        procs.append(engine)
        settings = bench_settings(
            services, work / "data", upstreams=[engine.url], model_path=model, tinker_idle_timeout_s=600.0
        )
        procs.append(start_gateway(settings, work / "gateway.log", None))
        procs.append(start_worker(settings, work / "worker.log", TUNEGATE_TRAINING_SLOTS="1"))
        url = f"http://127.0.0.1:{settings.port}"
        _, key = make_tenant(url, settings)
        service = tinker.ServiceClient(base_url=url, api_key="tml-" + key)
        training = service.create_lora_training_client(base_model="tiny-chat", rank=RANK, seed=0).result()
        api = {size: _through_api(training, _batch(size, vocab, size), steps) for size in sizes}
        sampler = training.save_weights_and_get_sampling_client().result()
        served = _served_model(url, key)
        base_sampler = service.create_sampling_client(base_model="tiny-chat").result()
        result["sampling"] = {
            "base": _sampling(engine.url, url, key, "tiny-chat", base_sampler, prompt, opts),
            "adapter": _sampling(engine.url, url, key, served, sampler, prompt, opts),
        }
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()
    after = {size: _in_process(model, _batch(size, vocab, size), steps, threads) for size in sizes}
    result["training"] = []
    for size in sizes:
        local = statistics.median(before[size]) / 2 + statistics.median(after[size]) / 2
        through, losses = api[size]
        result["training"].append(
            {
                "batch": size,
                "tokens": size * SEQ_LEN,
                "in_process_ms": local * 1000,
                "in_process_spread_ms": abs(statistics.median(before[size]) - statistics.median(after[size]))
                * 1000,
                "api_ms": statistics.median(through) * 1000,
                "overhead_ratio": ratio(statistics.median(through), local),
                "loss_first_last": [losses[0], losses[-1]],
            }
        )
    return result


def _served_model(url: str, key: str) -> str:
    """The OpenAI model id of the newest sampler checkpoint (`ft:` id), as `/v1/models` lists it."""
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, trust_env=False) as http:
        models = http.get("/v1/models").json()["data"]
    tuned = [m for m in models if m["id"].startswith("ft:")]
    if not tuned:
        raise RuntimeError(f"no sampler checkpoint among the models: {[m['id'] for m in models]}")
    return max(tuned, key=lambda m: m["created"])["id"]


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        f"tiny-chat, LoRA rank {report['rank']}, {report['seq_len']} tokens a sequence, median of "
        f"{report['steps']} steps after one to warm up; {report['threads']} threads both ways. A step is "
        "`forward_backward` (cross-entropy) + `optim_step`, submitted together and then awaited, through the "
        "official SDK against a running stack; in process, the same `Session` code with no API around it.",
        "",
        "| batch (sequences) | tokens | in process ms (spread) | through the API ms | API / in process |",
        "|---|---|---|---|---|",
    ]
    for row in report["training"]:
        lines.append(
            f"| {row['batch']} | {row['tokens']} | {row['in_process_ms']:.1f} "
            f"({row['in_process_spread_ms']:.1f}) | {row['api_ms']:.1f} | {fmt(row['overhead_ratio'])}x |"
        )
    lines += [
        "",
        "Sampling: generated tokens per second of the same requests, all in flight at once, to the engine "
        "directly, through the gateway's `/v1/completions`, and through the Tinker API's `sample`.",
        "",
        "| model | samples x max tokens x requests | engine tok/s | gateway tok/s | Tinker API tok/s | "
        "Tinker / engine |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in report["sampling"].items():
        rate = row["tokens_per_s"]
        lines.append(
            f"| {name} | {row['num_samples']} x {row['max_tokens']} x {row['requests_in_flight']} | "
            f"{rate['engine']:.0f} | {rate['gateway']:.0f} | {rate['tinker']:.0f} | "
            f"{fmt(row['tinker_vs_engine'])}x |"
        )
    return lines

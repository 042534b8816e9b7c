"""The two serving engines side by side, each in a small stack of its own, for `bench.adapters`.

`EngineStack`: an engine started as `tunegate up` starts it (`tunegate.vllm_process.engine_processes` with
`engine` set to `embedded` or `vllm`), a gateway and a worker in front of it, on a database of their own;
the bench speaks to the engine over HTTP directly and to the gateway through the official `openai` client.
The calls here (a round of chat requests, a cold adapter load, a job to its first token) time one engine
at a time; `bench.adapters` takes them in turns.
"""

from __future__ import annotations

import asyncio
import json
import logging
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.common import tree_cpu_seconds
from bench.stack import Process, Services, bench_settings, make_tenant, start_gateway, start_worker
from gateway.settings import Settings
from inference.vllm import VllmInstall
from tunegate.processes import free_port
from tunegate.role_processes import EngineProcess
from tunegate.vllm_process import VllmEngineProcess, engine_processes

logger = logging.getLogger(__name__)

BASE = "tiny-chat"

JOB_ROWS: list[dict[str, Any]] = [
    {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
    for i in range(4)
]
"""Four short supervised rows: the job's training is not what is measured."""


def prompt(i: int) -> list[dict[str, str]]:
    """The chat of request `i`: each request its own text, so no engine serves one from a prefix cache."""
    return [{"role": "user", "content": f"Tell me a story about the number {i}."}]


@dataclass
class EngineStack:
    """One engine, with a gateway and a worker in front of it (see the module)."""

    kind: str
    """`embedded` or `vllm`."""
    services: Services
    settings: Settings
    engine: EngineProcess | VllmEngineProcess
    procs: list[Process] = field(default_factory=list)
    """The gateway and the worker, stopped before the engine."""
    gateway_url: str = ""
    api_key: str = ""

    @property
    def url(self) -> str:
        """The engine's base URL."""
        return self.engine.url

    @property
    def label(self) -> str:
        if isinstance(self.engine, VllmEngineProcess):
            return vllm_label(self.engine.install)
        return "embedded engine"

    def cpu_seconds(self) -> float:
        """CPU time so far of the engine's processes (vLLM's engine core and worker included)."""
        return tree_cpu_seconds(self.engine.pid)

    def stop(self) -> None:
        for proc in reversed(self.procs):
            proc.stop()
        self.engine.stop()
        self.services.stop()


def start_engine(kind: str, model: Path, workdir: Path, *, max_loras: int) -> EngineStack:
    """The engine of `kind` serving `model` as `tiny-chat`, started (not waited for) as `tunegate up` starts
    it, with `max_loras` adapters a batch; its database made for the gateway and worker to come."""
    workdir.mkdir(parents=True, exist_ok=True)
    services = Services.start(workdir, redis=True)
    try:
        settings = bench_settings(
            services,
            workdir / "data",
            upstreams=[],
            model_path=model,
            engine=kind,
            engine_port=free_port(),
            engine_max_loras=max_loras,
        )
        choice = engine_processes(settings, {BASE: str(model)}, log_dir=workdir, die_with_parent=True)
    except BaseException:
        services.stop()
        raise
    assert choice.engine == kind, choice.reason
    settings.base_models[BASE].upstreams = [choice.served_by[BASE]]
    return EngineStack(kind, services, settings, choice.processes[0])


def start_front(stack: EngineStack) -> None:
    """Wait for the engine of `stack`, then start its gateway and worker and make a tenant."""
    try:
        stack.engine.wait_ready()
        stack.procs.append(start_gateway(stack.settings, stack.settings.data_dir / "gateway.log", None))
        stack.procs.append(start_worker(stack.settings, stack.settings.data_dir / "worker.log"))
        stack.gateway_url = f"http://127.0.0.1:{stack.settings.port}"
        _, stack.api_key = make_tenant(stack.gateway_url, stack.settings)
    except BaseException:
        stack.stop()
        raise


def http_client(in_flight: int) -> httpx.AsyncClient:
    # Idle connections are let go well before the engines' HTTP servers close them (uvicorn's keep-alive,
    # 5 s): reusing one the server is closing at that moment fails the request with a ReadError (the engines
    # take turns, so one engine's connections sit idle for the other's whole turn).
    limits = httpx.Limits(
        max_connections=in_flight, max_keepalive_connections=in_flight, keepalive_expiry=2.0
    )
    return httpx.AsyncClient(timeout=600, limits=limits, trust_env=False)


def chat_body(model: str, i: int, max_tokens: int, *, stream: bool = False) -> dict[str, Any]:
    """A greedy chat of exactly `max_tokens` tokens (`ignore_eos`: both engines go on past an end token)."""
    return {
        "model": model,
        "messages": prompt(i),
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,
        "stream": stream,
    }


async def load_adapter(http: httpx.AsyncClient, url: str, name: str, path: Path) -> None:
    resp = await http.post(f"{url}/v1/load_lora_adapter", json={"lora_name": name, "lora_path": str(path)})
    if resp.status_code != 200:
        raise RuntimeError(f"loading {name} on {url}: {resp.status_code} {resp.text[:300]}")


async def unload_adapter(http: httpx.AsyncClient, url: str, name: str) -> None:
    resp = await http.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": name})
    if resp.status_code != 200:
        raise RuntimeError(f"unloading {name} on {url}: {resp.status_code} {resp.text[:300]}")


async def adapter_loads(http: httpx.AsyncClient, url: str) -> int | None:
    """Adapters the engine at `url` has loaded into its model so far (reloads after an eviction too), from
    the embedded engine's `/v1/engine/stats`; None where the engine does not say (vLLM)."""
    resp = await http.get(f"{url}/v1/engine/stats")
    if resp.status_code != 200:
        return None
    return sum(int(m.get("adapter_loads", 0)) for m in resp.json()["models"].values())


async def throughput(
    http: httpx.AsyncClient, url: str, models: list[str], *, requests: int, in_flight: int, max_tokens: int
) -> dict[str, Any]:
    """`requests` chats, request `i` to `models[i % len(models)]`, `in_flight` at a time: tokens/s over the
    whole round (completion tokens as the engine counts them in `usage`)."""
    gate = asyncio.Semaphore(in_flight)

    async def one(i: int) -> tuple[int, float]:
        async with gate:
            t0 = time.perf_counter()
            resp = await http.post(
                f"{url}/v1/chat/completions", json=chat_body(models[i % len(models)], i, max_tokens)
            )
            if resp.status_code != 200:
                raise RuntimeError(f"chat on {url}: {resp.status_code} {resp.text[:300]}")
            return int(resp.json()["usage"]["completion_tokens"]), time.perf_counter() - t0

    t0 = time.perf_counter()
    done = await asyncio.gather(*(one(i) for i in range(requests)))
    seconds = time.perf_counter() - t0
    tokens = sum(n for n, _ in done)
    return {
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "every_request_exact": all(n == max_tokens for n, _ in done),
        "request_p50_s": statistics.median(s for _, s in done),
    }


async def first_token(
    http: httpx.AsyncClient, url: str, model: str, *, headers: dict[str, str] | None = None
) -> float:
    """Seconds until the first streamed content of a chat with `model` (at `url`, an engine or a gateway)."""
    t0 = time.perf_counter()
    body = chat_body(model, 0, 4, stream=True)
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body, headers=headers) as resp:
        if resp.status_code != 200:
            await resp.aread()
            raise RuntimeError(f"stream of {model} on {url}: {resp.status_code} {resp.text[:300]}")
        async for line in resp.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream of {model} on {url}: {chunk['error']}")
            if any(c.get("delta", {}).get("content") for c in chunk.get("choices", [])):
                return time.perf_counter() - t0
    raise RuntimeError(f"stream of {model} on {url} ended without content")


async def cold_load(http: httpx.AsyncClient, url: str, name: str, path: Path) -> dict[str, float]:
    """Load adapter `name` (not known to the engine), then stream from it: the seconds of the load call and
    from the load's start to the first token; the adapter is unloaded again after."""
    t0 = time.perf_counter()
    await load_adapter(http, url, name, path)
    load_s = time.perf_counter() - t0
    first_s = await first_token(http, url, name)
    total = load_s + first_s
    await unload_adapter(http, url, name)
    return {"load_s": load_s, "load_to_first_token_s": total}


def job_to_first_token(stack: EngineStack, training_file: str, steps: int) -> dict[str, Any]:
    """A supervised job of `steps` steps through the stack's gateway, polled every 50 ms; then the first
    streamed token of its `ft:` model through the gateway, timed from the moment `succeeded` was seen."""
    import openai

    client = openai.OpenAI(
        base_url=stack.gateway_url + "/v1", api_key=stack.api_key, max_retries=0, timeout=120
    )
    try:
        method: Any = {
            "type": "supervised",
            "supervised": {"hyperparameters": {"n_epochs": 10, "batch_size": 1, "max_steps": steps}},
        }
        messages: Any = prompt(0)
        t0 = time.perf_counter()
        job = client.fine_tuning.jobs.create(model=BASE, training_file=training_file, method=method)
        while job.status not in ("succeeded", "failed", "cancelled"):
            time.sleep(0.05)
            job = client.fine_tuning.jobs.retrieve(job.id)
        succeeded_at = time.perf_counter()
        if job.status != "succeeded" or not job.fine_tuned_model:
            raise RuntimeError(f"job {job.id} on the {stack.kind} stack ended {job.status}: {job.error}")
        stream = client.chat.completions.create(
            model=job.fine_tuned_model,
            messages=messages,
            max_tokens=4,
            stream=True,
        )
        first_s: float | None = None
        for chunk in stream:
            if first_s is None and chunk.choices and chunk.choices[0].delta.content:
                first_s = time.perf_counter() - succeeded_at
        if first_s is None:
            raise RuntimeError(f"{job.fine_tuned_model} streamed no content")
        return {
            "job_s": succeeded_at - t0,
            "success_to_first_token_s": first_s,
            "model": job.fine_tuned_model,
        }
    finally:
        client.close()


def upload_rows(stack: EngineStack) -> str:
    """The job rows as a `fine-tune` file of the stack's tenant; its id."""
    import openai

    data = "".join(json.dumps(row) + "\n" for row in JOB_ROWS).encode()
    with openai.OpenAI(base_url=stack.gateway_url + "/v1", api_key=stack.api_key, max_retries=0) as client:
        return client.files.create(file=("rows.jsonl", data), purpose="fine-tune").id


def vllm_label(install: VllmInstall) -> str:
    return f"vLLM {install.version} ({'CPU' if install.on_cpu else 'CUDA'} build)"

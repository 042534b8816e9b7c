"""Stalls: one tenant's chat latency while another tenant sends the worst inputs, against its idle latency
in the same run.

A real stack: PostgreSQL and Redis, `python -m tunegate gateway` and the embedded engine serving tiny-chat
(`python -m inference`), both as processes of their own. Tenant B runs a closed loop of short chat
completions (`B_CLIENTS` clients) through the gateway the whole time. The run alternates slices: idle (B
alone) and attacked (tenant A sends, from `A_THREADS` threads, what once froze every tenant: python grader
sources of 4 MB and 1 MB, a 200 KiB one the gateway must parse, megabyte `text_similarity` strings in the
sample and in the item, prompts of 10 MB and 1 MB, and, where a sandbox works, `environments/run` calls
whose environment sleeps, from `A_RUNNERS` more threads that try again `RETRY_S` after a 429: a flood of
refusals is rate limiting's business, not this bench's). Slices take turns, so a slow spell of a shared
machine falls on both sides alike; A's calls still in flight at the end of an attacked slice are waited
for before the next idle one. Reported: B's p50 and p99 of each side and their ratio (the goal: p99
within 2x), B's failures, a file upload and a model list of B's in every attacked slice, and A's answers
by status. A runs in a process of its own, below the others' priority (`ATTACKER_NICENESS`), so its own
client work never slows B's clients or the servers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import multiprocessing
import os
import secrets
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from bench.common import Options, fmt, free_port, ratio, summary_ms
from bench.stack import Process, Services, bench_settings, make_tenant, start_gateway
from inference.options import EngineOptions
from tunegate.role_processes import EngineProcess

logger = logging.getLogger(__name__)

MB = 1024 * 1024
B_CLIENTS = 4
A_THREADS = 6
A_RUNNERS = 12
RETRY_S = 0.1
ATTACKER_NICENESS = 10
"""A's client process runs below everything else: on a small machine its own sending and reading would
otherwise take the CPU the gateway and the engine serve B with, which a remote client would not."""
GOAL = 2.0
"""B's attacked p99 over its idle p99 that the gateway aims to stay within."""
GRADE = "def grade(sample, item):\n    return 1.0\n"
QUESTION = {"role": "user", "content": "What is 2 + 2?"}
CHAT = {"model": "tiny-chat", "messages": [QUESTION], "max_tokens": 4}
SLEEPY = """import time

from envsdk import SingleTurnEnv


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        time.sleep(2)
        return 1.0
"""


def _similarity(reference: str) -> dict[str, Any]:
    return {
        "type": "text_similarity",
        "input": "{{ sample.output_text }}",
        "reference": reference,
        "evaluation_metric": "rouge_l",
    }


def worst_inputs() -> dict[str, tuple[str, bytes]]:
    """A's requests by name: (path, JSON body), made once."""
    text = "lorem ipsum " * (MB // 12)
    inputs: dict[str, dict[str, Any]] = {
        "python_source_4mb": {
            "path": "/v1/fine_tuning/alpha/graders/run",
            "body": {
                "grader": {"type": "python", "source": GRADE + "x = 1\n" * (4 * MB // 6)},
                "model_sample": "4",
            },
        },
        "python_source_1mb": {
            "path": "/v1/fine_tuning/alpha/graders/run",
            "body": {
                "grader": {"type": "python", "source": GRADE + "x = 1\n" * (MB // 6)},
                "model_sample": "4",
            },
        },
        "python_source_200k": {
            "path": "/v1/fine_tuning/alpha/graders/validate",
            "body": {"grader": {"type": "python", "source": "x = 1\n" * (200 * 1024 // 6) + GRADE}},
        },
        "similarity_sample_1mb": {
            "path": "/v1/fine_tuning/alpha/graders/run",
            "body": {"grader": _similarity("lorem"), "model_sample": text},
        },
        "similarity_item_1mb": {
            "path": "/v1/fine_tuning/alpha/graders/run",
            "body": {"grader": _similarity("{{ item.ref }}"), "model_sample": "lorem", "item": {"ref": text}},
        },
        "prompt_10mb": {
            "path": "/v1/chat/completions",
            "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": text * 10}]},
        },
        "prompt_1mb": {
            "path": "/v1/chat/completions",
            "body": {"model": "tiny-chat", "messages": [{"role": "user", "content": text}]},
        },
    }
    return {name: (v["path"], json.dumps(v["body"]).encode()) for name, v in inputs.items()}


def _sandbox() -> str | None:
    from envsdk.sandbox import probe_backend

    return next((name for name in ("bwrap", "unshare") if probe_backend(name)), None)


def _upload_sleepy(http: httpx.Client, workdir: Path) -> str:
    from envsdk.archive import pack

    src = workdir / "sleepy"
    src.mkdir(parents=True, exist_ok=True)
    (src / "environment.toml").write_text(
        'name = "sleepy"\nversion = "0.1.0"\nentrypoint = "env:Env"\n\n[limits]\ntimeout_s = 30\n'
    )
    (src / "env.py").write_text(SLEEPY)
    archive, _ = pack(src, workdir / "sleepy.tar.gz")
    resp = http.post(
        "/v1/files",
        files={"file": (archive.name, archive.read_bytes())},
        data={"purpose": "environment"},
    )
    resp.raise_for_status()
    return str(resp.json()["id"])


_INPUTS: dict[str, tuple[str, bytes]] = {}
"""`worst_inputs()`, made once in the attacker's process."""


def _send(url: str, key: str, jobs: list[tuple[str, str, bytes]], until: float, each: bool) -> Counter[str]:
    """One of A's threads: `jobs` in turn, back to back, until `until` (and, with `each`, each at least once:
    a slow machine still sends every worst input); its answers by input and status."""
    answers: Counter[str] = Counter()
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=120, trust_env=False) as http:
        i = 0
        while time.monotonic() < until or (each and i < len(jobs)):
            name, path, body = jobs[i % len(jobs)]
            i += 1
            try:
                status = str(http.post(path, content=body).status_code)
            except httpx.HTTPError as exc:
                status = type(exc).__name__
            answers[f"{name} {status}"] += 1
            if status == "429":
                time.sleep(RETRY_S)
    return answers


def attack(url: str, key: str, env_run: bytes | None, seconds: float) -> dict[str, int]:
    """Tenant A for `seconds` (in a process of its own, so its work never slows B's clients): `A_THREADS`
    threads send the worst inputs, `A_RUNNERS` more the sleeping environment runs; returns once the calls in
    flight are answered."""
    if not _INPUTS:
        _INPUTS.update(worst_inputs())
    jobs = [(name, path, body) for name, (path, body) in _INPUTS.items()]
    loops = [jobs[i:] + jobs[:i] for i in range(A_THREADS)]
    if env_run is not None:
        loops += [
            [("environment_run_sleeping", "/v1/fine_tuning/alpha/environments/run", env_run)]
        ] * A_RUNNERS
    until = time.monotonic() + seconds
    total: Counter[str] = Counter()
    with ThreadPoolExecutor(max_workers=len(loops)) as pool:
        sent = pool.map(lambda jobs_of_thread: _send(url, key, jobs_of_thread, until, seconds > 0), loops)
        for answers in sent:
            total.update(answers)
    return dict(total)


async def _b_clients(url: str, key: str, seconds: float) -> tuple[list[float], int]:
    """B's closed-loop chats for `seconds`: latencies of the successes, and the failures."""
    latencies: list[float] = []
    failures = 0
    body = json.dumps(CHAT).encode()
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=60, trust_env=False) as http:
        deadline = time.perf_counter() + seconds

        async def client() -> None:
            nonlocal failures
            while time.perf_counter() < deadline:
                t0 = time.perf_counter()
                try:
                    ok = (await http.post("/v1/chat/completions", content=body)).status_code == 200
                except httpx.HTTPError:
                    ok = False
                if ok:
                    latencies.append(time.perf_counter() - t0)
                else:
                    failures += 1

        await asyncio.gather(*(client() for _ in range(B_CLIENTS)))
    return latencies, failures


def _b_other(url: str, key: str) -> tuple[bool, bool]:
    """One file upload and one model list of B's: whether each succeeded."""
    row = {"messages": [QUESTION, {"role": "assistant", "content": "4"}]}
    with httpx.Client(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60, trust_env=False
    ) as http:
        upload = http.post(
            "/v1/files", files={"file": ("b.jsonl", json.dumps(row).encode())}, data={"purpose": "fine-tune"}
        )
        models = http.get("/v1/models")
    return upload.status_code == 200, models.status_code == 200 and "tiny-chat" in models.text


def _measure(
    url: str, b_key: str, a_key: str, env_run: bytes | None, rounds: int, slice_s: float
) -> dict[str, Any]:
    idle: list[float] = []
    attacked: list[float] = []
    failures = {"idle": 0, "attacked": 0}
    other = Counter[str]()
    answers = Counter[str]()
    spawn = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(
        max_workers=1, mp_context=spawn, initializer=os.nice, initargs=(ATTACKER_NICENESS,)
    ) as attacker:
        attacker.submit(attack, url, a_key, None, 0.0).result()  # the process started, its inputs made
        asyncio.run(_b_clients(url, b_key, min(1.0, slice_s)))  # warm-up: connections, the engine's batches
        for _ in range(rounds):
            latencies, failed = asyncio.run(_b_clients(url, b_key, slice_s))
            idle += latencies
            failures["idle"] += failed
            attacking = attacker.submit(attack, url, a_key, env_run, slice_s)
            time.sleep(min(0.2, slice_s / 10))  # A's first requests are in flight
            latencies, failed = asyncio.run(_b_clients(url, b_key, slice_s))
            uploaded, listed = _b_other(url, b_key)
            other["uploads_ok" if uploaded else "uploads_failed"] += 1
            other["model_lists_ok" if listed else "model_lists_failed"] += 1
            answers.update(attacking.result())
            attacked += latencies
            failures["attacked"] += failed
    idle_ms, attacked_ms = summary_ms(idle), summary_ms(attacked)
    return {
        "idle": {**idle_ms, "failures": failures["idle"]},
        "attacked": {**attacked_ms, "failures": failures["attacked"]},
        "p99_ratio": ratio(attacked_ms["p99_ms"], idle_ms["p99_ms"]),
        "p50_ratio": ratio(attacked_ms["p50_ms"], idle_ms["p50_ms"]),
        "b_other": dict(other),
        "a_answers": dict(sorted(answers.items())),
    }


def run(opts: Options) -> dict[str, Any]:
    from bench.adapters import tiny_model

    work = opts.workdir / "stalls"
    work.mkdir(parents=True, exist_ok=True)
    rounds = 2 if opts.quick else 4
    slice_s = 1.5 if opts.quick else 6.0
    model = tiny_model(work)
    services = Services.start(work, redis=True)
    procs: list[Process] = []
    try:
        engine = EngineProcess(
            {"tiny-chat": model},
            free_port(),
            work / "engine.log",
            options=EngineOptions(device="cpu"),
            log_level="warning",
        )
        procs.append(engine)
        engine.wait_ready(120)
        settings = bench_settings(services, work / "data", upstreams=[engine.url], model_path=model)
        procs.append(start_gateway(settings, work / "gateway.log", None))
        url = f"http://127.0.0.1:{settings.port}"
        _, a_key = make_tenant(url, settings)
        _, b_key = make_tenant(url, settings)
        backend = _sandbox()
        env_run = None
        if backend is not None:
            with httpx.Client(
                base_url=url, headers={"Authorization": f"Bearer {a_key}"}, timeout=120, trust_env=False
            ) as http:
                file_id = _upload_sleepy(http, work / f"pkg-{secrets.token_hex(3)}")
            run_body = {"file_id": file_id, "task": {"messages": [QUESTION]}, "completion": "4"}
            env_run = json.dumps(run_body).encode()
        result = _measure(url, b_key, a_key, env_run, rounds, slice_s)
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()
    return {
        "sandbox_backend": backend,
        "rounds": rounds,
        "slice_s": slice_s,
        "b_clients": B_CLIENTS,
        "a_threads": A_THREADS + (A_RUNNERS if env_run is not None else 0),
        "goal": GOAL,
        **result,
    }


def _answers_line(answers: dict[str, int]) -> str:
    by_input: dict[str, list[str]] = {}
    for key, count in answers.items():
        name, _, status = key.rpartition(" ")
        by_input.setdefault(name, []).append(f"{count}x {status}")
    return "; ".join(f"`{name}` {', '.join(parts)}" for name, parts in by_input.items())


def markdown(report: dict[str, Any]) -> list[str]:
    idle, attacked = report["idle"], report["attacked"]
    ratio_p99 = report["p99_ratio"]
    verdict = "within" if ratio_p99 is not None and ratio_p99 <= report["goal"] else "over"
    other = report["b_other"]
    backend = report["sandbox_backend"] or "none, so no environment runs"
    slices = f"{report['rounds']} idle and {report['rounds']} attacked slices of {report['slice_s']} s"
    return [
        f"Tenant B: {report['b_clients']} clients of short chat completions (tiny-chat, 4 tokens) through "
        f"the gateway; {slices} taken in turn. Tenant A, in the attacked slices, from {report['a_threads']} "
        f"threads of its own process: the worst inputs back to back (sandbox backend: {backend}).",
        "",
        "| B's chats | requests | p50 ms | p99 ms | failures |",
        "|---|---|---|---|---|",
        f"| idle | {idle['n']} | {fmt(idle['p50_ms'])} | {fmt(idle['p99_ms'])} | {idle['failures']} |",
        f"| while A attacks | {attacked['n']} | {fmt(attacked['p50_ms'])} | {fmt(attacked['p99_ms'])} "
        f"| {attacked['failures']} |",
        "",
        f"B's p99 while attacked over idle: **{fmt(ratio_p99)}x** ({verdict} the goal of "
        f"{report['goal']:.0f}x; p50 {fmt(report['p50_ratio'])}x). B's uploads while attacked: "
        f"{other.get('uploads_ok', 0)} ok, {other.get('uploads_failed', 0)} failed; model lists: "
        f"{other.get('model_lists_ok', 0)} ok, {other.get('model_lists_failed', 0)} failed.",
        "",
        f"A's answers: {_answers_line(report['a_answers'])}.",
    ]

"""Adapters under churn, on both engines (the embedded engine as a supervised process, and the session's
vLLM), each behind a gateway of its own and called through the official `openai` client:

- racing operations: 50 concurrent loads, unloads (on the engine) and generations (through the gateway) on one
  adapter, then `n=16` traffic, then an unload: no crash, no deadlock (a 30 s watchdog on each phase), and the
  engine's `/v1/models` and the gateway's view of it agree at the end; a deleted model answers a clear 404;
- unload during streams: unloading an adapter on the engine while 10 long streams run on it: all 10 finish
  with that adapter's greedy text;
- engine restart: after a kill -9 of the engine's process group, the supervisor starts it again and the next
  request for each of several adapters is answered, with the answer it had before.

Both engines run with `--max-loras 2` (`VLLM_SIZES`), so three adapters in turn also evict. The vLLM half is
skipped where vLLM is not installed.
"""

from __future__ import annotations

import os
import random
import secrets
import signal
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from inference.options import EngineOptions
from tests.support.data import BASE, MESSAGES
from tests.support.engine import ft_model, resources_of
from tests.support.stack import GatewayServer, Services, Tenant, admin_of, start_gateway
from tests.support.vllm import VLLM_MAX_LORAS, VLLM_SIZES
from tunegate.processes import Process, free_port
from tunegate.role_processes import EngineProcess
from tunegate.services import scratch_database
from tunegate.supervisor import Supervisor

pytestmark = pytest.mark.timeout(900)  # vLLM's start, when this module is the session's first to need it

WATCHDOG_S = 30.0
"""The most one phase of racing operations may take before it counts as a deadlock."""
STREAM_TOKENS = {"embedded": 400, "vllm": 900}
"""Tokens of each long stream (`ignore_eos`): long enough that all 10 are still running once the last has
begun, on a busy machine too (vLLM's CPU build streams several times faster than the embedded engine; 150
tokens on the embedded engine let one stream end before the tenth began, in a CI run)."""
RESTART_S = 300.0
"""How long the requests after a kill -9 retry a 503 while the engine starts again (vLLM: three processes
import torch and vLLM on a busy machine)."""


@dataclass
class Side:
    """One engine with a gateway in front of it, and an organisation on that gateway."""

    kind: str
    engine: Process
    """The engine's process (`EngineProcess` or `VllmEngineProcess`), under a `Supervisor`."""
    url: str
    """The engine's base URL."""
    gateway: GatewayServer
    org: Tenant

    def engine_models(self) -> list[str]:
        """The ids the engine lists in `/v1/models` (duplicates kept)."""
        with httpx.Client(trust_env=False, timeout=30) as http:
            return [m["id"] for m in http.get(f"{self.url}/v1/models").json()["data"]]

    def served_as(self, model: str) -> tuple[str, str]:
        """The name the engine serves `model` under (its version, which the answer to a request for it
        names), and the adapter folder the engine loaded for it."""
        reply = self.chat(model)
        served = reply.system_fingerprint
        assert reply.choices[0].message.content and served is not None
        with httpx.Client(trust_env=False, timeout=30) as http:
            listed = {m["id"]: m for m in http.get(f"{self.url}/v1/models").json()["data"]}
        assert served in listed, (served, sorted(listed))
        return served, listed[served]["root"]

    def gateway_view(self) -> set[str]:
        """The adapters the gateway believes its engine holds."""
        pool = resources_of(self.gateway).engines.pools[BASE]
        return {name for up in pool.upstreams for name in up.loaded}

    def engine_call(self, path: str, body: dict[str, Any]) -> httpx.Response:
        with httpx.Client(trust_env=False, timeout=120) as http:
            return http.post(f"{self.url}{path}", json=body)

    def chat(self, model: str, *, retries: int = 0, **kwargs: Any) -> Any:
        """A chat through the gateway; `retries`: times a 503 is retried after its `retry-after`, as the
        SDK's default client does."""
        return self.org.client.with_options(max_retries=retries).chat.completions.create(
            model=model, messages=MESSAGES, **{"max_tokens": 2, "temperature": 0, **kwargs}
        )


@pytest.fixture(scope="module")
def embedded_engine(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[EngineProcess]:
    """`python -m inference` serving the tiny model with vLLM's test sizes, under a `Supervisor` (as
    `tunegate up` runs it): started again when it exits."""
    supervisor = Supervisor()
    engine = EngineProcess(
        {BASE: str(tiny_model_dir)},
        free_port(),
        tmp_path_factory.mktemp("churn-engine") / "engine.log",
        options=EngineOptions(
            device="cpu", max_loras=VLLM_MAX_LORAS, max_model_len=VLLM_SIZES["engine_max_model_len"]
        ),
        die_with_parent=True,
    )
    try:
        supervisor.watch(engine).wait_ready()
        yield engine
    finally:
        supervisor.stop()


@pytest.fixture(scope="module", params=["embedded", "vllm"])
def side(
    request: pytest.FixtureRequest,
    services: Services,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Iterator[Side]:
    """A gateway of its own (on a database of its own) in front of the engine of the parameter."""
    kind: str = request.param
    engine = request.getfixturevalue("embedded_engine" if kind == "embedded" else "vllm_server")
    with scratch_database(services.pg_dsn, f"tunegate_test_churn_{kind}") as database:
        gateway = start_gateway(
            services,
            database,
            tiny_model_dir,
            tmp_path_factory.mktemp(f"churn-{kind}-data"),
            upstreams=[engine.url],
            **VLLM_SIZES,
        )
        try:
            org = admin_of(gateway).tenant("churn-" + secrets.token_hex(3))
            yield Side(kind, engine, engine.url, gateway, org)
        finally:
            gateway.stop()


def _within_watchdog(calls: list[Callable[[], Any]], what: str) -> list[Any]:
    """Run `calls` all at once; their results, or a failure naming `what` if any is still running after
    `WATCHDOG_S` (a deadlock)."""
    pool = ThreadPoolExecutor(max_workers=len(calls), thread_name_prefix="churn")
    futures: list[Future[Any]] = [pool.submit(call) for call in calls]
    _, pending = wait(futures, timeout=WATCHDOG_S)
    pool.shutdown(wait=not pending, cancel_futures=True)
    assert not pending, f"{what}: {len(pending)} of {len(calls)} calls still running after {WATCHDOG_S:.0f} s"
    return [f.result() for f in futures]


def _error(exc: openai.APIStatusError) -> dict[str, Any]:
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
    error: dict[str, Any] = body["error"]
    return error


# ------------------------------------------------------------------------------------ racing operations
def test_racing_loads_unloads_and_generations_leave_nothing_untracked(
    side: Side, adapter_dirs: list[Path]
) -> None:
    model = ft_model(side.gateway, side.org, adapter_dirs[0])
    served, path = side.served_as(model)

    def load() -> tuple[str, int, str]:
        resp = side.engine_call("/v1/load_lora_adapter", {"lora_name": served, "lora_path": path})
        return "load", resp.status_code, resp.text

    def unload() -> tuple[str, int, str]:
        resp = side.engine_call("/v1/unload_lora_adapter", {"lora_name": served})
        return "unload", resp.status_code, resp.text

    def generate() -> tuple[str, int, Any]:
        try:
            return "generate", 200, side.chat(model).choices[0].message.content
        except openai.APIStatusError as exc:
            return "generate", exc.status_code, _error(exc)

    calls: list[Callable[[], Any]] = [load, unload, generate] * 17
    random.Random(25).shuffle(calls)
    results = _within_watchdog(calls[:50], "50 racing loads, unloads and generations")

    for op, status, detail in results:
        if op == "load":  # done, or refused as loaded already
            assert status == 200 or (status == 400 and "already" in detail.lower()), (status, detail)
        elif op == "unload":  # done, or not loaded (unloaded by another call meanwhile)
            assert status in (200, 404), (status, detail)
        elif status != 200:
            # A generation whose adapter was unloaded on the engine every time the gateway sent it (it
            # reloads up to three times on the engine's 404) gets a clear 404, never a 5xx.
            assert status == 404 and detail["code"] == "model_not_found", (status, detail)
    answered = [d for op, s, d in results if op == "generate" and s == 200]
    assert answered and all(answered)
    assert side.engine_models().count(served) <= 1

    def n16() -> int:
        return len(side.chat(model, n=16, temperature=1.0, seed=7).choices)

    assert _within_watchdog([n16] * 4, "n=16 traffic after the race") == [16] * 4

    # An unload on the engine, behind the gateway's back: the next request through the gateway is answered
    # all the same (it reloads on the engine's 404), and both views hold the adapter again.
    assert _within_watchdog([unload], "the unload after n=16 traffic")[0][1] == 200
    assert served not in side.engine_models()
    assert side.chat(model).choices[0].message.content
    assert side.engine_models().count(served) == 1 and served in side.gateway_view()

    # Deleted through the API: it leaves the engine and the gateway's view, and answers a clear 404.
    assert side.org.client.models.delete(model).deleted is True
    assert served not in side.engine_models() and served not in side.gateway_view()
    with pytest.raises(openai.NotFoundError) as info:
        side.chat(model)
    assert _error(info.value)["code"] == "model_not_found"
    assert side.chat(BASE).choices[0].message.content  # the engine serves on


# -------------------------------------------------------------------------------- unload during streams
def test_unload_during_streams_lets_every_stream_finish_on_its_adapter(
    side: Side, adapter_dirs: list[Path]
) -> None:
    model = ft_model(side.gateway, side.org, adapter_dirs[1])
    served, _ = side.served_as(model)
    long: dict[str, Any] = {"max_tokens": STREAM_TOKENS[side.kind], "extra_body": {"ignore_eos": True}}
    greedy = side.chat(model, **long).choices[0].message.content
    assert greedy
    start = [side.chat(m, max_tokens=16).choices[0].message.content for m in (model, BASE)]
    assert start[0] != start[1]  # the adapter changes the text

    started = [threading.Event() for _ in range(10)]
    texts: list[str | None] = [None] * 10
    reasons: list[str | None] = [None] * 10

    ready = threading.Barrier(10)

    def stream(i: int) -> None:
        parts: list[str] = []
        ready.wait(60)  # the ten sent together, so that none can end before the last has begun
        # ten streams opened at once on a busy machine: a 503 is retried as the SDK's default client does
        for chunk in side.chat(model, stream=True, retries=2, **long):
            for choice in chunk.choices:
                if choice.delta.content:
                    parts.append(choice.delta.content)
                    started[i].set()
                reasons[i] = choice.finish_reason or reasons[i]
        texts[i] = "".join(parts)

    pool = ThreadPoolExecutor(max_workers=10, thread_name_prefix="stream")
    try:
        futures = [pool.submit(stream, i) for i in range(10)]
        deadline = time.monotonic() + 120
        while not all(e.is_set() for e in started) and time.monotonic() < deadline:
            if any(f.done() for f in futures):
                break  # one ended (or failed) before all had begun: reported below
            time.sleep(0.02)
        assert all(e.is_set() for e in started), [f.exception() for f in futures if f.done()]
        unloaded = side.engine_call("/v1/unload_lora_adapter", {"lora_name": served})
        _, pending = wait(futures, timeout=120 + WATCHDOG_S)
        assert not pending, "streams still running long after the unload"
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    for f in futures:
        f.result()  # a stream cut by the unload raises here
    assert unloaded.status_code == 200, unloaded.text
    assert reasons == ["length"] * 10
    assert texts == [greedy] * 10
    assert served not in side.engine_models()  # unloaded once the streams were done


# ----------------------------------------------------------------------------------------- restart
def test_every_adapter_answers_after_the_engine_is_killed(side: Side, adapter_dirs: list[Path]) -> None:
    models = [ft_model(side.gateway, side.org, adapter_dirs[i]) for i in range(3)]  # one more than max_loras
    served = {side.served_as(m)[0] for m in models}
    before = {m: side.chat(m, max_tokens=8).choices[0].message.content for m in models}
    assert len(set(before.values())) == 3

    old_pid = side.engine.pid
    os.killpg(old_pid, signal.SIGKILL)  # the engine and every process it started (vLLM's core and worker)
    after: dict[str, str | None] = {}
    deadline = time.monotonic() + RESTART_S
    for m in models:
        while m not in after:
            try:
                after[m] = side.chat(m, max_tokens=8).choices[0].message.content
            except (openai.InternalServerError, openai.APIConnectionError) as exc:
                # a 503 while the engine is down or starting again; anything else fails the test
                if getattr(exc, "status_code", 503) != 503 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
    assert side.engine.pid != old_pid  # started again by the supervisor
    assert after == before  # each adapter's own answer, loaded again on demand
    assert served <= set(side.engine_models()) and served <= side.gateway_view()

"""Env servers: reward throughput with 1, 2 and 4 `tunegate env-server` processes, and the time a trainer step
waits on its environment there against the same environment in a sandbox of the trainer's own.

The environment's reward waits 20 ms (a stand-in for a simulation: waiting needs no core). A step scores one
batch (`BATCH` completions) through `envsdk.remote.RemoteSandbox`, the trainer's client, exactly as a job's
reward function does; the local side is `envsdk.sandbox.Sandbox`, what a trainer runs with no server
registered. Each server runs `CAPACITY` sandboxes. Every side is warmed up (sandboxes started) before it is
timed, and the local side is measured in the same run.
"""

from __future__ import annotations

import logging
import secrets
import time
from pathlib import Path
from typing import Any

from bench.common import Options, ratio

logger = logging.getLogger(__name__)

SLEEP_S = 0.02
CAPACITY = 4
SLOW_ENV = f"""import time

from envsdk import SingleTurnEnv, completion_text


class SlowEnv(SingleTurnEnv):
    def reward(self, task, completion):
        time.sleep({SLEEP_S})
        return 1.0 if completion_text(completion).strip() == task["answer"] else 0.0
"""


def _package(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "environment.toml").write_text(
        'name = "slow"\nversion = "0.1.0"\nentrypoint = "slow_env:SlowEnv"\n'
    )
    (root / "slow_env.py").write_text(SLOW_ENV)
    return root


def _items(n: int) -> list[dict[str, Any]]:
    return [
        {
            "task": {"messages": [{"role": "user", "content": f"{i} + 1?"}], "answer": str(i + 1)},
            "completion": str(i + 1),
        }
        for i in range(n)
    ]


def _steps(call: Any, items: list[dict[str, Any]], steps: int) -> list[float]:
    """Seconds each step waited for its batch's rewards."""
    waits = []
    for _ in range(steps):
        t0 = time.perf_counter()
        out = call(items)
        waits.append(time.perf_counter() - t0)
        assert len(out) == len(items) and all(r["reward"] == 1.0 for r in out), out[:3]
    return waits


def run(opts: Options) -> dict[str, Any]:
    import redis

    from bench.stack import Services
    from envsdk.remote import RemoteSandbox
    from envsdk.remote_wire import live_servers
    from envsdk.sandbox import Sandbox, detect_backend
    from tunegate.processes import EnvServerProcess
    from tunegate.stack import private_settings

    batch = 16 if opts.quick else 64
    steps = 2 if opts.quick else 6
    counts = [1, 2] if opts.quick else [1, 2, 4]
    work = opts.workdir / "envservers"
    package = _package(work / "package")
    items = _items(batch)
    try:
        detect_backend()
        allow = False
    except Exception as exc:  # noqa: BLE001 - no isolation here: measure the bare processes
        logger.warning("no sandbox backend (%s); measuring unsandboxed", exc)
        allow = True

    local = Sandbox(package, allow_unsandboxed=allow)
    local.start()
    try:
        _steps(local.reward_batch, items[:2], 1)
        local_waits = _steps(local.reward_batch, items, steps)
    finally:
        local.close()

    services = Services.start(work / "services", redis=True)
    assert services.redis_url
    client = redis.Redis.from_url(services.redis_url)
    pool = "bench-" + secrets.token_hex(3)
    settings = private_settings(
        data_dir=work / "data",
        database_url=services.database_url,
        redis_url=services.redis_url,
        base_models={},
        label="envsrv",
    )
    overrides = {"TUNEGATE_ENV_POOL": pool, "TUNEGATE_ALLOW_UNSANDBOXED_ENVIRONMENTS": str(allow).lower()}
    servers: list[EnvServerProcess] = []
    points: list[dict[str, Any]] = []
    try:
        for count in counts:
            while len(servers) < count:
                servers.append(
                    EnvServerProcess(
                        settings, work / f"server-{len(servers)}.log", capacity=CAPACITY, overrides=overrides
                    )
                )
            for server in servers:
                server.wait_registered()
            assert len(live_servers(client, pool)) == count
            remote = RemoteSandbox(services.redis_url, package, pool=pool, job_id=f"bench-{count}")
            remote.start()
            try:
                _steps(remote.reward_batch, items, 2)  # every sandbox of every server started
                waits = _steps(remote.reward_batch, items, steps)
            finally:
                remote.close()
            points.append(
                {
                    "servers": count,
                    "step_wait_s": sum(waits) / len(waits),
                    "rewards_per_s": batch * len(waits) / sum(waits),
                    "served_by": len(remote.served),
                }
            )
    finally:
        for server in servers:
            server.stop(timeout_s=30)
        client.close()
        services.stop()
    local_wait = sum(local_waits) / len(local_waits)
    base = points[0]["rewards_per_s"]
    for p in points:
        p["speedup_vs_1"] = ratio(p["rewards_per_s"], base)
        p["wait_vs_local"] = ratio(p["step_wait_s"], local_wait)
    return {
        "batch": batch,
        "steps": steps,
        "capacity": CAPACITY,
        "reward_sleep_ms": SLEEP_S * 1000,
        "local": {"step_wait_s": local_wait, "rewards_per_s": batch * len(local_waits) / sum(local_waits)},
        "points": points,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    local = report["local"]
    lines = [
        f"An environment whose reward waits {report['reward_sleep_ms']:.0f} ms; each step scores "
        f"{report['batch']} completions ({report['steps']} steps per point). "
        f"Servers run {report['capacity']} sandboxes each. "
        f"Local (the trainer's own sandbox, no server): {local['rewards_per_s']:.0f} rewards/s, "
        f"{local['step_wait_s'] * 1000:.0f} ms of environment wait per step.",
        "",
        "| env servers | rewards/s | vs 1 server | step wait (ms) | wait vs local |",
        "|---|---|---|---|---|",
    ]
    for p in report["points"]:
        lines.append(
            f"| {p['servers']} | {p['rewards_per_s']:.0f} | {p['speedup_vs_1']:.2f} "
            f"| {p['step_wait_s'] * 1000:.0f} | {p['wait_vs_local']:.3f} |"
        )
    return lines

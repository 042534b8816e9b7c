"""A running tunegate for tests, on `tunegate.services` and `tunegate.processes`: the servers of the machine
(or embedded ones), a database of its own, the gateway served over HTTP in a thread, and workers as child
processes.

Tests drive it only over HTTP, through the official `openai` SDK and a plain httpx client for the admin API.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn

from gateway.app import create_app
from gateway.httpserver import Server as HttpServer
from gateway.settings import BaseModelConfig, Settings
from tunegate import role_processes
from tunegate import services as tunegate_services
from tunegate.client import provision_tenant
from tunegate.processes import ServerThread, free_port
from tunegate.services import LOCAL_DATABASE_URL as DEFAULT_PG
from tunegate.services import LOCAL_REDIS_URL as DEFAULT_REDIS
from tunegate.services import drop_database, make_database
from tunegate.stack import private_settings

__all__ = [
    "DEFAULT_PG",
    "DEFAULT_REDIS",
    "ROOT",
    "Admin",
    "GatewayServer",
    "Services",
    "Tenant",
    "WorkerProcess",
    "admin_of",
    "command_lines",
    "drop_database",
    "free_port",
    "make_database",
    "make_settings",
    "start_gateway",
]

ROOT = Path(__file__).resolve().parents[2]


@dataclass
class Services:
    """The PostgreSQL and Redis the tests use (`tunegate.services.Services.development`: those
    `TUNEGATE_TEST_DATABASE_URL` / `TUNEGATE_TEST_REDIS_URL` name, the local ones, or embedded ones)."""

    running: tunegate_services.Services

    @classmethod
    def start(cls, workdir: Path) -> Services:
        return cls(tunegate_services.Services.development(workdir))

    @property
    def pg_dsn(self) -> str:
        """The DSN of the server's maintenance database; tests make databases of their own next to it."""
        return self.running.database_url

    @property
    def redis_url(self) -> str:
        return self.running.redis_url

    def stop(self) -> None:
        self.running.stop()


class GatewayServer(ServerThread):
    """The gateway app for `settings`, served by its HTTP server (`gateway.httpserver`) in a thread."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        config = uvicorn.Config(
            create_app(settings),
            host="127.0.0.1",
            port=settings.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
        super().__init__(HttpServer(config), "gateway")


class WorkerProcess(role_processes.WorkerProcess):
    """`python -m tunegate worker` as a child process (so tests can SIGKILL it), `overrides` over its
    settings."""

    def __init__(self, settings: Settings, log_path: Path, **overrides: str) -> None:
        super().__init__(settings, log_path, overrides=overrides)


def make_settings(
    *, data_dir: Path, database_url: str, redis_url: str, tiny_model: Path, **extra: Any
) -> Settings:
    """Settings of a test gateway of its own, with `tiny-chat` at `tiny_model` (`extra` over them)."""
    values: dict[str, Any] = {
        "max_upload_bytes": 256 * 1024 * 1024,
        "max_jsonl_line_bytes": 4 * 1024 * 1024,
        "auth_cache_ttl_s": 5.0,
        "ready_min_workers": 0,  # tests start workers only where they need them
        **extra,
    }
    return private_settings(
        data_dir=data_dir,
        database_url=database_url,
        redis_url=redis_url,
        base_models={"tiny-chat": BaseModelConfig(path=tiny_model)},
        label="test",
        **values,
    )


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
        made = provision_tenant(self.http, name, "test")
        return Tenant(self.gateway_url, made.org_id, made.key, made.key_id)


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


def command_lines() -> dict[int, str]:
    """The command line of every process running on the machine (its arguments joined by spaces), by pid;
    for tests that look for what a stack left running."""
    found: dict[int, str] = {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            found[int(pid)] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue  # gone since the listing
    return found

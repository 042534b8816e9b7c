"""The pieces of tunegate a bench runs for real, on `tunegate.services` and `tunegate.processes`: a fresh
database, the gateway as its own process (`python -m tunegate gateway`, so its CPU time can be read from
/proc), a tenant with an API key, workers, and the benches' own stand-ins (the fake upstream, the bare proxy).

PostgreSQL and Redis: those the test suite uses (`TUNEGATE_TEST_DATABASE_URL` / `TUNEGATE_TEST_REDIS_URL`,
else the local servers, else embedded ones). Children run from the directory `python -m bench` runs in (the
repository's root).
"""

from __future__ import annotations

import logging
import secrets
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import free_port, pin
from gateway.settings import BaseModelConfig, Settings
from tunegate import role_processes
from tunegate import services as tunegate_services
from tunegate.client import provision_tenant
from tunegate.processes import Process
from tunegate.role_processes import GatewayProcess, WorkerProcess
from tunegate.services import drop_database, make_database
from tunegate.stack import private_settings

__all__ = [
    "Process",
    "Rig",
    "Services",
    "bench_settings",
    "child_env",
    "make_tenant",
    "rig",
    "start_gateway",
    "start_nullproxy",
    "start_upstream",
    "start_worker",
]

logger = logging.getLogger(__name__)


@dataclass
class Services:
    """PostgreSQL and Redis for a bench (those the test suite uses: `TUNEGATE_TEST_DATABASE_URL` /
    `TUNEGATE_TEST_REDIS_URL`, the local servers, or embedded ones), with a database of its own."""

    shared: tunegate_services.Services
    database_url: str
    redis_url: str | None
    db_name: str

    @classmethod
    def start(cls, workdir: Path, *, redis: bool = False) -> Services:
        shared = tunegate_services.Services.development(workdir)
        name = f"tunegate_bench_{secrets.token_hex(4)}"
        try:
            database_url = make_database(shared.database_url, name)
        except BaseException:
            shared.stop()
            raise
        return cls(shared, database_url, shared.redis_url if redis else None, name)

    def stop(self) -> None:
        try:
            drop_database(self.shared.database_url, self.db_name)
        except Exception as exc:  # noqa: BLE001 - best effort: a leftover bench database is harmless
            logger.warning("could not drop %s: %s", self.db_name, exc)
        self.shared.stop()


def bench_settings(
    services: Services, data_dir: Path, *, upstreams: list[str], model_path: Path | None = None, **extra: Any
) -> Settings:
    return private_settings(
        data_dir=data_dir,
        database_url=services.database_url,
        redis_url=services.redis_url,
        base_models={"tiny-chat": BaseModelConfig(path=model_path, upstreams=upstreams)},
        label="bench",
        **{"log_level": "warning", **extra},
    )


def start_upstream(log_path: Path, core: int | None) -> tuple[Process, str]:
    """The fake upstream (`bench.upstream`) on a free port; returns it and its base URL."""
    port = free_port()
    proc = Process([*pin(core), sys.executable, "-m", "bench.upstream", str(port)], log_path)
    proc.wait_port(port, 30)
    return proc, f"http://127.0.0.1:{port}"


def start_nullproxy(upstream_url: str, log_path: Path, core: int | None) -> tuple[Process, str]:
    """The bare proxy (`bench.nullproxy`) in front of `upstream_url`; returns it and its base URL."""
    port = free_port()
    upstream_port = upstream_url.rsplit(":", 1)[1]
    proc = Process([*pin(core), sys.executable, "-m", "bench.nullproxy", str(port), upstream_port], log_path)
    proc.wait_port(port, 30)
    return proc, f"http://127.0.0.1:{port}"


def child_env(settings: Settings) -> dict[str, str]:
    return role_processes.child_env(settings)


def start_gateway(settings: Settings, log_path: Path, core: int | None) -> Process:
    """`python -m tunegate gateway` for `settings`, pinned to `core`; returns once it accepts connections."""
    return GatewayProcess(settings, log_path, launcher=pin(core)).wait_ready(90)


def start_worker(settings: Settings, log_path: Path, **overrides: str) -> Process:
    """`python -m tunegate worker` for `settings`."""
    return WorkerProcess(settings, log_path, overrides=overrides)


@dataclass
class Rig:
    """A running fake upstream and a gateway in front of it, on their own database (see `rig`)."""

    services: Services
    settings: Settings
    upstream_url: str
    gateway: Process
    url: str
    """The gateway's base URL."""
    procs: list[Process]
    """Everything `rig` stops on exit; add processes of your own to have them stopped first."""


@contextmanager
def rig(workdir: Path, server_core: int | None, load_core: int | None, **settings: Any) -> Iterator[Rig]:
    """PostgreSQL and Redis with a fresh database, the fake upstream pinned to `load_core` and
    `python -m tunegate gateway` for it pinned to `server_core` (more `settings` as given); all stopped and
    the database dropped on exit."""
    workdir.mkdir(parents=True, exist_ok=True)
    services = Services.start(workdir, redis=True)
    procs: list[Process] = []
    try:
        upstream, upstream_url = start_upstream(workdir / "upstream.log", load_core)
        procs.append(upstream)
        config = bench_settings(services, workdir / "data", upstreams=[upstream_url], **settings)
        gateway = start_gateway(config, workdir / "gateway.log", server_core)
        procs.append(gateway)
        yield Rig(services, config, upstream_url, gateway, f"http://127.0.0.1:{config.port}", procs)
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()


def make_tenant(gateway_url: str, settings: Settings) -> tuple[str, str]:
    """A new organisation and API key through the admin API: `(organization id, key)`."""
    assert settings.admin_key is not None
    headers = {"Authorization": f"Bearer {settings.admin_key.get_secret_value()}"}
    with httpx.Client(base_url=gateway_url, headers=headers, timeout=30, trust_env=False) as http:
        made = provision_tenant(http, "bench-" + secrets.token_hex(3), "bench")
        return made.org_id, made.key

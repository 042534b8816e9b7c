"""The pieces of tunegate a bench runs for real: a fresh database, the gateway as its own process
(`python -m tunegate gateway`, so its CPU time can be read from /proc), a tenant with an API key, workers.

PostgreSQL and Redis: those the test suite uses (`TUNEGATE_TEST_DATABASE_URL` / `TUNEGATE_TEST_REDIS_URL`,
else the local servers, else embedded ones).
"""

from __future__ import annotations

import logging
import os
import secrets
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.common import ROOT, free_port, pinned, wait_port
from gateway.settings import BaseModelConfig, Settings, settings_env
from tests.support.stack import Services as TestServices
from tests.support.stack import drop_database, make_database

logger = logging.getLogger(__name__)


@dataclass
class Services:
    """PostgreSQL and Redis for a bench (those the test suite uses: `TUNEGATE_TEST_DATABASE_URL` /
    `TUNEGATE_TEST_REDIS_URL`, the local servers, or embedded ones), with a database of its own."""

    shared: TestServices
    database_url: str
    redis_url: str | None
    db_name: str

    @classmethod
    def start(cls, workdir: Path, *, redis: bool = False) -> Services:
        shared = TestServices.start(workdir)
        name = f"tunegate_bench_{secrets.token_hex(4)}"
        return cls(shared, make_database(shared.pg_dsn, name), shared.redis_url if redis else None, name)

    def stop(self) -> None:
        try:
            drop_database(self.shared.pg_dsn, self.db_name)
        except Exception as exc:  # noqa: BLE001 - best effort: a leftover bench database is harmless
            logger.warning("could not drop %s: %s", self.db_name, exc)
        self.shared.stop()


def bench_settings(
    services: Services, data_dir: Path, *, upstreams: list[str], model_path: Path | None = None, **extra: Any
) -> Settings:
    return Settings(
        data_dir=data_dir,
        database_url=services.database_url,
        redis_url=services.redis_url,
        admin_key=secrets.token_urlsafe(16),  # type: ignore[arg-type]
        port=free_port(),
        base_models={"tiny-chat": BaseModelConfig(path=model_path, upstreams=upstreams)},
        queue_name=f"tunegate:bench:{secrets.token_hex(4)}",
        log_level="warning",
        **extra,
    )


class Process:
    """A child process with its output in a log file; stopped with SIGTERM, then SIGKILL."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(
            cmd, cwd=str(ROOT), env=env, stdout=self._log, stderr=subprocess.STDOUT, start_new_session=True
        )

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()


def start_upstream(log_path: Path, core: int | None) -> tuple[Process, str]:
    """The fake upstream (`bench.upstream`) on a free port; returns it and its base URL."""
    port = free_port()
    proc = Process(pinned([sys.executable, "-m", "bench.upstream", str(port)], core), log_path)
    wait_port(port, 30, proc.proc)
    return proc, f"http://127.0.0.1:{port}"


def start_nullproxy(upstream_url: str, log_path: Path, core: int | None) -> tuple[Process, str]:
    """The bare proxy (`bench.nullproxy`) in front of `upstream_url`; returns it and its base URL."""
    port = free_port()
    upstream_port = upstream_url.rsplit(":", 1)[1]
    cmd = [sys.executable, "-m", "bench.nullproxy", str(port), upstream_port]
    proc = Process(pinned(cmd, core), log_path)
    wait_port(port, 30, proc.proc)
    return proc, f"http://127.0.0.1:{port}"


def child_env(settings: Settings) -> dict[str, str]:
    return {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1"}


def start_gateway(settings: Settings, log_path: Path, core: int | None) -> Process:
    """`python -m tunegate gateway` for `settings`, pinned to `core`; returns once it accepts connections."""
    cmd = [sys.executable, "-m", "tunegate", "gateway", "--host", "127.0.0.1", "--port", str(settings.port)]
    proc = Process(pinned(cmd, core), log_path, env=child_env(settings))
    wait_port(settings.port, 90, proc.proc)
    return proc


def start_worker(settings: Settings, log_path: Path, **overrides: str) -> Process:
    """`python -m tunegate worker` for `settings`."""
    return Process(
        [sys.executable, "-m", "tunegate", "worker"], log_path, env={**child_env(settings), **overrides}
    )


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
        org = http.post("/v1/admin/organizations", json={"name": "bench-" + secrets.token_hex(3)})
        org.raise_for_status()
        key = http.post(f"/v1/admin/organizations/{org.json()['id']}/api_keys", json={"name": "bench"})
        key.raise_for_status()
        return org.json()["id"], key.json()["key"]

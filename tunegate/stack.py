"""`tunegate up`: the whole stack on one machine, in the foreground.

Embedded PostgreSQL and Redis when no URLs are set, the tiny base model made when missing, an inference
engine for base models that name no upstream, a worker process, and the gateway. The engine and the worker
are supervised (`tunegate.supervise`): one that exits is started again, with backoff. Ctrl-C or SIGTERM
stops everything, the embedded servers last.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import subprocess
import sys
import time

import httpx

from gateway.db import migrate
from gateway.settings import Settings, settings_env
from tunegate.embedded import EmbeddedServices, start_postgres, start_redis
from tunegate.supervise import Supervisor

logger = logging.getLogger(__name__)


def _wait_http(url: str, timeout_s: float, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"{url} exited with code {proc.returncode} before it answered")
        try:
            if httpx.get(url, timeout=1.0).status_code < 500:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise RuntimeError(f"{url} did not answer within {timeout_s:.0f}s")


def prepare(settings: Settings, services: EmbeddedServices) -> str:
    """Servers, admin key, base models and schema. Returns the admin key."""
    from tunegate.cli import ensure_admin_key

    settings.data_dir.mkdir(parents=True, exist_ok=True)
    if not settings.database_url:
        settings.database_url = start_postgres(settings.data_dir, services)
        logger.info("embedded PostgreSQL at %s", settings.database_url)
    if not settings.redis_url:
        settings.redis_url = start_redis(settings.data_dir, services)
        logger.info("embedded Redis at %s", settings.redis_url)
    key, made = ensure_admin_key(settings)
    if made:
        print(
            f"\nAdmin key (shown once; also stored in {settings.data_dir / 'admin_key'}):\n  {key}\n",
            flush=True,
        )
    for name, entry in settings.base_models.items():
        if entry.path is None and name == "tiny-chat":
            path = settings.base_model_path(name)
            if not (path / "config.json").exists():
                from trainer.tiny import make_tiny_model

                logger.info("making the tiny base model in %s", path)
                make_tiny_model(path)
    asyncio.run(migrate(settings.database_url))
    return key


def run_stack(settings: Settings) -> int:
    services = EmbeddedServices()
    supervisor = Supervisor()

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        prepare(settings, services)
        engine_models = {
            n: str(settings.base_model_path(n)) for n, e in settings.base_models.items() if not e.upstreams
        }
        engine = None
        if engine_models:
            engine_url = f"http://127.0.0.1:{settings.engine_port}"
            argv = [sys.executable, "-m", "inference", "--port", str(settings.engine_port)]
            for name, path in engine_models.items():
                argv += ["--model", f"{name}={path}"]
                settings.base_models[name].upstreams = [engine_url]
            engine = supervisor.start("engine", argv)
        env = {**os.environ, **settings_env(settings)}
        supervisor.start("worker", [sys.executable, "-m", "tunegate", "worker"], env)
        if engine is not None:
            _wait_http(f"http://127.0.0.1:{settings.engine_port}/health", 120, engine.proc)
        from gateway.app import create_app
        from gateway.httpserver import serve

        print(f"tunegate is up: http://{settings.host}:{settings.port}/v1", flush=True)
        serve(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
        return 0
    except KeyboardInterrupt:
        return 0
    finally:
        supervisor.stop()
        services.stop()

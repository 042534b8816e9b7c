"""`tunegate up`: the whole stack on one machine, in the foreground; and the settings of a stack of its own.

`run_stack`: embedded PostgreSQL and Redis when no URLs are set (`tunegate.services`), the tiny base model
made when missing, inference engines for base models that name no upstream (the embedded engine, or vLLM:
the `engine` setting, `tunegate.vllm_process`), a worker process, and the gateway. The engines and the
worker are supervised (`tunegate.supervisor.Supervisor`): one that exits is started again, with backoff.
Ctrl-C or SIGTERM stops everything, the embedded servers last.

`private_settings`: the settings of a stack that shares its servers with others (the tests' and the
benches'): a fresh admin key, a free port and a queue of its own.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import signal
import sys
from pathlib import Path
from typing import Any

from gateway.db import migrate
from gateway.settings import BaseModelConfig, Settings
from inference.vllm import VllmUnavailable
from tunegate.processes import free_port
from tunegate.role_processes import WorkerProcess
from tunegate.services import Services
from tunegate.supervisor import Supervisor
from tunegate.vllm_process import EngineChoice, VllmEngineProcess, engine_processes

logger = logging.getLogger(__name__)


def ensure_admin_key(settings: Settings) -> tuple[str, bool]:
    """The admin key; made and stored in the data dir when none is configured. Returns (key, made_now)."""
    existing = settings.admin_key_value()
    if existing:
        return existing, False
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    key = "sk-admin-" + secrets.token_urlsafe(24)
    path = settings.data_dir / "admin_key"
    path.touch(mode=0o600)
    path.write_text(key + "\n")
    return key, True


def prepare(settings: Settings) -> tuple[Services, str]:
    """Servers (the URLs of `settings` filled in with those of embedded ones), admin key, base models and
    schema. Returns the servers, to be stopped, and the admin key."""
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    services = Services.start(
        settings.data_dir, database_url=settings.database_url or None, redis_url=settings.redis_url or None
    )
    try:
        settings.database_url, settings.redis_url = services.database_url, services.redis_url
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
        asyncio.run(migrate(services.database_url))
    except BaseException:
        services.stop()
        raise
    return services, key


def _say_engines(choice: EngineChoice) -> None:
    """Which engine serves which base model (and why `auto` fell back to the embedded one)."""
    if choice.reason:
        print(f"vLLM is not used: {choice.reason}", flush=True)
    for process in choice.processes:
        what = "the embedded engine"
        if isinstance(process, VllmEngineProcess):
            what = f"vLLM {process.install.version} ({'CPU' if process.install.on_cpu else 'CUDA'} build)"
        models = ", ".join(n for n, url in choice.served_by.items() if url == process.url)
        print(f"{models}: served by {what} at {process.url}", flush=True)


def run_stack(settings: Settings) -> int:
    """Run the stack until Ctrl-C or SIGTERM; returns the exit code."""
    services: Services | None = None
    supervisor = Supervisor()

    def _terminate(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _terminate)
    try:
        services, _ = prepare(settings)
        engine_models = {
            n: str(settings.base_model_path(n)) for n, e in settings.base_models.items() if not e.upstreams
        }
        choice = engine_processes(settings, engine_models) if engine_models else None
        if choice is not None:
            for process in choice.processes:
                supervisor.watch(process)
            for name, url in choice.served_by.items():
                settings.base_models[name].upstreams = [url]
        supervisor.watch(WorkerProcess(settings, die_with_parent=True))
        if choice is not None:
            for process in choice.processes:
                process.wait_ready()
            _say_engines(choice)
        from gateway.app import create_app
        from gateway.httpserver import serve

        print(f"tunegate is up: http://{settings.host}:{settings.port}/v1", flush=True)
        serve(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level)
        return 0
    except KeyboardInterrupt:
        return 0
    except VllmUnavailable as exc:
        print(f"tunegate up: --engine vllm, but {exc}", file=sys.stderr, flush=True)
        return 1
    finally:
        supervisor.stop()
        if services is not None:
            services.stop()


def private_settings(
    *,
    data_dir: Path,
    database_url: str,
    redis_url: str | None,
    base_models: dict[str, BaseModelConfig],
    label: str = "private",
    **extra: Any,
) -> Settings:
    """Settings of a stack that shares its servers with others: a random admin key, a free port, and a queue
    named `tunegate:<label>:<random>` of its own (`extra` overrides any of them)."""
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "database_url": database_url,
        "redis_url": redis_url,
        "admin_key": secrets.token_urlsafe(16),
        "port": free_port(),
        "base_models": base_models,
        "queue_name": f"tunegate:{label}:{secrets.token_hex(4)}",
    }
    values.update(extra)
    return Settings(**values)

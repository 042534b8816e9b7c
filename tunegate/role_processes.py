"""tunegate's processes, each a `tunegate.processes.Process` with its command and the wait until it serves.

`GatewayProcess`, `WorkerProcess`, `EnvServerProcess` and `EngineProcess` run `python -m tunegate gateway`,
`python -m tunegate worker`, `python -m tunegate env-server` and `python -m inference`; the first three get
their settings as `TUNEGATE_*` variables (`child_env`), the engine its `EngineOptions` as flags.
`wait_ready` returns once the gateway listens or the engine answers `/health`; `wait_registered` once the
env server is registered in its pool.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Self

from gateway.settings import Settings, settings_env
from inference.options import EngineOptions
from tunegate.processes import Process, wait_until


def child_env(settings: Settings, **overrides: str) -> dict[str, str]:
    """This process's environment plus `settings` as `TUNEGATE_*` variables (then `overrides`): a child
    started with it runs with these settings."""
    return {**os.environ, **settings_env(settings), "PYTHONUNBUFFERED": "1", **overrides}


class GatewayProcess(Process):
    """`python -m tunegate gateway` with `settings`, on 127.0.0.1 and the settings' port. `launcher` goes
    before the command (`taskset -c 2`, say)."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path | None = None,
        *,
        launcher: Sequence[str] = (),
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.port = settings.port
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [*launcher, sys.executable, "-m", "tunegate", "gateway", "--host", "127.0.0.1"]
        argv += ["--port", str(self.port)]
        super().__init__(
            argv, log_path, child_env(settings), name="gateway", cwd=cwd, die_with_parent=die_with_parent
        )

    def wait_ready(self, timeout_s: float = 90.0) -> Self:
        """Return once it listens (its lifespan has run: the pool, the migrations, the engines' clients);
        `RuntimeError`, the process stopped, if it exits first or time runs out."""
        self._ready_or_stop(lambda: self.wait_port(self.port, timeout_s))
        return self


class WorkerProcess(Process):
    """`python -m tunegate worker` with `settings`, and `overrides` (`TUNEGATE_*` variables) over them."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path | None = None,
        *,
        overrides: Mapping[str, str] | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        super().__init__(
            [sys.executable, "-m", "tunegate", "worker"],
            log_path,
            child_env(settings, **(overrides or {})),
            name="worker",
            cwd=cwd,
            die_with_parent=die_with_parent,
            stop_timeout_s=60.0,  # a graceful stop hands its jobs back first
        )


class EnvServerProcess(Process):
    """`python -m tunegate env-server` with `settings` and `overrides` (`TUNEGATE_*` variables) over them;
    `wait_registered` returns its id once it is registered in its pool."""

    def __init__(
        self,
        settings: Settings,
        log_path: Path | None = None,
        *,
        capacity: int = 2,
        overrides: Mapping[str, str] | None = None,
        metrics_port: int | None = None,
    ) -> None:
        self.settings = settings
        self.pool = (overrides or {}).get("TUNEGATE_ENV_POOL", settings.env_pool)
        argv = [sys.executable, "-m", "tunegate", "env-server", "--capacity", str(capacity)]
        if metrics_port is not None:
            argv += ["--metrics-port", str(metrics_port)]
        super().__init__(
            argv, log_path, child_env(settings, **(overrides or {})), name="env-server", stop_timeout_s=150.0
        )

    def wait_registered(self, timeout_s: float = 60.0) -> str:
        """Block until it is registered in its pool; its server id."""
        import redis

        from envsdk.remote_wire import live_servers

        assert self.settings.redis_url
        client = redis.Redis.from_url(self.settings.redis_url)
        found: list[str] = []

        def registered() -> bool:
            found[:] = [r.id for r in live_servers(client, self.pool).values() if r.pid == self.pid]
            return bool(found)

        try:
            wait_until(
                registered, "its registration", timeout_s, self.proc, name=self.name, log_path=self.log_path
            )
        finally:
            client.close()
        return found[0]


class EngineProcess(Process):
    """`python -m inference` serving `models` (name -> local folder) on `host`:`port` with `options` (the
    engine's defaults when not given), passed as its flags (`EngineOptions.to_flags`)."""

    def __init__(
        self,
        models: Mapping[str, str | Path],
        port: int,
        log_path: Path | None = None,
        *,
        host: str = "127.0.0.1",
        options: EngineOptions | None = None,
        log_level: str | None = None,
        launcher: Sequence[str] = (),
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.url = f"http://{host}:{port}"
        self.options = options or EngineOptions()
        argv = [*launcher, sys.executable, "-m", "inference", "--host", host, "--port", str(port)]
        for name, path in models.items():
            argv += ["--model", f"{name}={path}"]
        argv += self.options.to_flags()
        if log_level is not None:
            argv += ["--log-level", log_level]
        super().__init__(argv, log_path, name="engine", cwd=cwd, die_with_parent=die_with_parent)

    def wait_ready(self, timeout_s: float = 120.0) -> Self:
        """Return once `/health` answers (its models are loaded); `RuntimeError`, the process stopped, if it
        exits first or time runs out."""
        self._ready_or_stop(lambda: self.wait_http(f"{self.url}/health", timeout_s))
        return self

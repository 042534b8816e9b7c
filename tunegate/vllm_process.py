"""vLLM as a process of a stack, and the choice of engine for `tunegate up`.

- `VllmEngineProcess`: vLLM's OpenAI server (`inference.vllm.vllm_command`) serving one base model, run by
  the interpreter of vLLM's own venv. `wait_ready` returns once `/health` answers 200. vLLM runs as three
  processes (the API server, its engine core and a worker); when the server dies, the other two live on,
  holding the model's memory, so the whole process group is killed before a restart and after a stop.
- `engine_processes`: the engine processes that serve a stack's base models, by the `engine` setting
  (`embedded`, `vllm`, `auto`) and the `engine_*` sizes, each with the models it serves.
- `serve_engine`: the same choice and sizes for one engine in the foreground (`tunegate engine`, which the
  compose file and the Kubernetes manifests run): vLLM in this process's place, or the embedded engine.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Self

from gateway.settings import Settings
from inference.options import EngineOptions
from inference.vllm import VllmInstall, VllmSizes, VllmUnavailable, find_vllm, vllm_command
from tunegate.processes import Process
from tunegate.role_processes import EngineProcess

logger = logging.getLogger(__name__)

VLLM_READY_TIMEOUT_S = 600.0
"""How long a start of vLLM may take: its three processes each import torch and vLLM (measured: 21-27 s
alone on 2 cores, a minute while the machine is busy), plus loading the model."""

_PARENT_ENV = ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")
"""Variables of this process's venv that would point vLLM's interpreter at the project's packages."""


class VllmEngineProcess(Process):
    """vLLM serving the model in `model_path` as `served_name` on `host`:`port`, with adapters loaded at run
    time (see the module), held to `sizes` as in `vllm_command`."""

    def __init__(
        self,
        install: VllmInstall,
        model_path: str | Path,
        served_name: str,
        port: int,
        log_path: Path | None = None,
        *,
        host: str = "127.0.0.1",
        sizes: VllmSizes | None = None,
        extra_args: list[str] | None = None,
        cwd: Path | None = None,
        die_with_parent: bool = False,
    ) -> None:
        self.install = install
        self.served_name = served_name
        self.url = f"http://{host}:{port}"
        argv, extra_env = vllm_command(
            model_path,
            served_name,
            python=install.python,
            on_cpu=install.on_cpu,
            host=host,
            port=port,
            sizes=sizes,
            extra_args=extra_args,
        )
        env = _vllm_env(extra_env)
        super().__init__(
            argv, log_path, env, name=f"vllm {served_name}", cwd=cwd, die_with_parent=die_with_parent
        )

    def wait_ready(self, timeout_s: float = VLLM_READY_TIMEOUT_S) -> Self:
        """Return once `/health` answers 200 (the model is loaded and the server listens); `RuntimeError`,
        the process stopped, if it exits first or time runs out."""
        self._ready_or_stop(lambda: self.wait_http(f"{self.url}/health", timeout_s, status=200))
        return self

    def _kill_group(self) -> None:
        """SIGKILL what is left of the process group of the current start (its engine core and worker)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.proc.pid, signal.SIGKILL)

    def respawn(self) -> None:
        self._kill_group()
        super().respawn()

    def stop(self, timeout_s: float | None = None) -> int:
        code = super().stop(timeout_s)
        self._kill_group()
        return code


def _vllm_env(extra: Mapping[str, str]) -> dict[str, str]:
    """This process's environment for vLLM's interpreter: without this venv's variables, with `extra`."""
    env = {k: v for k, v in os.environ.items() if k not in _PARENT_ENV}
    env.update(extra, PYTHONUNBUFFERED="1")
    return env


def vllm_sizes(settings: Settings) -> VllmSizes:
    """The `engine_*` settings as the sizes of each vLLM of a stack."""
    return VllmSizes(
        max_loras=settings.engine_max_loras,
        max_cpu_loras=settings.engine_max_cpu_loras,
        max_lora_rank=settings.engine_max_lora_rank,
        max_model_len=settings.engine_max_model_len,
        kv_cache_gib=settings.engine_kv_cache_gib,
    )


def embedded_options(settings: Settings) -> EngineOptions:
    """The `engine_*` settings as the embedded engine's options (the others keep the engine's defaults)."""
    return EngineOptions(max_loras=settings.engine_max_loras, max_model_len=settings.engine_max_model_len)


def choose_vllm(settings: Settings) -> tuple[VllmInstall | None, str]:
    """vLLM's install when the `engine` setting picks it, else `(None, why not)` (empty for `embedded`);
    `VllmUnavailable` for `engine=vllm` where it cannot run."""
    if settings.engine == "embedded":
        return None, ""
    try:
        return find_vllm(settings.engine_vllm_venv), ""
    except VllmUnavailable as exc:
        if settings.engine == "vllm":
            raise
        return None, str(exc)


@dataclass
class EngineChoice:
    """The engine processes of a stack (not started yet: see `engine_processes`)."""

    engine: str
    """`vllm` or `embedded`: what serves the models."""
    processes: list[EngineProcess | VllmEngineProcess]
    """Started processes."""
    served_by: dict[str, str]
    """Base model -> the URL of the engine that serves it."""
    reason: str = ""
    """Why `auto` chose the embedded engine (empty otherwise)."""


def engine_processes(
    settings: Settings,
    models: Mapping[str, str],
    *,
    log_dir: Path | None = None,
    die_with_parent: bool = True,
) -> EngineChoice:
    """Start the engines that serve `models` (name -> local folder) as `settings.engine` asks.

    `embedded`: one `python -m inference` for all of them on `engine_port`. `vllm`: one vLLM a model, on
    `engine_port` and the ports after it; `VllmUnavailable` when vLLM cannot run here. `auto`: vLLM where it
    can run, else the embedded engine (`reason` says why).
    """
    install, reason = choose_vllm(settings)
    if install is None:
        log = log_dir / "engine.log" if log_dir is not None else None
        embedded = EngineProcess(
            models,
            settings.engine_port,
            log,
            options=embedded_options(settings),
            die_with_parent=die_with_parent,
        )
        return EngineChoice("embedded", [embedded], {n: embedded.url for n in models}, reason)
    processes: list[EngineProcess | VllmEngineProcess] = []
    served_by: dict[str, str] = {}
    sizes = vllm_sizes(settings)
    try:
        for i, (name, path) in enumerate(models.items()):
            vllm = VllmEngineProcess(
                install,
                path,
                name,
                settings.engine_port + i,
                log_dir / f"vllm-{name}.log" if log_dir is not None else None,
                sizes=sizes,
                die_with_parent=die_with_parent,
            )
            processes.append(vllm)
            served_by[name] = vllm.url
    except BaseException:
        for process in processes:
            process.stop()
        raise
    return EngineChoice("vllm", processes, served_by)


def serve_engine(settings: Settings, models: Mapping[str, str], host: str, port: int) -> NoReturn:
    """Serve `models` (name -> local folder) on `host`:`port` in the foreground with the engine the `engine`
    setting picks and the `engine_*` sizes, exactly as `tunegate up` would: vLLM replaces this process (one
    base model a vLLM), the embedded engine runs here. Says which on stderr; `VllmUnavailable` for
    `engine=vllm` where it cannot run, `ValueError` for several models on vLLM."""
    install, reason = choose_vllm(settings)
    if install is None:
        from inference.__main__ import serve

        if reason:
            print(f"vLLM is not used: {reason}", file=sys.stderr, flush=True)
        print(
            f"{', '.join(models)}: served by the embedded engine on {host}:{port}",
            file=sys.stderr,
            flush=True,
        )
        serve(dict(models), host, port, embedded_options(settings), log_level=settings.log_level)
        raise SystemExit(0)
    if len(models) != 1:
        raise ValueError(f"vLLM serves one base model a process, not {len(models)}: run one engine a model")
    ((name, path),) = models.items()
    sizes = vllm_sizes(settings)
    argv, extra = vllm_command(
        path, name, python=install.python, on_cpu=install.on_cpu, host=host, port=port, sizes=sizes
    )
    build = "CPU" if install.on_cpu else "CUDA"
    print(
        f"{name}: served by vLLM {install.version} ({build} build) on {host}:{port}",
        file=sys.stderr,
        flush=True,
    )
    os.execve(argv[0], argv, _vllm_env(extra))

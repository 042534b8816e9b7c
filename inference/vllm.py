"""The launch recipe for vLLM on GPUs: the same HTTP contract as the embedded engine.

``vllm_command`` builds the argv and environment of ``vllm serve`` with runtime LoRA updates enabled, so
the gateway can call ``/v1/load_lora_adapter`` and ``/v1/unload_lora_adapter`` on it exactly as it does on
the CPU engine. Nothing here imports vLLM; the command runs wherever vLLM is installed.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import sys

logger = logging.getLogger(__name__)

VALID_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM accepts."""


def vllm_command(
    base_model_path: str,
    served_name: str,
    *,
    port: int = 8000,
    max_loras: int = 8,
    max_cpu_loras: int | None = None,
    max_lora_rank: int = 64,
    host: str = "0.0.0.0",
    extra_args: list[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` for ``vllm serve`` of one base model with dynamic LoRA adapters.

    ``max_loras`` adapters share a batch on the GPU, ``max_cpu_loras`` (at least ``max_loras``) stay cached
    in host memory, and memory is reserved for adapters up to ``max_lora_rank`` (higher ranks are refused).
    ``env`` holds only the variables to add to the current environment.
    """
    if max_loras < 1:
        raise ValueError("max_loras must be at least 1")
    cpu_loras = max_cpu_loras if max_cpu_loras is not None else 2 * max_loras
    if cpu_loras < max_loras:
        raise ValueError("max_cpu_loras must be at least max_loras")
    if max_lora_rank not in VALID_LORA_RANKS:
        raise ValueError(f"max_lora_rank must be one of {VALID_LORA_RANKS}")
    vllm = shutil.which("vllm")
    base = [vllm] if vllm else [sys.executable, "-m", "vllm.entrypoints.cli.main"]
    argv = [
        *base,
        "serve",
        base_model_path,
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--enable-lora",
        "--max-loras",
        str(max_loras),
        "--max-cpu-loras",
        str(cpu_loras),
        "--max-lora-rank",
        str(max_lora_rank),
        *(extra_args or []),
    ]
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    return argv, env


def main(argv: list[str] | None = None) -> None:
    """``python -m inference.vllm BASE_PATH NAME [PORT]``: print the command, or run it with ``--exec``."""
    args = list(sys.argv[1:] if argv is None else argv)
    run = "--exec" in args
    args = [a for a in args if a != "--exec"]
    if len(args) < 2:
        raise SystemExit("usage: python -m inference.vllm BASE_PATH SERVED_NAME [PORT] [--exec]")
    cmd, env = vllm_command(args[0], args[1], port=int(args[2]) if len(args) > 2 else 8000)
    if not run:
        print(" ".join(f"{k}={shlex.quote(v)}" for k, v in env.items()), shlex.join(cmd))
        return
    os.execvpe(cmd[0], cmd, {**os.environ, **env})


if __name__ == "__main__":
    main()

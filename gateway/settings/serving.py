"""Settings of serving: the base-model registry and the inference engines (vLLM or the embedded one) that
`tunegate up` starts for it."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, field_validator


class BaseModelConfig(BaseModel):
    """One base model that jobs may fine-tune and clients may chat with."""

    path: Path | None = None
    """Local HF-format directory. Empty for `tiny-chat` means `<data_dir>/models/tiny-chat` (made offline)."""
    tokenizer: str | None = None
    """What Tinker clients load this model's tokenizer from (`get_info`'s `tokenizer_id`, the SDK's
    `get_tokenizer()`): a hub id such as `Qwen/Qwen3-8B` for a hub model served to other machines. Empty:
    the model's local directory, which loads on this machine only."""
    upstreams: list[str] = Field(default_factory=list)
    """Base URLs (without `/v1`) of the inference engines that serve this model."""
    owned_by: str = "tunegate"
    """What `/v1/models` reports as the owner."""
    context_length: int | None = Field(default=None, ge=1)
    """Most tokens of one request to the model: `max_tokens` / `max_completion_tokens` above it, and a prompt
    that cannot fit it by its length alone, are refused with 400. Unset: the `max_position_embeddings` of
    the model's `config.json` where the gateway can read it, held to `engine_max_model_len`; else
    `engine_max_model_len`, else 1048576."""


LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `--max-lora-rank` (`engine_max_lora_rank`)."""

BASE_MODELS_FILE = "base_models.json"
"""Base models registered in the data dir by `tunegate models add`: `{"name": {"path": "/folder"}}`."""


def _default_base_models() -> dict[str, BaseModelConfig]:
    return {"tiny-chat": BaseModelConfig()}


class ServingSettings(BaseModel):
    """Serving: which engine `tunegate up` starts and on which ports, how many adapters of which rank an
    engine holds, how long a request may be, and the base models served (the ones registered in the data
    dir are added by `Settings`)."""

    engine: Literal["auto", "vllm", "embedded"] = "auto"
    """The engine `tunegate up` serves base models with: `auto` (vLLM where it is installed and can run, else
    the embedded engine, saying why), `vllm` (installed by `scripts/install`, or `scripts/install-vllm`
    alone; it fails to start without it), or `embedded` (`python -m inference`)."""
    engine_port: int = 8100
    """Port of the inference engine that `tunegate up` starts (vLLM serves one base model a process: the
    next base models get the ports after it)."""
    engine_max_loras: int = Field(default=8, ge=1)
    """Distinct adapters one engine batches together (vLLM's `--max-loras`); the embedded engine also keeps
    this many resident per base model."""
    engine_max_cpu_loras: int | None = Field(default=None, ge=1)
    """vLLM: adapters kept in host memory (`--max-cpu-loras`, at least `engine_max_loras`); unset: twice
    `engine_max_loras`. The embedded engine has no such second tier."""
    engine_max_lora_rank: int = 64
    """vLLM reserves memory for adapters up to this rank and refuses a higher one (`--max-lora-rank`: 8, 16,
    32, 64, 128, 256, 320 or 512). The gateway refuses an adapter of higher rank itself, on either engine
    (the embedded engine would load any rank)."""
    engine_max_model_len: int | None = Field(default=None, ge=1)
    """Most tokens of prompt and completion in one request (vLLM's and the embedded engine's
    `--max-model-len`), where the model's own context is longer; the gateway holds requests to it too.
    Unset: the model's own context."""
    engine_kv_cache_gib: float | None = Field(default=None, gt=0)
    """vLLM's KV cache, in GiB (`--kv-cache-memory-bytes`); unset: 1 GiB on CPUs (unsized, vLLM takes a
    share of the machine's free memory), vLLM's own share of GPU memory on GPUs."""
    engine_vllm_venv: Path | None = None
    """The virtual environment that holds vLLM; unset: `.venv-vllm` beside the project (where
    `scripts/install-vllm` puts it), else the one this process runs in."""
    base_models: dict[str, BaseModelConfig] = Field(default_factory=_default_base_models)
    """Base-model registry (JSON): `{"tiny-chat": {"path": "/models/tiny", "upstreams": ["http://h:8100"]}}`;
    an entry may also set `owned_by`, `context_length` (most tokens a request may ask the model for) and
    `tokenizer` (where Tinker clients load its tokenizer from: a hub id; else its folder)."""

    @field_validator("engine_max_lora_rank")
    @classmethod
    def _lora_rank_vllm_accepts(cls, value: int) -> int:
        if value not in LORA_RANKS:
            raise ValueError(f"must be one of {', '.join(map(str, LORA_RANKS))} (the ranks vLLM accepts)")
        return value

"""The embedded engine's options, in one object.

``EngineOptions`` is what ``inference.server.create_app`` and each ``inference.engine.ModelEngine`` take,
what ``python -m inference``'s flags fill in (``inference.__main__``), and what ``tunegate`` builds from its
``engine_*`` settings (``tunegate.vllm_process.embedded_options``). The defaults are the engine's own.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineOptions:
    """How each base model of an engine is served (the same for every model of one server)."""

    max_loras: int = 8
    """Adapters resident at once per base model (least recently used ones are evicted over it), and the
    most distinct adapters in one batch (vLLM's ``--max-loras``)."""
    max_batch_size: int = 16
    """Rows (requests times their ``n``) in one batched generation."""
    device: str = "auto"
    """``auto`` (CUDA where torch sees it, else the CPU), ``cpu``, ``cuda``, ``cuda:1``..."""
    batch_window_s: float = 0.005
    """How long the scheduler waits for more requests to join a batch."""
    max_concurrent_batches: int = 4
    """Batches in flight at once per base model, interleaved step by step under the model lock."""
    default_max_tokens: int = 1024
    """``max_tokens`` of a request that names none (cut to what the context leaves)."""
    max_model_len: int | None = None
    """Most tokens of prompt and completion in one request where that is less than the model's own context
    (vLLM's ``--max-model-len``); ``None``: each model's own context."""

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")

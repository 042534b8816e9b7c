"""The job spec: what ``python -m trainer run SPEC.json`` reads (written by the gateway's worker).

``TrainerSpec.from_dict`` checks types and values and raises ``TrainerError("invalid_spec", ...)`` naming the
field. Hyperparameters arrive already resolved (no ``"auto"``); omitted ones take the defaults below.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from trainer.errors import TrainerError

logger = logging.getLogger(__name__)

METHODS = ("supervised", "dpo", "reinforcement")


@dataclass
class Hyperparameters:
    """Resolved training hyperparameters."""

    n_epochs: int = 1
    """Passes over the training file (ignored when ``max_steps`` is set)."""
    batch_size: int = 4
    """Examples per optimiser step; for reinforcement, prompts per step (each with ``num_generations``)."""
    learning_rate: float = 2e-4
    """Peak learning rate of the LoRA parameters (linear decay to 0)."""
    beta: float = 0.1
    """DPO: the temperature of the preference loss."""
    num_generations: int = 4
    """Reinforcement: completions sampled per prompt (the GRPO group, >= 2)."""
    max_completion_length: int = 16
    """Reinforcement: new tokens per completion."""
    temperature: float = 1.0
    """Reinforcement: sampling temperature."""
    kl_beta: float = 0.0
    """Reinforcement: weight of the KL penalty to the base model (0 = none, no reference pass)."""
    max_steps: int | None = None
    """Optional cap on optimiser steps (overrides ``n_epochs``)."""
    checkpoint_every: int = 5
    """Save a resumable checkpoint every N steps (and always at the end)."""
    lora_r: int = 8
    """LoRA rank."""
    lora_alpha: int = 16
    """LoRA scaling numerator (scale = alpha / r)."""
    lora_dropout: float = 0.0
    """Dropout on the LoRA input."""
    max_length: int = 1024
    """Supervised/DPO: longest tokenised example kept (longer ones are truncated)."""

    @classmethod
    def from_dict(cls, data: dict[str, Any] | None) -> Hyperparameters:
        """Build from the spec's ``hyperparameters`` object; unknown keys are refused."""
        data = dict(data or {})
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(data) - set(known))
        if unknown:
            raise TrainerError("invalid_spec", f"unknown hyperparameters: {', '.join(unknown)}")
        values: dict[str, Any] = {}
        for name, value in data.items():
            if value is None and name != "max_steps":
                continue
            if name == "max_steps" and value is None:
                values[name] = None
                continue
            want_int = name in _INT_FIELDS
            ok = isinstance(value, int) if want_int else isinstance(value, int | float)
            if isinstance(value, bool) or not ok:
                kind = "an integer" if want_int else "a number"
                raise TrainerError("invalid_spec", f"hyperparameters.{name} must be {kind}, got {value!r}")
            values[name] = value if want_int else float(value)
        hp = cls(**values)
        hp._check()
        return hp

    def _check(self) -> None:
        positive = (
            "n_epochs",
            "batch_size",
            "learning_rate",
            "max_completion_length",
            "checkpoint_every",
            "lora_r",
        )
        for name in positive:
            if getattr(self, name) <= 0:
                raise TrainerError("invalid_spec", f"hyperparameters.{name} must be > 0")
        if self.num_generations < 2:
            raise TrainerError("invalid_spec", "hyperparameters.num_generations must be >= 2")
        if self.max_steps is not None and self.max_steps <= 0:
            raise TrainerError("invalid_spec", "hyperparameters.max_steps must be > 0 or null")
        if self.temperature <= 0:
            raise TrainerError("invalid_spec", "hyperparameters.temperature must be > 0")
        if self.beta < 0 or self.kl_beta < 0 or not 0 <= self.lora_dropout < 1:
            raise TrainerError("invalid_spec", "hyperparameters.beta, kl_beta and lora_dropout must be >= 0")


_INT_FIELDS = {
    "n_epochs",
    "batch_size",
    "num_generations",
    "max_completion_length",
    "max_steps",
    "checkpoint_every",
    "lora_r",
    "lora_alpha",
    "max_length",
}


@dataclass
class TrainerSpec:
    """One training job."""

    job_id: str
    """The gateway's job id (``ftjob-...``), used in log lines."""
    method: str
    """``supervised``, ``dpo`` or ``reinforcement``."""
    base_model: str
    """Absolute path of a Hugging Face model folder (config, weights, tokenizer with a chat template)."""
    training_file: str
    """Absolute path of the OpenAI-format JSONL training file."""
    output_dir: str
    """Job folder: checkpoints go to ``checkpoints/checkpoint-N``, the final adapter to ``adapter``."""
    validation_file: str | None = None
    """Optional JSONL in the same format; checked, and used for evaluation losses when given."""
    resume_from_checkpoint: str | None = None
    """A ``checkpoint-N`` folder written earlier by this trainer: training continues from step N."""
    seed: int = 42
    """Seeds python, numpy, torch, LoRA init, data order and sampling: same seed, same adapter."""
    hyperparameters: Hyperparameters = field(default_factory=Hyperparameters)
    """Resolved hyperparameters."""
    grader: dict[str, Any] | None = None
    """Reinforcement: an OpenAI grader (see ``envsdk.graders``)."""
    environment: dict[str, Any] | None = None
    """Reinforcement: ``{"package_dir": str, "config": {...}}`` for an uploaded environment package."""
    inference_base_url: str | None = None
    """OpenAI-compatible base URL (``.../v1``) for model graders."""
    inference_api_key: str | None = None
    """Bearer key for ``inference_base_url``."""
    use_vllm: bool = False
    """Reinforcement on CUDA: generate with vLLM (colocated). Ignored on a CPU."""
    allow_unsandboxed: bool = False
    """Development only: run environment and python-grader code without a sandbox where none works."""

    @property
    def checkpoints_dir(self) -> Path:
        """Where ``checkpoint-N`` folders go."""
        return Path(self.output_dir) / "checkpoints"

    @property
    def adapter_dir(self) -> Path:
        """Where the final adapter goes."""
        return Path(self.output_dir) / "adapter"

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrainerSpec:
        """Check and build a spec from its JSON object."""
        if not isinstance(data, dict):
            raise TrainerError("invalid_spec", "the spec must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(data) - known)
        if unknown:
            logger.warning("ignoring unknown spec keys: %s", ", ".join(unknown))
        for name in ("job_id", "method", "base_model", "training_file", "output_dir"):
            if not isinstance(data.get(name), str) or not data[name]:
                raise TrainerError("invalid_spec", f"{name} is required and must be a string")
        for name in ("validation_file", "resume_from_checkpoint", "inference_base_url", "inference_api_key"):
            if data.get(name) is not None and not isinstance(data[name], str):
                raise TrainerError("invalid_spec", f"{name} must be a string or null")
        if data["method"] not in METHODS:
            raise TrainerError(
                "invalid_spec", f"method must be one of {', '.join(METHODS)}, got {data['method']!r}"
            )
        seed = data.get("seed", 42)
        if seed is None:
            seed = 42
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TrainerError("invalid_spec", "seed must be an integer")
        for name in ("grader", "environment"):
            if data.get(name) is not None and not isinstance(data[name], dict):
                raise TrainerError("invalid_spec", f"{name} must be an object or null")
        if not isinstance(data.get("hyperparameters", {}) or {}, dict):
            raise TrainerError("invalid_spec", "hyperparameters must be an object")
        spec = cls(
            job_id=data["job_id"],
            method=data["method"],
            base_model=data["base_model"],
            training_file=data["training_file"],
            output_dir=data["output_dir"],
            validation_file=data.get("validation_file"),
            resume_from_checkpoint=data.get("resume_from_checkpoint"),
            seed=seed,
            hyperparameters=Hyperparameters.from_dict(data.get("hyperparameters")),
            grader=data.get("grader"),
            environment=data.get("environment"),
            inference_base_url=data.get("inference_base_url"),
            inference_api_key=data.get("inference_api_key"),
            use_vllm=bool(data.get("use_vllm", False)),
            allow_unsandboxed=bool(data.get("allow_unsandboxed", False)),
        )
        if spec.method == "reinforcement" and spec.grader is None and spec.environment is None:
            raise TrainerError("invalid_spec", "reinforcement needs a grader or an environment")
        return spec

    @classmethod
    def from_file(cls, path: str | Path) -> TrainerSpec:
        """Read and check ``SPEC.json``."""
        try:
            data = json.loads(Path(path).read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise TrainerError("invalid_spec", f"cannot read spec {path}: {exc}") from None
        return cls.from_dict(data)

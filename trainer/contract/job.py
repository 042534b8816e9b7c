"""The spec of one training job, as the worker writes it and ``python -m trainer run`` reads it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from trainer.contract.hyperparameters import HYPERPARAMETERS, AnyHyperparameters, Method, _Strict

EPISODE_KEYS = ("input_ids", "completion_mask", "logprobs", "advantage")
"""A training row holding all of these is a logged episode's sample (a capture export's)."""


def logged_episodes(path: str | Path) -> bool:
    """Whether the JSONL file at ``path`` holds logged episodes: its first row has ``EPISODE_KEYS`` (a file
    that cannot be read is not one)."""
    try:
        with open(path, "rb") as f:
            for line in f:
                if line.strip():
                    row = json.loads(line)
                    return isinstance(row, dict) and all(k in row for k in EPISODE_KEYS)
    except (OSError, ValueError):
        return False
    return False


class EnvironmentSpec(_Strict):
    """An uploaded environment package, extracted by the worker."""

    package_dir: str
    """Absolute path of the extracted package."""
    config: dict[str, Any] = Field(default_factory=dict)
    """The job's configuration of the environment (``environment.toml``'s ``[config]`` overridden)."""


class TrainerSpec(BaseModel):
    """One training job, as ``python -m trainer run SPEC.json`` reads it (written by the worker)."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    job_id: str = Field(min_length=1)
    """The gateway's job id (``ftjob-...``), used in log lines."""
    method: Method
    """``supervised``, ``dpo`` or ``reinforcement``."""
    base_model: str = Field(min_length=1)
    """Absolute path of a Hugging Face model folder (config, weights, tokenizer with a chat template)."""
    training_file: str = Field(min_length=1)
    """Absolute path of the OpenAI-format JSONL training file."""
    output_dir: str = Field(min_length=1)
    """Job folder: checkpoints go to ``checkpoints/checkpoint-N``, the final adapter to ``adapter``."""
    validation_file: str | None = None
    """Optional JSONL in the same format, evaluated every ``eval_interval`` steps and at checkpoints."""
    resume_from_checkpoint: str | None = None
    """A ``checkpoint-N`` folder written earlier by this trainer: training continues from step N."""
    seed: int = 42
    """Seeds python, numpy, torch, LoRA init, data order and sampling: same seed, same adapter."""
    hyperparameters: AnyHyperparameters
    """Resolved hyperparameters of ``method``."""
    grader: dict[str, Any] | None = None
    """Reinforcement: an OpenAI grader (see ``envsdk.graders``)."""
    environment: EnvironmentSpec | None = None
    """Reinforcement: an uploaded environment package."""
    inference_base_url: str | None = None
    """OpenAI-compatible base URL (``.../v1``) for model graders: the worker sets the gateway's own
    (``Settings.internal_gateway_url``), never an engine's, when the grader calls a model."""
    inference_api_key: str | None = None
    """Bearer key for ``inference_base_url`` when the environment variable ``INFERENCE_KEY_ENV`` is unset
    (the worker passes the job's key in that variable, not in this file)."""
    use_vllm: bool = False
    """Reinforcement on CUDA: generate with vLLM. Ignored on a CPU."""
    vllm_server: str | None = None
    """Reinforcement with ``use_vllm``: ``host:port`` of a ``trl vllm-serve`` on generation devices of the
    job's own (server mode); unset: vLLM runs inside the trainer on its devices (colocate mode)."""
    collective_timeout_s: float = Field(default=1800.0, gt=0)
    """With more than one device: how long a rank waits on the others in one collective before the run
    fails, so a lost rank ends the run instead of hanging it."""
    allow_unsandboxed: bool = False
    """Development only: run environment and python-grader code without a sandbox where none works."""
    sandbox_maxima: dict[str, int | float] | None = None
    """The operator's ceilings on every sandbox's limits (``envsdk.Maxima.as_dict``); unset: its defaults."""

    @model_validator(mode="before")
    @classmethod
    def _method_hyperparameters(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("method") in HYPERPARAMETERS:
            hp = HYPERPARAMETERS[data["method"]].model_validate(data.get("hyperparameters") or {})
            data = {**data, "hyperparameters": hp}
        return data

    @model_validator(mode="after")
    def _complete(self) -> TrainerSpec:
        if self.method == "reinforcement" and self.grader is None and self.environment is None:
            if not logged_episodes(self.training_file):
                raise ValueError(
                    "reinforcement needs a grader or an environment (or a training file of logged episodes)"
                )
        return self

    @property
    def offline(self) -> bool:
        """Reinforcement on logged episodes (``trainer.offline_rl``): rewards and the sampler's logprobs are
        in the training file, nothing is sampled or graded."""
        return self.method == "reinforcement" and logged_episodes(self.training_file)

    @property
    def checkpoints_dir(self) -> Path:
        """Where ``checkpoint-N`` folders go."""
        return Path(self.output_dir) / "checkpoints"

    @property
    def adapter_dir(self) -> Path:
        """Where the final adapter goes."""
        return Path(self.output_dir) / "adapter"

    @property
    def evaluates(self) -> bool:
        """Whether the job has a validation file to evaluate."""
        return self.validation_file is not None and self.hyperparameters.eval_interval is not None

"""Hyperparameters of each method, their ranges, and how every ``"auto"`` is chosen (:func:`resolve`)."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Literal, Union, get_args, get_origin

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    create_model,
    field_validator,
    model_validator,
)

METHODS = ("supervised", "dpo", "reinforcement")
Method = Literal["supervised", "dpo", "reinforcement"]
Auto = Literal["auto"]
INFERENCE_KEY_ENV = "TRAINER_INFERENCE_API_KEY"
"""The environment variable that carries the key for ``TrainerSpec.inference_base_url`` (the worker sets it
to a key minted for the job's organisation; the spec file holds no secret)."""
ENV_POOL_REDIS_ENV = "TRAINER_ENV_POOL_REDIS_URL"
"""The environment variable naming the Redis of the env servers' pool, with the job's own Redis user (set by
the worker for environment jobs); with servers registered there, the job's environment runs on them
(``trainer.envpool``)."""
ENV_POOL_NAME_ENV = "TRAINER_ENV_POOL"
"""The environment variable naming that pool (``default`` when unset)."""
ENV_POOL_ORG_ENV = "TRAINER_ENV_POOL_ORG"
"""The environment variable naming the job's organisation: its namespace in that pool, the only one the
Redis user of ``ENV_POOL_REDIS_ENV`` reaches."""
DEFAULTS_FILE = "tunegate_defaults.json"
"""A base model folder's measured training defaults: ``{"learning_rates": {method: lr}, "hyperparameters":
{method: {name: value}}}`` (both optional)."""


Int = Annotated[int, Field(strict=True)]
Float = Annotated[float, Field(allow_inf_nan=False)]


class _Strict(BaseModel):
    """Strict JSON types, no NaN or infinity, unknown keys refused."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class Hyperparameters(_Strict):
    """What every method takes, resolved. Requests may say ``"auto"`` for each (see :data:`REQUEST`)."""

    n_epochs: Annotated[Int, Field(ge=1, le=50)]
    """Passes over the training file (``max_steps`` ends training earlier when set)."""
    batch_size: Annotated[Int, Field(ge=1, le=256)]
    """Examples per optimiser step; for reinforcement, prompts per step (each with ``num_generations``)."""
    learning_rate_multiplier: Annotated[Float, Field(gt=0, le=10_000)]
    """Scales the base model's base learning rate for the method (auto: 1)."""
    learning_rate: Annotated[Float, Field(gt=0, le=1)]
    """Peak learning rate of the LoRA parameters, decayed linearly to 0 (auto: multiplier x base)."""
    max_steps: Annotated[Int, Field(ge=1, le=1_000_000)] | None = None
    """Cap on optimiser steps (none: the epochs decide)."""
    checkpoint_every: Annotated[Int, Field(ge=1, le=1_000_000)]
    """Save a resumable, servable checkpoint every N steps, and at the end (auto: a quarter of the run)."""
    lora_r: Annotated[Int, Field(ge=1, le=256)]
    """LoRA rank (auto: 8)."""
    lora_alpha: Annotated[Int, Field(ge=1, le=1024)]
    """LoRA scaling numerator, scale = alpha / r (auto: twice the rank)."""
    eval_interval: Annotated[Int, Field(ge=1, le=1_000_000)] | None = None
    """Steps between evaluations on ``eval_samples`` validation examples (auto: a tenth of the run; none
    without a validation file)."""
    eval_samples: Annotated[Int, Field(ge=1, le=100_000)] | None = None
    """Validation examples scored at each periodic evaluation; checkpoints score all (auto: up to 64)."""
    gpus: Annotated[Int, Field(ge=1, le=64)]
    """Devices the job trains on at once: GPUs, or processes on a machine without them. More than one trains
    data-parallel, ``batch_size`` split evenly across them (auto: by the base model's size, `devices_for`)."""


class SupervisedHyperparameters(Hyperparameters):
    """Supervised fine-tuning (loss on the assistant's tokens)."""

    max_length: Annotated[Int, Field(ge=16, le=131_072)]
    """Longest tokenised example kept; longer ones are truncated (auto: 1024)."""


class DpoHyperparameters(Hyperparameters):
    """Direct preference optimisation."""

    beta: Annotated[Float, Field(gt=0, le=2)]
    """Temperature of the preference loss: higher keeps the model closer to the base (auto: 0.1)."""
    max_length: Annotated[Int, Field(ge=16, le=131_072)]
    """Longest tokenised example kept; longer ones are truncated (auto: 1024)."""


class ReinforcementHyperparameters(Hyperparameters):
    """Reinforcement learning with GRPO."""

    num_generations: Annotated[Int, Field(ge=2, le=64)]
    """Completions sampled per prompt: the group whose rewards are compared (auto: 8 x compute_multiplier)."""
    compute_multiplier: Annotated[Float, Field(gt=0, le=10)]
    """Scales the sampling work per prompt, through ``num_generations`` when that is auto (auto: 1)."""
    max_completion_length: Annotated[Int, Field(ge=1, le=32_768)]
    """New tokens per completion, a multi-turn episode's whole budget (auto: the model's, else 256)."""
    temperature: Annotated[Float, Field(gt=0, le=2)]
    """Sampling temperature of the training completions; evaluations decode greedily (auto: 1)."""
    kl_beta: Annotated[Float, Field(ge=0, le=10)]
    """Weight of the KL penalty to the base model; 0 is none, with no reference pass (auto: 0)."""
    reasoning_effort: Literal["default", "low", "medium", "high"]
    """Only ``default``: the served models answer without a separate reasoning phase."""

    @field_validator("reasoning_effort")
    @classmethod
    def _no_reasoning_phase(cls, value: str) -> str:
        if value not in ("auto", "default"):
            raise ValueError(
                "only 'default' is supported: the served models answer without a separate reasoning "
                "phase; set max_completion_length for the answer's length"
            )
        return value


HYPERPARAMETERS: dict[str, type[Hyperparameters]] = {
    "supervised": SupervisedHyperparameters,
    "dpo": DpoHyperparameters,
    "reinforcement": ReinforcementHyperparameters,
}
"""The resolved hyperparameters of each method."""

AnyHyperparameters = SupervisedHyperparameters | DpoHyperparameters | ReinforcementHyperparameters
NOT_AUTO = ("max_steps",)
"""Hyperparameters that are either given or absent (no ``"auto"``)."""


def _request_model(resolved: type[Hyperparameters]) -> type[BaseModel]:
    """The request form of a method's hyperparameters: every field may be ``"auto"`` (its default), ``null``
    means ``"auto"``, and the ranges are the resolved model's own."""
    fields: dict[str, Any] = {}
    for name, info in resolved.model_fields.items():
        if name in NOT_AUTO:
            fields[name] = (info.annotation, None)
            continue
        kind: Any = info.annotation
        if get_origin(kind) in (Union, UnionType):  # "X | None": the request says "auto" instead
            kind = next(a for a in get_args(kind) if a is not type(None))
        if info.metadata:
            kind = Annotated[kind, *info.metadata]
        fields[name] = (kind | Auto, "auto")
    # Based on the resolved model too, so its field validators check requests as well.
    return create_model(
        f"{resolved.__name__}Request", __base__=(_Request, resolved), __doc__=resolved.__doc__, **fields
    )


class _Request(_Strict):
    @model_validator(mode="before")
    @classmethod
    def _null_is_auto(cls, data: Any) -> Any:
        if isinstance(data, dict):
            return {k: ("auto" if v is None and k not in NOT_AUTO else v) for k, v in data.items()}
        return data


REQUEST: dict[str, type[BaseModel]] = {m: _request_model(cls) for m, cls in HYPERPARAMETERS.items()}
"""The hyperparameters a job create (or a spec) may give per method, ``"auto"`` allowed."""


# ---- "auto" ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class DataSummary:
    """What "auto" needs to know of a job's data."""

    rows: int
    """Examples in the training file."""
    validation_rows: int | None = None
    """Examples in the validation file (none: no validation file)."""


@dataclass(frozen=True)
class ModelDefaults:
    """What "auto" needs to know of a base model."""

    hidden_size: int = 4096
    """Width of the residual stream (``config.json``)."""
    family: str = ""
    """``model_type`` of ``config.json`` (``qwen2``, ``llama``, ...)."""
    learning_rates: dict[str, float] = field(default_factory=dict)
    """Measured base learning rates per method (from the folder's ``tunegate_defaults.json``)."""
    hyperparameters: dict[str, dict[str, Any]] = field(default_factory=dict)
    """Measured defaults per method (from the folder's ``tunegate_defaults.json``)."""
    parameters: int = 0
    """Parameters of the model, estimated from ``config.json`` (0: unknown)."""
    vocab_size: int | None = None
    """Rows of the embedding (``vocab_size`` of ``config.json``, or of its ``text_config``; None: unknown)."""


def estimate_parameters(config: dict[str, Any]) -> int:
    """A decoder's parameters from its ``config.json``: per layer four square attention matrices (fewer with
    grouped key/value heads, counted as full: an upper bound) and a gated MLP, plus input and output
    embeddings. An upper bound, within about 15% for Llama and Qwen models; 0 when the config says too
    little."""
    try:
        hidden = int(config["hidden_size"])
        layers = int(config["num_hidden_layers"])
        vocab = int(config.get("vocab_size") or 0)
        inner = int(config.get("intermediate_size") or 4 * hidden)
    except (KeyError, TypeError, ValueError):
        return 0
    embeddings = vocab * hidden * (1 if config.get("tie_word_embeddings") else 2)
    return layers * (4 * hidden * hidden + 3 * hidden * inner) + embeddings


DEVICES_BY_SIZE = ((8e9, 1), (20e9, 2), (40e9, 4))
"""(largest model, devices) in bf16 on 80 GB accelerators for LoRA training: a model up to 8B parameters
trains on one, up to 20B on two, up to 40B on four, anything larger on eight (docs/training.md)."""


def devices_for(model: ModelDefaults) -> int:
    """The devices a job on ``model`` needs when its ``gpus`` is ``"auto"`` (1 for an unknown size)."""
    for largest, devices in DEVICES_BY_SIZE:
        if model.parameters <= largest:
            return devices
    return 8


@lru_cache(maxsize=64)
def _read_model_defaults(path: str, mtime_ns: int) -> ModelDefaults:
    folder = Path(path)
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    try:
        measured = json.loads((folder / DEFAULTS_FILE).read_text())
    except (OSError, ValueError):
        measured = {}
    hidden = config.get("hidden_size") or config.get("d_model") or config.get("n_embd") or 4096
    return ModelDefaults(
        hidden_size=int(hidden),
        family=str(config.get("model_type") or ""),
        learning_rates=dict(measured.get("learning_rates") or {}),
        hyperparameters=dict(measured.get("hyperparameters") or {}),
        parameters=estimate_parameters(config),
        vocab_size=_vocab_size(config),
    )


def _vocab_size(config: dict[str, Any]) -> int | None:
    size = config.get("vocab_size") or (config.get("text_config") or {}).get("vocab_size")
    return size if type(size) is int and size > 0 else None


def model_defaults(path: str | Path) -> ModelDefaults:
    """The training defaults of the base model in folder ``path`` (cached until its config changes)."""
    try:
        mtime = (Path(path) / "config.json").stat().st_mtime_ns
    except OSError:
        mtime = 0
    return _read_model_defaults(str(path), mtime)


LORA_LEARNING_RATE = 5e-4
"""LoRA learning rate of supervised fine-tuning for a model 2000 wide (10x the full-fine-tuning rate)."""
WIDTH_EXPONENT = {"llama": 0.781, "qwen2": 0.0775, "qwen3": 0.0775, "qwen3_moe": 0.0775}
"""How the LoRA learning rate scales with ``(2000 / hidden_size) ** exponent`` per model family."""
METHOD_FACTOR = {"supervised": 1.0, "dpo": 0.1, "reinforcement": 0.1}
"""Base learning rate of each method relative to supervised fine-tuning's."""


def base_learning_rate(method: str, model: ModelDefaults) -> float:
    """The learning rate a ``learning_rate_multiplier`` of 1 means for ``method`` on ``model``.

    A measured rate of the model wins. Otherwise the LoRA rule of thumb: 5e-4 for supervised fine-tuning of
    a model 2000 wide, scaled by ``(2000 / width) ** exponent`` (exponent 0.781 for Llama, 0.0775 for Qwen,
    0.5 otherwise), times 0.1 for DPO and reinforcement learning. For Qwen2.5-0.5B/1.5B/7B that gives
    supervised 5.3e-4/5.0e-4/4.8e-4 and reinforcement 5.3e-5/5.0e-5/4.8e-5; for Llama-3.2-1B/3.1-8B
    supervised 8.5e-4/2.9e-4 and reinforcement 8.5e-5/2.9e-5.
    """
    measured = model.learning_rates.get(method)
    if isinstance(measured, int | float) and measured > 0:
        return float(measured)
    exponent = WIDTH_EXPONENT.get(model.family, 0.5)
    return LORA_LEARNING_RATE * (2000 / model.hidden_size) ** exponent * METHOD_FACTOR[method]


GENERIC_DEFAULTS: dict[str, dict[str, Any]] = {
    "supervised": {"max_length": 1024},
    "dpo": {"max_length": 1024, "beta": 0.1},
    "reinforcement": {
        "num_generations": 8,
        "max_completion_length": 256,
        "temperature": 1.0,
        "kl_beta": 0.0,
        "min_steps": 60,
    },
}
"""Defaults of models that ship none; ``min_steps``: auto epochs give reinforcement at least this many
steps on a small task file."""


def resolve(method: str, given: BaseModel, data: DataSummary, model: ModelDefaults) -> AnyHyperparameters:
    """Every ``"auto"`` of ``given`` (a :data:`REQUEST` model) replaced by the value training will use.

    Raises ``ValueError`` (with the offending name first, ``"name: message"``) for combinations that
    cannot be honoured, such as evaluation settings without a validation file.
    """
    defaults = {**GENERIC_DEFAULTS[method], **model.hyperparameters.get(method, {})}
    values = given.model_dump()

    def pick(name: str, value: Any) -> None:
        if values.get(name) == "auto":
            values[name] = value

    if data.validation_rows is None:
        for name in ("eval_interval", "eval_samples"):
            if values[name] != "auto":
                raise ValueError(f"{name}: evaluation needs a validation_file")
    pick("gpus", devices_for(model))
    gpus = values["gpus"]
    auto_batch = int(defaults.get("batch_size", max(1, min(8, data.rows // 4 or 1))))
    if method != "reinforcement":  # examples split evenly across the devices
        auto_batch = math.ceil(auto_batch / gpus) * gpus
        if values["batch_size"] != "auto" and values["batch_size"] % gpus:
            raise ValueError(
                f"batch_size: {values['batch_size']} examples do not split evenly over {gpus} gpus"
            )
    pick("batch_size", auto_batch)
    if method == "reinforcement":
        # GRPO steps take whole batches of prompts only: a batch must fit the tasks.
        if given.model_dump()["batch_size"] == "auto":
            values["batch_size"] = min(values["batch_size"], data.rows)
        elif values["batch_size"] > data.rows:
            raise ValueError(
                f"batch_size: {values['batch_size']} prompts a step, but the file has {data.rows}"
            )
        pick("compute_multiplier", 1.0)
        gens = round(int(defaults["num_generations"]) * values["compute_multiplier"])
        pick("num_generations", max(2, min(64, gens)))
        if values["batch_size"] * values["num_generations"] % gpus:
            raise ValueError(
                f"gpus: {values['batch_size']} prompts x {values['num_generations']} generations a step do "
                f"not split evenly over {gpus} gpus"
            )
        for name in ("max_completion_length", "temperature", "kl_beta"):
            pick(name, defaults[name])
        pick("reasoning_effort", "default")
        per_epoch = data.rows // values["batch_size"]
        pick("n_epochs", max(1, min(50, math.ceil(int(defaults["min_steps"]) / per_epoch))))
    else:
        pick("n_epochs", int(defaults.get("n_epochs", max(1, min(10, math.ceil(64 / max(data.rows, 1)))))))
        pick("max_length", defaults["max_length"])
        if method == "dpo":
            pick("beta", defaults["beta"])
    base = base_learning_rate(method, model)
    if values["learning_rate"] != "auto" and values["learning_rate_multiplier"] == "auto":
        values["learning_rate_multiplier"] = values["learning_rate"] / base
    pick("learning_rate_multiplier", 1.0)
    pick("learning_rate", values["learning_rate_multiplier"] * base)
    steps = total_steps(method, data.rows, values["batch_size"], values["n_epochs"], values["max_steps"])
    pick("checkpoint_every", max(1, math.ceil(steps / 4)))
    pick("lora_r", int(defaults.get("lora_r", 8)))
    pick("lora_alpha", 2 * values["lora_r"])
    if data.validation_rows:
        pick("eval_interval", max(1, math.ceil(steps / 10)))
        pick("eval_samples", min(data.validation_rows, 64))
    else:
        values["eval_interval"] = values["eval_samples"] = None  # no validation file: no evaluations
    resolved = HYPERPARAMETERS[method].model_validate(values)
    assert isinstance(resolved, AnyHyperparameters)
    return resolved


def total_steps(method: str, rows: int, batch_size: int, n_epochs: int, max_steps: int | None) -> int:
    """Optimiser steps of a run: batches per epoch times epochs, capped by ``max_steps``. A supervised or
    DPO epoch ends with a short batch; a GRPO epoch takes whole batches of prompts only."""
    per_epoch = rows // batch_size if method == "reinforcement" else math.ceil(rows / batch_size)
    steps = max(1, per_epoch) * n_epochs
    return min(steps, max_steps) if max_steps is not None else steps

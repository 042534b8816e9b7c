"""The training contract: hyperparameters, the job spec and the trainer's events, each defined once.

The gateway validates a job's hyperparameters with these models and resolves every ``"auto"`` with
:func:`resolve`; the worker writes the resolved values into a :class:`TrainerSpec`; ``python -m trainer run``
reads that spec; the trainer emits :data:`TrainerEvent` objects and the worker parses them back. This
package needs pydantic and nothing else, so the gateway can import it without torch (the only arrow from
``gateway`` into ``trainer``).

Every hyperparameter has one definition here: its type, its range (``Field`` constraints) and how ``"auto"``
is chosen (:func:`resolve`). A value the API accepts is a value training uses; an unknown one is refused.
Learning rates are ``learning_rate_multiplier x`` the base model's base learning rate for the method
(:func:`base_learning_rate`): measured for models that ship their own ``tunegate_defaults.json`` (such as
``tiny-chat``), otherwise derived from the model's width as LoRA guides do.
"""

from __future__ import annotations

from trainer.contract.events import (
    EVENT,
    CheckpointEvent,
    ErrorEvent,
    MessageEvent,
    MetricsEvent,
    ResultEvent,
    StoppedEvent,
    TrainerEvent,
)
from trainer.contract.hyperparameters import (
    DEFAULTS_FILE,
    DEVICES_BY_SIZE,
    ENV_POOL_NAME_ENV,
    ENV_POOL_ORG_ENV,
    ENV_POOL_REDIS_ENV,
    GENERIC_DEFAULTS,
    HYPERPARAMETERS,
    INFERENCE_KEY_ENV,
    LORA_LEARNING_RATE,
    METHOD_FACTOR,
    METHODS,
    NOT_AUTO,
    REQUEST,
    WIDTH_EXPONENT,
    AnyHyperparameters,
    Auto,
    DataSummary,
    DpoHyperparameters,
    Float,
    Hyperparameters,
    Int,
    Method,
    ModelDefaults,
    ReinforcementHyperparameters,
    SupervisedHyperparameters,
    base_learning_rate,
    devices_for,
    estimate_parameters,
    model_defaults,
    resolve,
    total_steps,
)
from trainer.contract.job import (
    EnvironmentSpec,
    TrainerSpec,
)
from trainer.contract.tinker import (
    TINKER_LOSSES,
    TINKER_REFUSED_LOSSES,
    tinker_loss_error,
    tinker_required_inputs,
)

__all__ = [
    "ENV_POOL_NAME_ENV",
    "ENV_POOL_ORG_ENV",
    "ENV_POOL_REDIS_ENV",
    "TINKER_LOSSES",
    "TINKER_REFUSED_LOSSES",
    "tinker_loss_error",
    "tinker_required_inputs",
    "DEVICES_BY_SIZE",
    "devices_for",
    "estimate_parameters",
    "AnyHyperparameters",
    "Auto",
    "CheckpointEvent",
    "DEFAULTS_FILE",
    "DataSummary",
    "DpoHyperparameters",
    "EVENT",
    "EnvironmentSpec",
    "ErrorEvent",
    "Float",
    "GENERIC_DEFAULTS",
    "HYPERPARAMETERS",
    "Hyperparameters",
    "INFERENCE_KEY_ENV",
    "Int",
    "LORA_LEARNING_RATE",
    "METHODS",
    "METHOD_FACTOR",
    "MessageEvent",
    "Method",
    "MetricsEvent",
    "ModelDefaults",
    "NOT_AUTO",
    "REQUEST",
    "ReinforcementHyperparameters",
    "ResultEvent",
    "StoppedEvent",
    "SupervisedHyperparameters",
    "TrainerEvent",
    "TrainerSpec",
    "WIDTH_EXPONENT",
    "base_learning_rate",
    "model_defaults",
    "resolve",
    "total_steps",
]

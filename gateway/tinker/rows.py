"""The frozen rows `gateway.tinker.store` returns: training models, their requests (futures) and holder,
checkpoints and samplers. JSON columns stay plain dicts."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True, slots=True)
class TrainingModelRow:
    """A training model (a LoRA adapter), as the API lists it and its holder trains it."""

    id: str
    seq: int
    """The row's number, assigned by the database: its training process's working directory is named by it."""
    organization_id: str
    api_key_id: str
    session_id: str
    base_model: str
    lora_rank: int
    lora_config: dict[str, Any]
    """`rank`, `seed`, `train_attn`, `train_mlp`: what the training process is initialised with."""
    user_metadata: dict[str, Any] | None
    worker_id: str | None
    heartbeat_at: datetime | None
    resume_path: str | None
    lost: str | None
    created_at: datetime
    last_request_at: datetime


@dataclass(frozen=True, slots=True)
class HolderRow:
    """Who holds a model: `worker_id` (None when no worker does), whether its beat is fresh, and why the
    model is lost (None while it is not)."""

    worker_id: str | None
    alive: bool | None
    lost: str | None


@dataclass(frozen=True, slots=True)
class RequestRow:
    """A request of the API; `result` is its answer once `status` is `done`."""

    id: str
    organization_id: str
    model_id: str | None
    kind: str
    payload: dict[str, Any]
    status: str
    result: bytes | None
    result_type: str | None
    error: str | None
    category: str | None
    created_at: datetime
    finished_at: datetime | None


@dataclass(frozen=True, slots=True)
class FutureRow(RequestRow):
    """A request as `retrieve_future` reads it, with its age by the database's clock."""

    age_s: float


@dataclass(frozen=True, slots=True)
class CheckpointRow:
    organization_id: str
    model_id: str
    kind: str
    """`training` (state to load) or `sampler` (an adapter the engines serve as `served_model`)."""
    name: str
    path: str
    served_model: str | None
    with_optimizer: bool
    size_bytes: int | None
    created_at: datetime
    expires_at: datetime | None


@dataclass(frozen=True, slots=True)
class ModelCheckpointRow(CheckpointRow):
    """A checkpoint with the base model and LoRA settings of the model it was saved from."""

    base_model: str
    lora_rank: int
    lora_config: dict[str, Any]


@dataclass(frozen=True, slots=True)
class SamplerRow:
    id: str
    organization_id: str
    session_id: str
    base_model: str
    model_path: str | None
    served_model: str
    created_at: datetime

"""The JSON shapes of the Tinker API, as the official SDK (`tinker` 0.38) sends and reads them.

Requests accept fields this server does not use (`extra="allow"`), so a newer SDK's additions do not break
it. `forward_backward` is not here: it arrives as a protocol buffer (`gateway.tinker.wire_decode`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class TinkerModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class ClientConfigRequest(TinkerModel):
    sdk_version: str = ""


class CreateSessionRequest(TinkerModel):
    tags: list[str] = Field(default_factory=list)
    user_metadata: dict[str, Any] | None = None
    sdk_version: str = ""


class SessionHeartbeatRequest(TinkerModel):
    session_id: str


class FinishReason(TinkerModel):
    type: Literal["success", "errored", "interrupted"]


class FinishSessionRequest(TinkerModel):
    """`ServiceClient.close(status, detail)`: how the client's work in the session ended."""

    reason: FinishReason
    detail: str | None = None


class LoraConfig(TinkerModel):
    rank: int = Field(default=32, ge=1, le=256)
    seed: int | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class CreateModelRequest(TinkerModel):
    session_id: str
    model_seq_id: int
    base_model: str
    user_metadata: dict[str, Any] | None = None
    lora_config: LoraConfig | None = None


class ModelRef(TinkerModel):
    model_id: str


class AdamParams(TinkerModel):
    learning_rate: float = Field(default=1e-4, ge=0)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    grad_clip_norm: float = Field(default=0.0, ge=0)


class OptimStepRequest(TinkerModel):
    model_id: str
    adam_params: AdamParams | None = None
    seq_id: int | None = None


class SaveWeightsRequest(TinkerModel):
    model_id: str
    path: str | None = None
    seq_id: int | None = None
    sampling_session_seq_id: int | None = None
    ttl_seconds: int | None = Field(default=None, ge=3600, le=315_360_000)
    """The checkpoint expires this long after it is saved (one hour to ten years; None: never)."""


class LoadWeightsRequest(TinkerModel):
    model_id: str | None = None
    session_id: str | None = None
    model_seq_id: int | None = None
    user_metadata: dict[str, Any] | None = None
    path: str
    optimizer: bool = False


class CreateSamplingSessionRequest(TinkerModel):
    session_id: str
    sampling_session_seq_id: int
    model_path: str | None = None
    base_model: str | None = None


class SamplingParams(TinkerModel):
    max_tokens: int | None = Field(default=None, ge=1)
    seed: int | None = None
    stop: str | list[str] | list[int] | None = None
    temperature: float = Field(default=1.0, ge=0)
    top_k: int = -1
    top_p: float = Field(default=1.0, gt=0, le=1)


class ModelInputChunk(TinkerModel):
    type: str = "encoded_text"
    tokens: list[int] = Field(default_factory=list)


class ModelInput(TinkerModel):
    chunks: list[ModelInputChunk]

    def tokens(self) -> list[int]:
        out: list[int] = []
        for chunk in self.chunks:
            out.extend(chunk.tokens)
        return out


class SampleRequest(TinkerModel):
    num_samples: int = Field(default=1, ge=1, le=128)
    prompt: ModelInput
    sampling_params: SamplingParams
    base_model: str | None = None
    model_path: str | None = None
    sampling_session_id: str | None = None
    seq_id: int | None = None
    prompt_logprobs: bool | None = None


class FutureRetrieveRequest(TinkerModel):
    request_id: str
    allow_metadata_only: bool = False


class WeightsInfoRequest(TinkerModel):
    tinker_path: str


class UntypedFuture(TinkerModel):
    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


def model_data(base_model: str, tokenizer: str) -> dict[str, Any]:
    """`ModelData` of a model on `base_model`; `tokenizer` is what the client's tokenizer loader is given."""
    return {"arch": "lora", "model_name": base_model, "tokenizer_id": tokenizer}

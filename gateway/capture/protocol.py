"""Shapes of capture: the admin settings, `metadata` as OpenAI bounds it, and the stored-completions API's
objects (OpenAI's `ChatCompletion`, `ChatCompletionStoreMessage`, `ChatCompletionDeleted`) built from rows."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from gateway.capture.store import CapturedRow, SettingRow
from gateway.errors import InvalidRequest
from gateway.protocol import OpenAIBaseModel

MAX_METADATA_PAIRS = 16
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512
MAX_RETENTION_DAYS = 3650
DEFAULT_RETENTION_DAYS = 30
"""OpenAI keeps stored completions 30 days."""


def check_metadata(value: Any, param: str = "metadata") -> dict[str, str]:
    """`metadata` as OpenAI takes it (null: none): at most 16 pairs of strings, keys of at most 64
    characters, values of at most 512; else a 400 naming `param`."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise InvalidRequest(
            f"Invalid type for '{param}': expected an object of string values.",
            param=param,
            code="invalid_type",
        )
    if len(value) > MAX_METADATA_PAIRS:
        raise InvalidRequest(
            f"Invalid '{param}': at most {MAX_METADATA_PAIRS} key-value pairs, got {len(value)}.",
            param=param,
            code="invalid_value",
        )
    for key, item in value.items():
        if len(key) > MAX_METADATA_KEY_CHARS:
            raise InvalidRequest(
                f"Invalid '{param}': key '{key[:20]}...' is longer than {MAX_METADATA_KEY_CHARS} characters.",
                param=param,
                code="invalid_value",
            )
        if not isinstance(item, str) or len(item) > MAX_METADATA_VALUE_CHARS:
            raise InvalidRequest(
                f"Invalid '{param}.{key}': expected a string of at most {MAX_METADATA_VALUE_CHARS} "
                "characters.",
                param=f"{param}.{key}",
                code="invalid_value",
            )
    return value


# ---- admin ------------------------------------------------------------------------------------------------
class CaptureUpdate(OpenAIBaseModel):
    """`POST /v1/admin/organizations/{org_id}/capture` and `/v1/admin/api_keys/{key_id}/capture`: capture on
    or off, and how many days records are kept (null: for ever). A key's setting overrides its
    organisation's."""

    enabled: bool
    retention_days: int | None = Field(default=DEFAULT_RETENTION_DAYS, ge=1, le=MAX_RETENTION_DAYS)


class CaptureSettingOut(OpenAIBaseModel):
    object: Literal["capture_setting"] = "capture_setting"
    organization_id: str
    api_key_id: str | None = None
    enabled: bool = False
    retention_days: int | None = None
    updated_at: int | None = None
    """Unix seconds; null for a subject that never had a setting (capture off)."""

    @classmethod
    def of(cls, org_id: str, key_id: str | None, row: SettingRow | None) -> CaptureSettingOut:
        if row is None:
            return cls(organization_id=org_id, api_key_id=key_id)
        return cls(
            organization_id=org_id,
            api_key_id=key_id,
            enabled=row.enabled,
            retention_days=row.retention_days,
            updated_at=int(row.updated_at.timestamp()),
        )


# ---- stored completions ----------------------------------------------------------------------------------
class CompletionUpdate(OpenAIBaseModel):
    """`POST /v1/chat/completions/{id}`: the metadata, replaced whole (null: none)."""

    metadata: dict[str, Any] | None


REQUEST_FIELDS = (
    "seed",
    "temperature",
    "top_p",
    "presence_penalty",
    "frequency_penalty",
    "tools",
    "tool_choice",
    "response_format",
)
"""Settings of the request that OpenAI's stored completion repeats (null where the request had none)."""


def stored_completion(row: CapturedRow, *, detail: bool) -> dict[str, Any]:
    """A stored completion as OpenAI's API shows it: the answer the client had, its `metadata` and the
    request's settings; `detail` (retrieve) adds tunegate's `capture` object, with the token ids (`row`
    whole: `gateway.capture.sequences`)."""
    response = row.response
    out: dict[str, Any] = {
        "id": row.id,
        "object": "chat.completion",
        "created": response.get("created", int(row.created_at.timestamp())),
        "model": row.model,
        "choices": response.get("choices", []),
        "usage": response.get("usage"),
        "system_fingerprint": response.get("system_fingerprint"),
        "service_tier": response.get("service_tier"),
        "metadata": row.metadata,
        "input_user": row.request.get("user"),
    }
    for name in REQUEST_FIELDS:
        out[name] = row.request.get(name)
    if detail:
        ids = row.completion_token_ids or []
        logprobs = row.logprobs or []
        count = max(len(ids), len(logprobs))
        out["capture"] = {
            "api_key_id": row.api_key_id,
            "episode_id": row.episode_id,
            "parent_episode_id": row.parent_episode_id,
            "stored": row.stored,
            "streamed": row.streamed,
            "base_model": row.base_model,
            "served_version": row.served_version,
            "request": row.request,
            "prompt_token_ids": row.prompt_token_ids,
            "choices": [
                {
                    "index": i,
                    "token_ids": ids[i] if i < len(ids) else None,
                    "logprobs": logprobs[i] if i < len(logprobs) else None,
                }
                for i in range(count)
            ],
            "previous_id": row.previous_id,
            "segment_break": row.segment_break,
            "stored_bytes": row.stored_bytes,
            "cost_usd": row.cost_usd,
            "finish_reason": row.finish_reason,
            "latency_ms": row.latency_ms,
            "status": row.status,
            "expires_at": int(row.expires_at.timestamp()) if row.expires_at is not None else None,
        }
    return out


def _is_text(part: Any) -> bool:
    return isinstance(part, dict) and isinstance(part.get("text"), str)


def stored_messages(row: CapturedRow) -> list[dict[str, Any]]:
    """The request's messages as OpenAI's `ChatCompletionStoreMessage`s, ids `<completion id>-<index>`."""
    messages = row.request.get("messages")
    out = []
    for i, message in enumerate(messages if isinstance(messages, list) else []):
        if not isinstance(message, dict):
            continue
        content = message.get("content")
        parts = None
        if isinstance(content, list):
            parts = content
            texts = [str(p["text"]) for p in content if _is_text(p)]
            content = "".join(texts) if texts else None
        item: dict[str, Any] = {
            "id": f"{row.id}-{i}",
            "role": message.get("role"),
            "content": content,
            "name": message.get("name"),
            "content_parts": parts,
        }
        for key in ("tool_calls", "tool_call_id", "refusal"):
            if key in message:
                item[key] = message[key]
        out.append(item)
    return out


def deleted(completion_id: str) -> dict[str, Any]:
    return {"id": completion_id, "object": "chat.completion.deleted", "deleted": True}


# ---- export ----------------------------------------------------------------------------------------------
MAX_EXPORT_EPISODES = 10_000


class ExportRequest(OpenAIBaseModel):
    """`POST /v1/episodes/export`: which episodes, which of their samples, and in which form
    (`gateway.capture.export`)."""

    format: Literal["jsonl", "tinker"] = "jsonl"
    """`jsonl`: samples (token ids, loss mask, logprobs, rewards); `tinker`: Tinker `Datum`s."""
    episode_ids: list[str] | None = Field(default=None, max_length=1000)
    metadata: dict[str, str] | None = None
    state: Literal["open", "closed", "abandoned"] | None = None
    model: str | None = None
    created_after: int | None = None
    created_before: int | None = None
    served_version: str | None = None
    """Only samples every call of which this model version served."""
    reward: str | None = Field(default=None, min_length=1, max_length=64)
    """The episode-level reward that is each sample's `reward` (the latest of any name when none)."""
    min_reward: float | None = None
    """Only samples whose reward is at least this."""
    best_of_group: bool = False
    """Only the best-rewarded samples of each group."""
    thumbs: Literal["up", "down"] | None = None
    """Only samples with that thumbs feedback on one of their calls (and none the other way)."""
    group_by: str | None = Field(default=None, min_length=1, max_length=64)
    """The episode metadata key whose value groups samples, for advantages and `best_of_group`."""
    max_staleness: int | None = Field(default=None, ge=0, le=1_000_000)
    """Only samples served by a model version at most this many versions older than the newest version that
    served the selection (versions ordered by the first call each served; null: every sample). Stale samples
    are dropped before advantages are computed."""
    limit: int = Field(default=1000, ge=1, le=MAX_EXPORT_EPISODES)
    """At most this many episodes, oldest first."""
    purpose: Literal["fine-tune"] | None = None
    """`fine-tune`: store the JSONL samples as a file of that purpose (a training file of token rows)
    and answer the file."""

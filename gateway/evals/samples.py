"""An output item's `sample` (OpenAI's shape) and the namespace graders read as `{{ sample.* }}`, from a chat
completion: one a run sampled (`gateway.worker.evals`) or one stored earlier (`gateway.evals.stored`)."""

from __future__ import annotations

from typing import Any

from envsdk.graders import make_sample


def sample_of(
    messages: list[dict[str, Any]],
    sampling: dict[str, Any],
    reply: dict[str, Any] | None,
    error: dict[str, str] | None,
    *,
    model: str,
) -> tuple[dict[str, Any], dict[str, Any]]:
    """`(sample, namespace)` of the completion `reply` to `messages` (None, with `error`, when there is none):
    `input`, `output`, `finish_reason`, `model` (the reply's, else `model`), `usage`, `error` and the
    sampling parameters used (`sampling`: `temperature` and `top_p` 1 unless given)."""
    choice = ((reply or {}).get("choices") or [{}])[0]
    message = choice.get("message") or {}
    text = message.get("content") or ""
    tools = [
        {"type": "function", "function": call.get("function", {})} for call in message.get("tool_calls") or []
    ]
    usage = (reply or {}).get("usage") or {}
    record = {
        "input": [{"role": m.get("role"), "content": m.get("content")} for m in messages],
        "output": [{"role": "assistant", "content": text}] if reply is not None else [],
        "finish_reason": choice.get("finish_reason") or "",
        "model": (reply or {}).get("model", model),
        "usage": {
            "prompt_tokens": int(usage.get("prompt_tokens") or 0),
            "completion_tokens": int(usage.get("completion_tokens") or 0),
            "total_tokens": int(usage.get("total_tokens") or 0),
            "cached_tokens": int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
        },
        "error": error,
        "temperature": sampling.get("temperature", 1.0),
        "top_p": sampling.get("top_p", 1.0),
        "max_completion_tokens": sampling.get("max_completion_tokens"),
        "seed": sampling.get("seed"),
    }
    namespace = make_sample(text, tools or None)
    namespace["model"] = record["model"]
    return record, namespace

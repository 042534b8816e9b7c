"""Token estimates made on the request path without a tokenizer: a request's prompt tokens and the most
completion tokens it may produce. The serving path (`gateway.serving.service`) reserves rate limits and budget
with them before the engine answers, and bills the estimated prompt of a stream that ended without usage."""

from __future__ import annotations

from typing import Any


def estimate_prompt_tokens(body: dict[str, Any]) -> int:
    """A cheap upper-ish estimate of a request's prompt tokens (about four characters a token, plus a few
    tokens of chat template per message), without a tokenizer on the request path."""
    chars = 0
    extra = 0
    messages = body.get("messages")
    if isinstance(messages, list):
        for m in messages:
            extra += 4
            if isinstance(m, dict):
                content = m.get("content")
                if isinstance(content, str):
                    chars += len(content)
                elif isinstance(content, list):
                    chars += sum(len(str(p.get("text", ""))) for p in content if isinstance(p, dict))
                if m.get("tool_calls"):
                    chars += len(str(m["tool_calls"]))
    prompt = body.get("prompt")
    if isinstance(prompt, str):
        chars += len(prompt)
    elif isinstance(prompt, list):
        for p in prompt:
            chars += len(p) if isinstance(p, str) else (len(p) * 4 if isinstance(p, list) else 4)
    if body.get("tools"):
        chars += len(str(body["tools"]))
    return chars // 4 + extra + 1


def requested_max_tokens(body: dict[str, Any], default: int) -> int:
    """Completion tokens a request may produce: `max_completion_tokens` or `max_tokens` (else `default`),
    times `n`."""
    value = body.get("max_completion_tokens") or body.get("max_tokens") or default
    n = body.get("n") or 1
    try:
        return max(1, int(value)) * max(1, int(n))
    except (TypeError, ValueError):
        return default

"""A small synchronous client for OpenAI-compatible chat completions, used by model graders.

Model graders (``score_model``, ``label_model``) ask a served model for a judgement. The trainer points this
client at ``inference_base_url`` from its spec; the gateway points it at the base model's engine. ``httpx``
only (imported when a client is made), no torch, so the graders stay importable by the control plane.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)


class InferenceError(RuntimeError):
    """The grader model could not answer: a transport or HTTP error, or a refusal (``refusal=True``)."""

    def __init__(self, message: str, *, refusal: bool = False) -> None:
        super().__init__(message)
        self.refusal = refusal


@dataclass
class ChatReply:
    """One chat completion reduced to what graders read."""

    text: str
    """The assistant message content ('' when empty)."""
    usage: dict[str, int] = field(default_factory=dict)
    """``prompt_tokens``, ``completion_tokens``, ``total_tokens`` as reported by the server."""


class InferenceClient:
    """Calls ``POST {base_url}/chat/completions``; ``base_url`` ends in ``/v1`` as for the openai SDK."""

    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 2,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self._client = httpx.Client(
            base_url=self.base_url, headers=headers, timeout=timeout, transport=transport
        )

    def close(self) -> None:
        """Release the connection pool."""
        self._client.close()

    def __enter__(self) -> InferenceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def chat(self, model: str, messages: list[dict[str, Any]], **sampling: Any) -> ChatReply:
        """Ask ``model`` for one completion; sampling params (``temperature``, ``max_completion_tokens``...)
        are passed through. Retries connection errors and 5xx/429 answers ``max_retries`` times."""
        import httpx

        body: dict[str, Any] = {"model": model, "messages": messages, **sampling}
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            try:
                resp = self._client.post("/chat/completions", json=body)
            except httpx.HTTPError as exc:
                last = exc
                logger.warning("grader model request failed (attempt %d): %s", attempt + 1, exc)
                continue
            if resp.status_code >= 500 or resp.status_code == 429:
                last = InferenceError(f"grader model answered HTTP {resp.status_code}: {resp.text[:200]}")
                continue
            if resp.status_code >= 400:
                raise InferenceError(f"grader model answered HTTP {resp.status_code}: {resp.text[:200]}")
            return _parse_reply(resp.json())
        raise InferenceError(f"grader model unreachable at {self.base_url}: {last}")


def _parse_reply(data: dict[str, Any]) -> ChatReply:
    try:
        message = data["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise InferenceError("grader model returned no choices") from None
    if message.get("refusal"):
        raise InferenceError(f"grader model refused: {message['refusal']}", refusal=True)
    usage = {k: int(v) for k, v in (data.get("usage") or {}).items() if isinstance(v, int)}
    return ChatReply(text=message.get("content") or "", usage=usage)

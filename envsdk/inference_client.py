"""A small synchronous client for OpenAI-compatible chat completions, used by model graders.

Model graders (``score_model``, ``label_model``) ask a served model for a judgement. Under tunegate every
such call goes to the gateway's own ``/v1/chat/completions`` with a key of the organisation the grading is
for (the caller's key in ``graders/run``, a key minted for the eval run or the training job), so the model is
checked to be the organisation's, and the call is rate-limited, held to the budget and metered like any
other. The trainer points this client at ``inference_base_url`` from its spec. ``httpx`` only (imported
when a client is made), no torch, so the graders stay importable by the control plane.

A refusal keeps what the server said: ``InferenceError.status`` and ``.error`` (OpenAI's error object), so
a caller can answer it as its own (the gateway answers a grader's 404 or 429 as the request's). A 429 that
asks to wait a little (``retry-after`` up to ``max_wait_s``) is waited out and retried; one for the budget
(``insufficient_quota``) is not.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import httpx

logger = logging.getLogger(__name__)


class InferenceError(RuntimeError):
    """The grader model could not answer: a transport or HTTP error, or a refusal by the model
    (``refusal=True``)."""

    def __init__(
        self,
        message: str,
        *,
        refusal: bool = False,
        status: int | None = None,
        error: dict[str, Any] | None = None,
        retry_after: str | None = None,
    ) -> None:
        super().__init__(message)
        self.refusal = refusal
        self.status = status
        """The HTTP status of an error answer (None: no answer, or a refusal by the model)."""
        self.error = error
        """OpenAI's error object of that answer (``message``, ``type``, ``param``, ``code``), if any."""
        self.retry_after = retry_after
        """The answer's ``retry-after`` header, if any."""


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
        max_wait_s: float = 10.0,
        transport: httpx.BaseTransport | None = None,
    ) -> None:
        import httpx

        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self.max_retries = max_retries
        self.max_wait_s = max_wait_s
        """Longest ``retry-after`` of a rate-limited answer that is waited out (when a retry is left)."""
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
        are passed through. Retries connection errors and 5xx answers ``max_retries`` times, and a 429 whose
        ``retry-after`` is at most ``max_wait_s`` after that wait; raises ``InferenceError`` (with the
        answer's ``status`` and ``error``) otherwise."""
        import httpx

        body: dict[str, Any] = {"model": model, "messages": messages, **sampling}
        last: Exception | None = None
        for attempt in range(self.max_retries + 1):
            more = attempt < self.max_retries
            try:
                resp = self._client.post("/chat/completions", json=body)
            except httpx.HTTPError as exc:
                last = exc
                logger.warning("grader model request failed (attempt %d): %s", attempt + 1, exc)
                continue
            if resp.status_code < 400:
                return _parse_reply(resp.json())
            refused = _refusal(resp)
            if resp.status_code >= 500 and more:
                last = refused
                continue
            if resp.status_code == 429 and more and (refused.error or {}).get("code") != "insufficient_quota":
                wait = _seconds(refused.retry_after)
                if wait is not None and wait <= self.max_wait_s:
                    time.sleep(wait)
                    continue
            raise refused
        raise InferenceError(f"grader model unreachable at {self.base_url}: {last}")


def _seconds(value: str | None) -> float | None:
    try:
        return max(0.0, float(value)) if value is not None else None
    except ValueError:
        return None


def _refusal(resp: httpx.Response) -> InferenceError:
    """An error answer as an ``InferenceError``: OpenAI's error object when the body is one."""
    error: dict[str, Any] | None = None
    try:
        data = resp.json()
    except ValueError:
        data = None
    if isinstance(data, dict) and isinstance(data.get("error"), dict):
        error = {k: data["error"].get(k) for k in ("message", "type", "param", "code")}
    said = str(error.get("message")) if error and error.get("message") else resp.text[:200]
    code = f" ({error['code']})" if error and error.get("code") else ""
    return InferenceError(
        f"grader model answered HTTP {resp.status_code}{code}: {said[:500]}",
        status=resp.status_code,
        error=error,
        retry_after=resp.headers.get("retry-after"),
    )


def _parse_reply(data: dict[str, Any]) -> ChatReply:
    try:
        message = data["choices"][0]["message"]
    except (KeyError, IndexError, TypeError):
        raise InferenceError("grader model returned no choices") from None
    if message.get("refusal"):
        raise InferenceError(f"grader model refused: {message['refusal']}", refusal=True)
    usage = {k: int(v) for k, v in (data.get("usage") or {}).items() if isinstance(v, int)}
    return ChatReply(text=message.get("content") or "", usage=usage)

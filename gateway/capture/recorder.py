"""Capture of a chat completion on the request path: what the engine is asked for on its behalf, what the
client is shown, and what is recorded.

`gateway.capture.capturer.Capturer.begin` decides which request is captured: for an organisation or key
with capture on, a chat completion that says `store: true` or carries an episode header
(`EPISODE_HEADERS`); then its `metadata` is checked as OpenAI checks it, and the engine is asked for the
token ids and log-probabilities (`Capture.engine_fields`). What
the client did not ask for is taken out of the answer again (`Capture.response` for a whole answer,
`Capture.event` for each event of a stream, which accumulates the stream as it passes), so the client sees
what it would see without capture. The record goes to `gateway.capture.writer`, written in batches by a
background task: the request path never writes to the database.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, ClassVar

import orjson

from gateway.capture.store import CapturedRow
from gateway.capture.writer import CaptureWriter
from gateway.errors import InvalidRequest
from gateway.serving.engines import Target
from gateway.serving.protocol import ProxyRequest
from gateway.settings import Settings
from gateway.tenancy.keys import Principal
from gateway.usage.pricing import completion_cost

logger = logging.getLogger(__name__)

CHAT_PATH = "/v1/chat/completions"
EPISODE_HEADERS = {
    b"x-episode-id": "episode",
    b"x-parent-episode-id": "parent",
    b"x-session-id": "episode",  # opencode
    b"x-parent-session-id": "parent",
    b"x-rollout-id": "rollout",  # Agent Lightning: the rollout, and its attempt
    b"x-attempt-id": "attempt",
}
"""Headers that name the episode of a call (and its parent). Agent Lightning's attempt is the episode, its
rollout the parent; a rollout without an attempt is the episode."""
MAX_EPISODE_ID_CHARS = 256


def episode_of(headers: list[tuple[bytes, bytes]]) -> tuple[str | None, str | None]:
    """The episode and parent episode the request's headers name; a 400 naming a header that is empty or
    longer than `MAX_EPISODE_ID_CHARS`."""
    found: dict[str, str] = {}
    for name, value in headers:
        role = EPISODE_HEADERS.get(name.lower())
        if role is None:
            continue
        text = value.decode("latin-1").strip()
        if not text or len(text) > MAX_EPISODE_ID_CHARS:
            raise InvalidRequest(
                f"The header '{name.decode('latin-1')}' must name an episode in 1 to "
                f"{MAX_EPISODE_ID_CHARS} characters.",
                param=name.decode("latin-1"),
                code="invalid_value",
            )
        found[role] = text
    episode, parent = found.get("episode"), found.get("parent")
    if episode is None and "attempt" in found:
        episode, parent = found["attempt"], parent or found.get("rollout")
    elif episode is None and "rollout" in found:
        episode = found["rollout"]
    return episode, parent


def _logprob_values(choice: dict[str, Any]) -> tuple[list[dict[str, Any]], list[float]] | None:
    """A choice's `logprobs.content` items and their log-probabilities, where it has them."""
    lp = choice.get("logprobs")
    content = lp.get("content") if isinstance(lp, dict) else None
    if not isinstance(content, list):
        return None
    return content, [float(item["logprob"]) for item in content if isinstance(item, dict)]


@dataclass(slots=True)
class _Choice:
    """One choice of a stream, as it accumulates."""

    content: str = ""
    tool_calls: dict[int, dict[str, Any]] = field(default_factory=dict)
    finish_reason: str | None = None
    logprob_items: list[dict[str, Any]] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    saw_ids: bool = False

    def add_tool_calls(self, calls: list[Any]) -> None:
        for call in calls:
            if not isinstance(call, dict):
                continue
            index = call.get("index", len(self.tool_calls))
            held = self.tool_calls.setdefault(index, {"id": None, "type": "function", "function": {}})
            for key in ("id", "type"):
                if call.get(key):
                    held[key] = call[key]
            fn = call.get("function")
            if isinstance(fn, dict):
                for key in ("name", "arguments"):
                    if isinstance(fn.get(key), str):
                        held["function"][key] = held["function"].get(key, "") + fn[key]

    def message(self) -> dict[str, Any]:
        """The assistant message the stream amounts to, as a whole answer gives it."""
        calls = [self.tool_calls[k] for k in sorted(self.tool_calls)]
        content = self.content if self.content or not calls else None
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None}
        if calls:
            message["tool_calls"] = calls
        return message


@dataclass(slots=True)
class Capture:
    """One captured request: what the client asked for, and (for a stream) the answer as it passes."""

    TEXT: ClassVar[bool] = False
    """Whether the calls captured are text completions (`gateway.capture.text_capture`)."""

    writer: CaptureWriter
    who: Principal
    proxy: ProxyRequest
    target: Target
    metadata: dict[str, str]
    stored: bool
    episode_id: str | None
    parent_episode_id: str | None
    retention_days: int | None
    settings: Settings
    started: float = field(default_factory=time.time)
    nulls: bool = False
    """The engine writes the token-id fields as null when they are not asked for (vLLM, which then also
    writes `prompt_text`): they are put back so, else taken out."""
    id: str | None = None
    created: int | None = None
    prompt_token_ids: list[int] | None = None
    choices: dict[int, _Choice] = field(default_factory=dict)

    @property
    def asked_ids(self) -> bool:
        return self.proxy.body.get("return_token_ids") is True

    @property
    def asked_logprobs(self) -> bool:
        return self.proxy.body.get("logprobs") is True

    def engine_fields(self) -> dict[str, Any]:
        """What the engine is asked for on top of the client's request: token ids, and log-probabilities
        (unless the client's `top_logprobs` without `logprobs` is to get the engine's refusal)."""
        fields: dict[str, Any] = {"return_token_ids": True}
        if self.proxy.body.get("top_logprobs") is None:
            fields["logprobs"] = True
        return fields

    def _take(self, obj: dict[str, Any], key: str, keep: bool) -> list[Any] | None:
        """`obj[key]` when a list; taken out of `obj` (or nulled, see `nulls`) unless the client asked."""
        value = obj.get(key)
        if not keep and key in obj:
            if self.nulls:
                obj[key] = None
            else:
                del obj[key]
        return value if isinstance(value, list) else None

    # ---- a whole answer ---------------------------------------------------------------------------------
    def response(
        self, raw: bytes, fingerprint: str, status: int
    ) -> tuple[bytes, dict[str, Any] | None] | None:
        """The client's answer from the engine's (`model` and `system_fingerprint` rewritten as
        `rewrite_response` does, the extra fields taken out) and its usage, the call recorded; None when the
        answer is not a JSON object (the caller passes it on as it is)."""
        try:
            data = orjson.loads(raw)
        except orjson.JSONDecodeError:
            return None
        if not isinstance(data, dict):
            return None
        self.nulls = "prompt_text" in data
        ids, logprobs = self._sampled(data)
        if "model" in data:
            data["model"] = self.proxy.model
            data["system_fingerprint"] = fingerprint
        out = orjson.dumps(data)
        usage = data.get("usage")
        usage = usage if isinstance(usage, dict) else None
        if isinstance(data.get("id"), str):
            self._record(data, ids, logprobs, usage, status=status, streamed=False)
        return out, usage

    def _sampled(self, data: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
        """A whole answer's prompt ids, and each choice's sampled ids and log-probabilities; the fields the
        client did not ask for taken out of `data`."""
        self.prompt_token_ids = self._take(data, "prompt_token_ids", self.asked_ids)
        ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        choices = data.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            ids.append(self._take(choice, "token_ids", self.asked_ids) or [])
            found = _logprob_values(choice)
            logprobs.append(found[1] if found is not None else [])
            if not self.asked_logprobs and "logprobs" in choice:
                choice["logprobs"] = None
        return ids, logprobs

    # ---- a stream ---------------------------------------------------------------------------------------
    def event(self, event: dict[str, Any]) -> None:
        """One event of the stream (before `StreamRewriter` rewrites it): accumulated, and the fields the
        client did not ask for taken out of it."""
        if "prompt_token_ids" in event:
            self.nulls = "prompt_text" in event
            ids = self._take(event, "prompt_token_ids", self.asked_ids)
            if ids is not None:
                self.prompt_token_ids = ids
        self._note_id(event)
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            index = choice.get("index", 0)
            acc = self.choices.get(index)
            if acc is None:
                acc = self.choices[index] = _Choice()
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if isinstance(delta.get("content"), str):
                    acc.content += delta["content"]
                if isinstance(delta.get("tool_calls"), list):
                    acc.add_tool_calls(delta["tool_calls"])
            if choice.get("finish_reason"):
                acc.finish_reason = choice["finish_reason"]
            found = _logprob_values(choice)
            if found is not None:
                acc.logprob_items.extend(found[0])
                acc.logprobs.extend(found[1])
            if not self.asked_logprobs and "logprobs" in choice:
                choice["logprobs"] = None
            ids = self._take(choice, "token_ids", self.asked_ids)
            if ids is not None:
                acc.token_ids.extend(ids)
                acc.saw_ids = True

    def _note_id(self, event: dict[str, Any]) -> None:
        """The stream's id and time, from its first event that has them."""
        if self.id is None and isinstance(event.get("id"), str):
            self.id = event["id"]
            created = event.get("created")
            self.created = created if isinstance(created, int) else None

    def _stream_answer(
        self, kind: str, choices: list[dict[str, Any]], fingerprint: str, usage: dict[str, Any] | None
    ) -> dict[str, Any]:
        """The whole answer (of object `kind`) a stream amounts to, as the client would have got it."""
        return {
            "id": self.id,
            "object": kind,
            "created": self.created if self.created is not None else int(self.started),
            "model": self.proxy.model,
            "system_fingerprint": fingerprint,
            "choices": choices,
            "usage": usage,
        }

    def finish_stream(self, fingerprint: str, usage: dict[str, Any] | None, status: int) -> None:
        """The stream ended (whole, broken or left): the answer it amounts to is recorded, when one began."""
        if self.id is None:
            return
        choices = []
        for index in sorted(self.choices):
            acc = self.choices[index]
            lp = {"content": acc.logprob_items, "refusal": None} if self.asked_logprobs else None
            choices.append(
                {"index": index, "message": acc.message(), "finish_reason": acc.finish_reason, "logprobs": lp}
            )
        response = self._stream_answer("chat.completion", choices, fingerprint, usage)
        ids = [self.choices[i].token_ids for i in sorted(self.choices)]
        logprobs = [self.choices[i].logprobs for i in sorted(self.choices)]
        self._record(response, ids, logprobs, usage, status=status, streamed=True)

    # ---- the record -------------------------------------------------------------------------------------
    def _record(
        self,
        response: dict[str, Any],
        ids: list[list[int]],
        logprobs: list[list[float]],
        usage: dict[str, Any] | None,
        *,
        status: int,
        streamed: bool,
    ) -> None:
        now = time.time()
        created = datetime.fromtimestamp(self.started, UTC)
        choices = response.get("choices") or []
        first = choices[0] if choices and isinstance(choices[0], dict) else {}
        usage = usage or {}
        has_ids = any(ids) or self.prompt_token_ids is not None
        prompt_tokens = int(usage.get("prompt_tokens") or 0)
        completion_tokens = int(usage.get("completion_tokens") or 0)
        self.writer.add(
            CapturedRow(
                organization_id=self.who.organization_id,
                id=str(response["id"]),
                api_key_id=self.who.api_key_id,
                episode_id=self.episode_id,
                parent_episode_id=self.parent_episode_id,
                stored=self.stored,
                streamed=streamed,
                model=self.proxy.model,
                base_model=self.target.base_model,
                served_version=self.target.served_version,
                request={k: v for k, v in self.proxy.body.items() if k != "metadata"},
                response=response,
                metadata=self.metadata,
                prompt_token_ids=self.prompt_token_ids,
                completion_token_ids=ids if has_ids else None,
                logprobs=logprobs if any(logprobs) else None,
                finish_reason=first.get("finish_reason"),
                prompt_tokens=prompt_tokens,
                completion_tokens=completion_tokens,
                latency_ms=int((now - self.started) * 1000),
                status=status,
                created_at=created,
                expires_at=created + timedelta(days=self.retention_days)
                if self.retention_days is not None
                else None,
                cost_usd=completion_cost(
                    self.settings, self.target.base_model, prompt_tokens, completion_tokens
                ),
                text_completion=self.TEXT,
            )
        )

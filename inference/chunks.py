"""The envelopes of an answer, whole or streamed, shared by chat and completions.

``answer`` is a whole ``chat.completion`` or ``text_completion``: ``id``, ``object``, ``created``,
``model``, ``system_fingerprint: null``, the choices and the ``usage``. A stream is ``data: {chunk}``
lines, then ``data: [DONE]``. Every chunk of one answer carries the same envelope (``id``, ``object``,
``created``, ``model``, ``system_fingerprint: null``) around one choice's piece, plus ``usage: null`` when
the client asked for usage (``stream_options.include_usage``), which then comes alone in a last chunk with
no choices. ``ChunkStream`` writes that envelope once for both ``chat.completion.chunk``
(``inference.chat``) and ``text_completion`` (``inference.completions``).
"""

from __future__ import annotations

import json
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

DONE = "data: [DONE]\n\n"
"""The last line of every stream."""


def event(body: dict[str, Any]) -> str:
    """One ``data:`` line of ``body`` as JSON."""
    return "data: " + json.dumps(body) + "\n\n"


def usage(prompt: int, completion: int) -> dict[str, int]:
    """OpenAI's ``usage`` object."""
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def answer_id(prefix: str) -> str:
    """A fresh answer id: ``chatcmpl-...`` or ``cmpl-...``."""
    return prefix + secrets.token_hex(12)


def answer(
    object: str, id_prefix: str, model: str, choices: list[dict[str, Any]], prompt: int, completion: int
) -> dict[str, Any]:
    """A whole answer (``object``: ``chat.completion`` or ``text_completion``) of ``choices``, with the
    usage of ``prompt`` and ``completion`` tokens."""
    return {
        "id": answer_id(id_prefix),
        "object": object,
        "created": int(time.time()),
        "model": model,
        "system_fingerprint": None,
        "choices": choices,
        "usage": usage(prompt, completion),
    }


@dataclass(frozen=True)
class ChunkStream:
    """The chunks of one streamed answer (see the module)."""

    object: str
    """``chat.completion.chunk`` or ``text_completion``."""
    model: str
    include_usage: bool
    id: str
    created: int = field(default_factory=lambda: int(time.time()))
    fingerprint_with_usage: bool = True
    """Whether the last, usage-only chunk names ``system_fingerprint`` too (the chat chunk does, the legacy
    completion's does not)."""

    def choice(self, piece: dict[str, Any], extra: dict[str, Any] | None = None) -> str:
        """The chunk of one choice's ``piece`` (``index``, ``delta`` or ``text``, ``logprobs``,
        ``finish_reason``), with ``extra`` top-level fields (a first chunk's ``prompt_token_ids``)."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
            "system_fingerprint": None,
            "choices": [piece],
        }
        if self.include_usage:
            body["usage"] = None
        if extra:
            body.update(extra)
        return event(body)

    def usage(self, prompt: int, completion: int) -> str:
        """The last chunk, with the whole answer's usage and no choices."""
        body: dict[str, Any] = {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.model,
        }
        if self.fingerprint_with_usage:
            body["system_fingerprint"] = None
        body["choices"] = []
        body["usage"] = usage(prompt, completion)
        return event(body)

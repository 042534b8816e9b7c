"""Capture of legacy text completions (`POST /v1/completions`), as chat's (`gateway.capture.recorder`).

A text completion is captured when it is a call of an episode (an episode header or an episode key; OpenAI
stores no text completions, so `store` alone does not capture one). It must then name one prompt (a text or
a list of token ids), so its record has one prompt. The engine is asked for the token ids
(`return_token_ids`: both engines put `prompt_token_ids` and `token_ids` on each choice, a stream's first
chunk of a choice carrying the prompt's) and for the sampled tokens' log-probabilities (the legacy
`logprobs: 0`, whose `token_logprobs` are read); what the client did not ask for is taken out again, so it
sees what it would see without capture. The record is a `text_completion` with the prompt's ids, the
sampled ids and log-probabilities of each choice: it joins its episode's sequence
(`gateway.capture.sequences`) as a chat call does, and the stored chat completions API does not list it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from gateway.capture.recorder import Capture
from gateway.errors import InvalidRequest

COMPLETIONS_PATH = "/v1/completions"
TEXT_OBJECT = "text_completion"


def check_one_prompt(body: dict[str, Any]) -> None:
    """A 400 naming `prompt` unless the request names one prompt: a text, or a list of token ids."""
    prompt = body.get("prompt")
    if isinstance(prompt, str) or (isinstance(prompt, list) and all(isinstance(t, int) for t in prompt)):
        return
    if isinstance(prompt, list) and len(prompt) == 1:
        return
    raise InvalidRequest(
        "A captured completion takes one prompt (a text or a list of token ids): send the prompts of a "
        "batch as calls of their own.",
        param="prompt",
        code="invalid_value",
    )


def _sampled_logprobs(choice: dict[str, Any], count: int) -> list[float]:
    """The log-probabilities of a choice's `count` sampled tokens (the last of `token_logprobs`: an echoed
    prompt's come first)."""
    lp = choice.get("logprobs")
    values = lp.get("token_logprobs") if isinstance(lp, dict) else None
    if not isinstance(values, list):
        return []
    tail = values[len(values) - count :] if count else []
    return [float(v) for v in tail if isinstance(v, int | float)]


@dataclass(slots=True)
class _TextChoice:
    """One choice of a text stream, as it accumulates."""

    text: str = ""
    finish_reason: str | None = None
    token_ids: list[int] = field(default_factory=list)
    logprobs: dict[str, list[Any]] = field(
        default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    )


@dataclass(slots=True)
class TextCapture(Capture):
    """One captured text completion."""

    TEXT: ClassVar[bool] = True
    text_choices: dict[int, _TextChoice] = field(default_factory=dict)

    @property
    def asked_logprobs(self) -> bool:
        return self.proxy.body.get("logprobs") is not None

    def engine_fields(self) -> dict[str, Any]:
        fields: dict[str, Any] = {"return_token_ids": True}
        if self.proxy.body.get("logprobs") is None:
            fields["logprobs"] = 0
        return fields

    def _choice(self, choice: dict[str, Any]) -> tuple[list[int], list[float]]:
        """A choice's sampled ids and log-probabilities; the fields the client did not ask for taken out
        (the prompt's ids kept from the first choice that has them)."""
        self.nulls = "stop_reason" in choice  # vLLM writes the id fields as null when not asked for
        prompt = self._take(choice, "prompt_token_ids", self.asked_ids)
        if prompt is not None and self.prompt_token_ids is None:
            self.prompt_token_ids = prompt
        ids = self._take(choice, "token_ids", self.asked_ids) or []
        logprobs = _sampled_logprobs(choice, len(ids))
        if not self.asked_logprobs and "logprobs" in choice:
            choice["logprobs"] = None
        return ids, logprobs

    def _sampled(self, data: dict[str, Any]) -> tuple[list[list[int]], list[list[float]]]:
        ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        choices = data.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if isinstance(choice, dict):
                got, lps = self._choice(choice)
                ids.append(got)
                logprobs.append(lps)
        return ids, logprobs

    def event(self, event: dict[str, Any]) -> None:
        self._note_id(event)
        choices = event.get("choices")
        for choice in choices if isinstance(choices, list) else ():
            if not isinstance(choice, dict):
                continue
            acc = self.text_choices.setdefault(choice.get("index", 0), _TextChoice())
            lp = choice.get("logprobs")
            if isinstance(lp, dict):
                for key, held in acc.logprobs.items():
                    if isinstance(lp.get(key), list):
                        held.extend(lp[key])
            ids, _ = self._choice(choice)
            acc.token_ids.extend(ids)
            if isinstance(choice.get("text"), str):
                acc.text += choice["text"]
            if choice.get("finish_reason"):
                acc.finish_reason = choice["finish_reason"]

    def finish_stream(self, fingerprint: str, usage: dict[str, Any] | None, status: int) -> None:
        if self.id is None:
            return
        order = sorted(self.text_choices)
        choices = [
            {
                "index": i,
                "text": self.text_choices[i].text,
                "finish_reason": self.text_choices[i].finish_reason,
                "logprobs": self.text_choices[i].logprobs if self.asked_logprobs else None,
            }
            for i in order
        ]
        response = self._stream_answer(TEXT_OBJECT, choices, fingerprint, usage)
        ids = [self.text_choices[i].token_ids for i in order]
        logprobs = [
            _sampled_logprobs({"logprobs": self.text_choices[i].logprobs}, len(ids[n]))
            for n, i in enumerate(order)
        ]
        self._record(response, ids, logprobs, usage, status=status, streamed=True)

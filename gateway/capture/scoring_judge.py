"""A group judge (RULER's way): one model reads the episodes of one group (the attempts at one task) in one
prompt and scores each in [0, 1], relative to the others.

Every call is a chat of the caller's key on the gateway's own `POST /v1/chat/completions`
(`Settings.internal_gateway_url`), as `gateway.serving.calls` makes model graders' calls: the model lookup,
rate limits, budget, usage rows and billing are the chat route's. A refusal of the call itself (429 rate
limit or quota, 404 model, 401/403 key: `RELAYED_STATUSES`) is the request's own answer; any other failure
(a prompt too long for the judge, an engine down) is an error of the group.

Two methods (`GroupJudge.method`):

* `answer`: one call per group; the judge answers `{"scores": [...]}` (`response_format` `json_object`).
  `parse_scores` reads it leniently (a JSON object or list anywhere in the text, `{"1": 0.5}`,
  `[{"trajectory": 1, "score": 0.5}]`, or `Trajectory 1: 0.5` lines); every score must be a finite number
  in [0, 1], one per episode. An answer that does not parse is shown back to the judge with the reason, up
  to `max_retries` more times, then the group fails with `judge_parse_error`.
* `logprobs`: one call per episode, each with the whole listing, asked for one digit 0-9 for that episode
  (`top_logprobs` 20, `DIGIT_POSITIONS` tokens); at the first position of the answer where digits are among
  the likeliest tokens, the score is their probability-weighted mean / 9. Readable from any model that
  returns log-probabilities, however small (no digit among them at any position: `judge_parse_error`).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any

import httpx

from gateway.capture.scoring_protocol import GroupJudge
from gateway.errors import MAX_MESSAGE_CHARS
from gateway.serving.calls import CALL_TIMEOUT_S, RELAYED_STATUSES, relayed

MAX_TRAJECTORY_CHARS = 4000
"""Characters of one episode's transcript the judge reads (its start and its end where longer)."""
TOP_LOGPROBS = 20
DIGIT_POSITIONS = 4
"""`logprobs`: the judge's answer tokens searched for the first position where a digit is among its likeliest
tokens (a small model may open with a space or a word)."""

SYSTEM = (
    "You are a strict judge. You are shown several trajectories: attempts by an assistant at the same task. "
    "Score each trajectory from 0 (worst) to 1 (best) by how well it achieves the task, comparing them with "
    "each other: a better trajectory gets a higher score."
)
ANSWER_FORMAT = (
    'Answer with JSON only, one score per trajectory in order: {{"scores": [{example}]}}. '
    "Each score is a number from 0 to 1."
)


class JudgeFailed(Exception):
    """A group the judge could not score: `code` and `message` go to each of its episodes."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message[:MAX_MESSAGE_CHARS]


@dataclass
class JudgeUsage:
    """The judge's calls of one request, and their tokens as the chat route answered them."""

    calls: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0

    def add(self, usage: Any) -> None:
        self.calls += 1
        if isinstance(usage, dict):
            self.prompt_tokens += int(usage.get("prompt_tokens") or 0)
            self.completion_tokens += int(usage.get("completion_tokens") or 0)


@dataclass
class Trajectory:
    episode_id: str
    messages: list[dict[str, Any]] = field(default_factory=list)


# ---- the prompt -------------------------------------------------------------------------------------------
def _content_text(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(str(p.get("text")) for p in content if isinstance(p, dict) and "text" in p)
    return "" if content is None else json.dumps(content)


def transcript(messages: list[dict[str, Any]]) -> str:
    """A conversation as `role: content` lines (tool calls as JSON), cut to `MAX_TRAJECTORY_CHARS`."""
    lines = []
    for message in messages:
        if not isinstance(message, dict):
            continue
        text = _content_text(message.get("content"))
        if message.get("tool_calls"):
            text += (" " if text else "") + "tool calls: " + json.dumps(message["tool_calls"])
        lines.append(f"{message.get('role', '?')}: {text}")
    out = "\n".join(lines)
    if len(out) > MAX_TRAJECTORY_CHARS:
        head = MAX_TRAJECTORY_CHARS // 4
        out = out[:head] + "\n[...]\n" + out[-(MAX_TRAJECTORY_CHARS - head) :]
    return out


def listing(judge: GroupJudge, group: str, trajectories: list[Trajectory]) -> str:
    """The user message that shows the group's trajectories, numbered from 1 (the judge's instructions open
    it: no system message, which some chat templates and small models handle poorly)."""
    parts = [SYSTEM, f"Task: the episodes whose {judge.group_by} is {group!r}."]
    if judge.rubric:
        parts.append(f"Rubric: {judge.rubric}")
    parts.append(f"There are {len(trajectories)} trajectories.")
    for i, t in enumerate(trajectories, 1):
        parts.append(f"<trajectory {i}>\n{transcript(t.messages)}\n</trajectory {i}>")
    return "\n\n".join(parts)


def answer_format(n: int) -> str:
    return ANSWER_FORMAT.format(example=", ".join(["0.5"] * n))


# ---- reading an answer ------------------------------------------------------------------------------------
_LINE = re.compile(r"trajectory\s*#?\s*(\d+)[^\d\n]{0,20}?(-?\d+(?:\.\d+)?)", re.IGNORECASE)


def _number(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int | float):
        return float(value)
    if isinstance(value, str):
        try:
            return float(value.strip())
        except ValueError:
            return None
    if isinstance(value, dict):
        for key in ("score", "value", "reward"):
            if key in value:
                return _number(value[key])
    return None


def _indexed(pairs: list[tuple[Any, Any]], n: int) -> list[float | None] | None:
    """Scores keyed by trajectory number (1..n, or 'trajectory_3'), in order; None unless all n are there."""
    out: list[float | None] = [None] * n
    for key, value in pairs:
        digits = re.findall(r"\d+", str(key))
        if not digits:
            return None
        index = int(digits[-1]) - 1
        if not 0 <= index < n:
            return None
        out[index] = _number(value)
    return out if all(v is not None for v in out) else None


def _from_json(data: Any, n: int) -> list[float | None] | None:
    if isinstance(data, dict):
        for key in ("scores", "score", "rankings", "results"):
            if key in data:
                return _from_json(data[key], n)
        return _indexed(list(data.items()), n)
    if isinstance(data, list):
        if len(data) == n and all(isinstance(d, dict) for d in data):
            keyed = [
                (d.get("trajectory", d.get("id", d.get("index"))), d) for d in data if isinstance(d, dict)
            ]
            if all(k is not None for k, _ in keyed):
                return _indexed(keyed, n)
        if len(data) == n:
            return [_number(d) for d in data]
    return None


def _json_values(text: str) -> list[Any]:
    """Every JSON object or list that starts somewhere in `text` (fences and prose around them ignored)."""
    decoder = json.JSONDecoder()
    found = []
    for i, ch in enumerate(text):
        if ch in "{[":
            try:
                value, _ = decoder.raw_decode(text, i)
            except ValueError:
                continue
            found.append(value)
    return found


def parse_scores(text: str, n: int) -> tuple[list[float] | None, str]:
    """The `n` scores an answer gives, each a finite number in [0, 1]; else None and why not."""
    candidates = [_from_json(value, n) for value in _json_values(text)]
    lines = _LINE.findall(text)
    if lines:
        candidates.append(_indexed(lines, n))
    why = f"no {n} scores found"
    for scores in candidates:
        if scores is None:
            continue
        if any(s is None or not math.isfinite(s) for s in scores):
            why = "a score is not a finite number"
            continue
        if any(not 0.0 <= float(s) <= 1.0 for s in scores if s is not None):
            why = "a score is outside [0, 1]"
            continue
        return [float(s) for s in scores if s is not None], ""
    return None, why


def digit_score(top: list[dict[str, Any]]) -> float | None:
    """The probability-weighted mean of the digits 0-9 among `top_logprobs`, / 9; None without a digit."""
    mass = [0.0] * 10
    for entry in top:
        token = str(entry.get("token", "")).strip()
        logprob = entry.get("logprob")
        if (
            len(token) == 1
            and token.isdigit()
            and isinstance(logprob, int | float)
            and math.isfinite(logprob)
        ):
            mass[int(token)] += math.exp(logprob)
    total = sum(mass)
    if total <= 0.0:
        return None
    return sum(d * p for d, p in enumerate(mass)) / total / 9.0


# ---- the calls --------------------------------------------------------------------------------------------
class Judge:
    """The judge's calls of one request, made with the caller's key (an async context manager)."""

    def __init__(self, gateway_url: str, key: str, spec: GroupJudge) -> None:
        self.spec = spec
        self.usage = JudgeUsage()
        self._http = httpx.AsyncClient(
            base_url=gateway_url, headers={"Authorization": f"Bearer {key}"}, timeout=CALL_TIMEOUT_S
        )

    async def __aenter__(self) -> Judge:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self._http.aclose()

    async def _chat(self, body: dict[str, Any]) -> dict[str, Any]:
        """One chat completion of the judge; a refusal of the call is raised as the request's answer."""
        try:
            resp = await self._http.post("/v1/chat/completions", json={"store": False, **body})
        except httpx.HTTPError as exc:
            raise JudgeFailed("judge_error", f"the judge could not be reached: {exc}") from None
        try:
            answer = resp.json()
        except ValueError:
            answer = None
        if resp.status_code != 200 or not isinstance(answer, dict):
            error = answer.get("error") if isinstance(answer, dict) else None
            error = error if isinstance(error, dict) else None
            if resp.status_code in RELAYED_STATUSES:
                raise relayed(resp.status_code, error, resp.headers.get("retry-after"))
            message = (error or {}).get("message") or resp.text[:500]
            raise JudgeFailed("judge_error", f"the judge's call failed (HTTP {resp.status_code}): {message}")
        self.usage.add(answer.get("usage"))
        return answer

    async def score(self, group: str, trajectories: list[Trajectory]) -> list[float]:
        """A score in [0, 1] for each trajectory of the group, in order; else `JudgeFailed`."""
        if self.spec.method == "logprobs":
            return [await self._digit(group, trajectories, i) for i in range(1, len(trajectories) + 1)]
        return await self._answer(group, trajectories)

    async def _answer(self, group: str, trajectories: list[Trajectory]) -> list[float]:
        n = len(trajectories)
        messages: list[dict[str, Any]] = [
            {"role": "user", "content": listing(self.spec, group, trajectories) + "\n\n" + answer_format(n)},
        ]
        text, why = "", ""
        for _ in range(self.spec.max_retries + 1):
            reply = await self._chat(
                {
                    "model": self.spec.model,
                    "messages": messages,
                    "max_tokens": self.spec.max_tokens,
                    "temperature": self.spec.temperature,
                    "response_format": {"type": "json_object"},
                }
            )
            text = _reply_text(reply)
            scores, why = parse_scores(text, n)
            if scores is not None:
                return scores
            messages += [
                {"role": "assistant", "content": text},
                {"role": "user", "content": f"That answer could not be read ({why}). {answer_format(n)}"},
            ]
        raise JudgeFailed(
            "judge_parse_error",
            f"the judge's answer did not give {n} scores in [0, 1] after {self.spec.max_retries + 1} "
            f"tries ({why}); its last answer: {text[:300]!r}",
        )

    async def _digit(self, group: str, trajectories: list[Trajectory], i: int) -> float:
        ask = (
            f"How good is trajectory {i} compared with the others, from 0 (worst) to 9 (best)? "
            "Reply with the number only."
        )
        reply = await self._chat(
            {
                "model": self.spec.model,
                "messages": [
                    {"role": "user", "content": listing(self.spec, group, trajectories) + "\n\n" + ask}
                ],
                "max_tokens": DIGIT_POSITIONS,
                "temperature": self.spec.temperature,
                "logprobs": True,
                "top_logprobs": TOP_LOGPROBS,
            }
        )
        for position in _positions(reply):  # the first place the judge would write a digit
            score = digit_score(position.get("top_logprobs") or [position])
            if score is not None:
                return score
        raise JudgeFailed(
            "judge_parse_error",
            f"no digit among the judge's {TOP_LOGPROBS} likeliest tokens at any of its first "
            f"{DIGIT_POSITIONS} positions for trajectory {i} (it answered {_reply_text(reply)[:100]!r})",
        )


def _reply_text(reply: dict[str, Any]) -> str:
    choices = reply.get("choices") or [{}]
    message = choices[0].get("message") if isinstance(choices[0], dict) else None
    return _content_text(message.get("content")) if isinstance(message, dict) else ""


def _positions(reply: dict[str, Any]) -> list[dict[str, Any]]:
    """The sampled tokens' logprobs entries (`{"token", "logprob", "top_logprobs"}`), in order."""
    choices = reply.get("choices") or [{}]
    logprobs = choices[0].get("logprobs") if isinstance(choices[0], dict) else None
    content = logprobs.get("content") if isinstance(logprobs, dict) else None
    return [c for c in content if isinstance(c, dict)] if isinstance(content, list) else []

"""The reinforcement estimate's pilot: a few of the training file's prompts sampled by the base model with the
job's own sampling settings, so the estimate's completion lengths are measured rather than guessed.

A GRPO run trains on every prompt `num_generations` times with each of its sampled completions
(`gateway.jobs.projection`); the prompts are counted exactly, the completions' lengths are known only once
sampled. The pilot samples them before the job exists:

- `PILOT_PROMPTS` rows of the training file, spread evenly over it (the same rows for the same file), their
  messages as the trainer hands them to the chat template;
- each asked for `min(num_generations, PILOT_COMPLETIONS)` completions with the job's `temperature` and
  `max_completion_length` as `max_completion_tokens`, `top_p` 1 and `top_k` off as the trainer samples, and
  a seed (the create's, else `PILOT_SEED`), so the same request estimates the same on the embedded engine;
- through the gateway's own `POST /v1/chat/completions` with the estimate's key (`gateway.serving.calls`'s
  rule: every model call a tenant causes takes that path), all prompts at once. The engine that serves the
  base model answers, embedded or vLLM; the calls are metered, rate-limited and held to the budget as the
  organisation's own, so the estimate is no way around either. Its usage is reported with the pilot.

The expected completion length is the engine's own count (`usage.completion_tokens` over the completions,
the end-of-sequence token included, as the trainer counts it); low and high are the 10th and 90th
percentiles of the completions' lengths (each choice's text tokenised again with the base model's tokenizer,
plus its end-of-sequence token when it stopped): a run whose policy moves to the short or the long end of
what the base model samples. A refused or failed pilot (no engine, a rate limit, `PILOT_TIMEOUT_S`) leaves
the estimate to its bounds and says why; it never fails the estimate.
"""

from __future__ import annotations

import asyncio
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import anyio
import httpx

from gateway.files.validation import read_rows
from gateway.jobs.projection import chat
from gateway.jobs.protocol import Assumption, CostRange
from gateway.settings import Settings
from gateway.usage.pricing import completion_cost
from trainer.contract import ReinforcementHyperparameters

logger = logging.getLogger(__name__)

PILOT_PROMPTS = 8
"""Training prompts the pilot samples."""
PILOT_COMPLETIONS = 8
"""Completions a prompt at most (fewer when `num_generations` is fewer)."""
PILOT_SEED = 0
"""The pilot's seed when the create gives none."""
PILOT_TIMEOUT_S = 30.0
"""Longest the pilot waits for its completions; then the estimate goes on without it."""


@dataclass(frozen=True)
class Pilot:
    """What the pilot sampled, or why it did not."""

    model: str
    prompts: int
    n: int
    temperature: float
    max_tokens: int
    seed: int
    lengths: list[int] = field(default_factory=list)
    """Each completion's tokens, its end-of-sequence token included (tokenised again from its text)."""
    prompt_tokens: int = 0
    """`usage.prompt_tokens` of the pilot's calls, as the engine counted them."""
    completion_tokens: int = 0
    """`usage.completion_tokens` of the pilot's calls, as the engine counted them."""
    truncated: int = 0
    """Completions cut at `max_tokens` (`finish_reason: length`)."""
    seconds: float = 0.0
    reason: str | None = None
    """Why the pilot did not run (None: it ran)."""

    @property
    def ran(self) -> bool:
        return self.reason is None and bool(self.lengths)

    def completion(self) -> CostRange:
        """Tokens of one sampled completion: the engine's mean, and the 10th and 90th percentiles."""
        mean = self.completion_tokens / len(self.lengths)
        if len(self.lengths) > 1:
            cuts = statistics.quantiles(self.lengths, n=10, method="inclusive")
            low, high = cuts[0], cuts[-1]
        else:
            low = high = float(self.lengths[0])
        return CostRange(
            low=round(min(low, mean), 3), expected=round(mean, 3), high=round(max(high, mean), 3)
        )

    def assumption(self, settings: Settings) -> Assumption:
        """The estimate's `pilot` assumption."""
        return Assumption(
            name="pilot",
            value=self.report(settings),
            detail="Completions sampled from the base model for a few training prompts with the job's "
            "temperature and max_completion_length, through the chat route with this key (metered as its "
            "own completions); an environment's prompt is sampled as its first turn only"
            if self.ran
            else f"The pilot that measures completions did not run: {self.reason}",
        )

    def report(self, settings: Settings) -> dict[str, Any]:
        """The pilot as the estimate's `pilot` assumption shows it."""
        out: dict[str, Any] = {
            "ran": self.ran,
            "model": self.model,
            "prompts": self.prompts,
            "completions_per_prompt": self.n,
            "temperature": self.temperature,
            "max_completion_tokens": self.max_tokens,
            "seed": self.seed,
        }
        if not self.ran:
            return {**out, "reason": self.reason or "no completions"}
        lengths = sorted(self.lengths)
        return {
            **out,
            "completions": len(lengths),
            "completion_tokens": {
                "mean": round(self.completion_tokens / len(lengths), 3),
                "min": lengths[0],
                "median": statistics.median(lengths),
                "max": lengths[-1],
            },
            "truncated": self.truncated,
            "usage": {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens},
            "cost_usd": round(
                completion_cost(settings, self.model, self.prompt_tokens, self.completion_tokens), 6
            ),
            "seconds": round(self.seconds, 3),
        }


def pick_prompts(path: Path, *, max_line_bytes: int, k: int = PILOT_PROMPTS) -> list[list[dict[str, Any]]]:
    """The messages of `k` rows spread evenly over a checked reinforcement file, as the trainer hands them to
    the chat template (call in a thread)."""
    rows = [row for _, row in read_rows(path, max_line_bytes=max_line_bytes)]
    if not rows:
        return []
    k = min(k, len(rows))
    picked = sorted({round(i * (len(rows) - 1) / max(k - 1, 1)) for i in range(k)})
    return [[{"role": m["role"], "content": m["content"]} for m in chat(rows[i]["messages"])] for i in picked]


async def _sample(client: httpx.AsyncClient, url: str, key: str, body: dict[str, Any]) -> dict[str, Any]:
    answer = await client.post(url, json=body, headers={"authorization": f"Bearer {key}"})
    if answer.status_code != 200:
        try:
            message = answer.json()["error"]["message"]
        except (ValueError, KeyError, TypeError):
            message = answer.text[:200]
        raise PilotRefused(f"the chat route answered {answer.status_code}: {message}")
    found: dict[str, Any] = answer.json()
    return found


class PilotRefused(Exception):
    """A pilot call the gateway refused or failed."""


async def run(
    settings: Settings,
    key: str,
    *,
    model: str,
    prompts: list[list[dict[str, Any]]],
    hp: ReinforcementHyperparameters,
    seed: int | None,
    count: Callable[[list[str]], list[int]],
) -> Pilot:
    """Sample the pilot through the gateway's chat route with `key` (see the module). `count(texts)` gives
    each completion text's tokens (the base model's tokenizer; called in a thread)."""
    n = max(1, min(hp.num_generations, PILOT_COMPLETIONS))
    pilot = Pilot(
        model=model,
        prompts=len(prompts),
        n=n,
        temperature=hp.temperature,
        max_tokens=hp.max_completion_length,
        seed=PILOT_SEED if seed is None else seed,
    )
    if not prompts:
        return _failed(pilot, "the training file has no prompts")
    url = f"{settings.internal_gateway_url()}/v1/chat/completions"
    sampling = {
        "model": model,
        "n": n,
        "temperature": hp.temperature,
        "top_p": 1.0,
        "top_k": 0,  # off, as the trainer samples (vLLM's default may come from the model's config)
        "max_completion_tokens": hp.max_completion_length,
        "seed": pilot.seed,
    }
    t0 = time.perf_counter()
    try:
        with anyio.fail_after(PILOT_TIMEOUT_S):
            async with httpx.AsyncClient(trust_env=False, timeout=PILOT_TIMEOUT_S) as client:
                # Every call ends (or fails) before the client closes; the first failure is the reason.
                outcomes = await asyncio.gather(
                    *(_sample(client, url, key, {**sampling, "messages": p}) for p in prompts),
                    return_exceptions=True,
                )
    except TimeoutError:
        return _failed(pilot, f"no answer within {PILOT_TIMEOUT_S:g} s")
    seconds = time.perf_counter() - t0
    answers: list[dict[str, Any]] = []
    for outcome in outcomes:
        if isinstance(outcome, PilotRefused):
            return _failed(pilot, str(outcome))
        if isinstance(outcome, httpx.HTTPError):
            return _failed(pilot, f"the chat route could not be reached ({type(outcome).__name__})")
        if isinstance(outcome, BaseException):
            raise outcome
        answers.append(outcome)
    choices = [c for a in answers for c in a.get("choices") or []]
    texts = [str((c.get("message") or {}).get("content") or "") for c in choices]
    stopped = [c.get("finish_reason") == "stop" for c in choices]
    tokens = await anyio.to_thread.run_sync(count, texts)
    lengths = [
        min(t + (1 if s else 0), hp.max_completion_length) if s else hp.max_completion_length
        for t, s in zip(tokens, stopped, strict=True)
    ]
    usage = [a.get("usage") or {} for a in answers]
    completion_tokens = sum(int(u.get("completion_tokens") or 0) for u in usage)
    return replace(
        pilot,
        lengths=lengths,
        prompt_tokens=sum(int(u.get("prompt_tokens") or 0) for u in usage),
        completion_tokens=completion_tokens or sum(lengths),  # an engine that reports no usage
        truncated=stopped.count(False),
        seconds=seconds,
        reason=None if lengths else "the engine answered no completions",
    )


def _failed(pilot: Pilot, reason: str) -> Pilot:
    logger.info("estimate pilot not run: %s", reason)
    return replace(pilot, reason=reason)

"""Playing episodes: a runner (a :class:`~envsdk.sandbox.Sandbox` or an
:class:`~envsdk.host.InProcessRunner`) plus a policy that writes the assistant's turns.

A policy is any ``generate(messages, tools) -> assistant_message`` callable; :func:`openai_policy` makes
one from an ``openai.OpenAI`` client, so episodes can be played against any OpenAI-compatible endpoint.
The trainer drives the same RPC methods with its own batched generation. When ``reset`` answers with a
``forced_tool_call``, that call is the episode's first assistant turn (the policy writes the rest).
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Callable
from typing import Any, Protocol

from envsdk.env import task_messages
from envsdk.errors import SandboxError
from envsdk.types import EpisodeResult, Message, StopReason

logger = logging.getLogger(__name__)

Policy = Callable[[list[Message], list[dict[str, Any]] | None], Message]
"""``generate(messages, tools_or_None) -> {"role": "assistant", "content": ..., "tool_calls"?: [...]}``."""


def reward_of(value: Any) -> float:
    """A reward an environment answered, as a float; `ValueError` unless it is a finite number (a package is
    untrusted code: whatever it sends back is checked before it is used)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"the environment's reward must be a number, not {type(value).__name__}")
    reward = float(value)
    if not math.isfinite(reward):
        raise ValueError(f"the environment's reward must be a finite number, not {reward}")
    return reward


class Runner(Protocol):
    def call(self, method: str, params: dict[str, Any], *, timeout: float | None = None) -> Any: ...


def run_episode(runner: Runner, task: dict[str, Any], policy: Policy, *, max_turns: int = 8) -> EpisodeResult:
    """Play one multi-turn (or tool) episode of ``task`` to its end; never raises for env failures."""
    try:
        opened = runner.call("reset", {"task": task})
    except SandboxError as exc:
        reason = StopReason.TIMEOUT if exc.code == "timeout" else StopReason.ERROR
        return EpisodeResult([], None, 0, reason, error=str(exc))
    episode_id = opened["episode_id"]
    messages: list[Message] = list(opened["observation"])
    tools = opened.get("tools") or None
    limit = min(max_turns, opened.get("max_turns") or max_turns)
    total = 0.0
    info: dict[str, Any] = {}
    forced = opened.get("forced_tool_call")
    for turn in range(1, limit + 1):
        try:
            if turn == 1 and forced:
                assistant = forced_assistant_message(forced)
            else:
                assistant = policy(messages, tools)
        except Exception as exc:
            runner.call("close_episode", {"episode_id": episode_id})
            return EpisodeResult(messages, None, turn - 1, StopReason.ERROR, error=f"policy failed: {exc}")
        messages.append(assistant)
        try:
            step = runner.call("step", {"episode_id": episode_id, "assistant_message": assistant})
        except SandboxError as exc:
            reason = StopReason.TIMEOUT if exc.code == "timeout" else StopReason.ERROR
            return EpisodeResult(messages, None, turn, reason, error=str(exc))
        messages.extend(step.get("observation") or [])
        info = step.get("info") or {}
        if step.get("error"):
            return EpisodeResult(messages, None, turn, StopReason.ERROR, error=step["error"], info=info)
        try:
            total += reward_of(step.get("reward") or 0.0)
        except ValueError as exc:
            return EpisodeResult(messages, None, turn, StopReason.ERROR, error=str(exc), info=info)
        if step.get("done"):
            reason = StopReason.MAX_TURNS if info.get("stop_reason") == "max_turns" else StopReason.DONE
            return EpisodeResult(messages, total, turn, reason, info=info)
    runner.call("close_episode", {"episode_id": episode_id})
    return EpisodeResult(messages, total, limit, StopReason.MAX_TURNS, info=info)


def forced_assistant_message(call: dict[str, Any], call_id: str = "call_1_0") -> Message:
    """The assistant turn that makes the forced tool call ``{"name", "arguments"}`` (OpenAI's shape)."""
    arguments = call.get("arguments") or {}
    function = {
        "name": str(call["name"]),
        "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
    }
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [{"id": call_id, "type": "function", "function": function}],
    }


def run_single_turn(
    runner: Runner, task: dict[str, Any], policy: Policy | None = None, *, completion: str | None = None
) -> EpisodeResult:
    """Score one completion of a single-turn task (from ``policy``, or the literal ``completion``)."""
    messages = task_messages(task)
    if completion is None:
        if policy is None:
            raise ValueError("give a policy or a literal completion")
        assistant = policy(messages, None)
        completion = str(assistant.get("content") or "")
    messages.append({"role": "assistant", "content": completion})
    try:
        [scored] = runner.call("reward_batch", {"items": [{"task": task, "completion": completion}]})
    except SandboxError as exc:
        reason = StopReason.TIMEOUT if exc.code == "timeout" else StopReason.ERROR
        return EpisodeResult(messages, None, 1, reason, error=str(exc))
    if scored.get("error"):
        return EpisodeResult(messages, None, 1, StopReason.ERROR, error=scored["error"])
    try:
        reward = reward_of(scored.get("reward"))
    except ValueError as exc:
        return EpisodeResult(messages, None, 1, StopReason.ERROR, error=str(exc))
    return EpisodeResult(messages, reward, 1, StopReason.DONE)


def openai_policy(client: Any, model: str, **create_kwargs: Any) -> Policy:
    """A policy backed by ``client.chat.completions.create`` (any OpenAI-compatible endpoint)."""

    def generate(messages: list[Message], tools: list[dict[str, Any]] | None) -> Message:
        kwargs = dict(create_kwargs)
        if tools:
            kwargs["tools"] = tools
        response = client.chat.completions.create(model=model, messages=messages, **kwargs)
        message = response.choices[0].message
        out: Message = {"role": "assistant", "content": message.content or ""}
        if getattr(message, "tool_calls", None):
            out["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        return out

    return generate

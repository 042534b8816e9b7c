"""The environment classes users subclass.

* :class:`SingleTurnEnv` -- one prompt, one completion, one reward (``reward``, optionally
  ``group_reward`` to judge all completions of one prompt together).
* :class:`MultiTurnEnv` -- ``reset(task)`` gives the first observation, ``step(assistant_message)``
  answers each model turn with a :class:`~envsdk.types.StepResult`. One instance plays one episode.
* :class:`ToolEnv` -- a multi-turn environment whose ``@tool`` methods the model calls; the episode ends
  when the model answers without a tool call and is scored by ``reward(task, messages)``. With the config
  key ``force_first_tool_call`` set, a task's ``tool_call`` opens the episode as the first assistant turn
  (OpenAI's ``tool_choice`` forcing, with the arguments given by the task).

Every hook may be written sync or async. Environments receive the package's ``config`` (a dict from the
job) as ``self.config``. This module is stdlib-only: it runs inside the sandbox.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import logging
from collections.abc import Awaitable
from typing import Any, ClassVar, TypeVar

from envsdk.tools import get_schema, is_tool
from envsdk.types import Message, StepResult, error_text

logger = logging.getLogger(__name__)

T = TypeVar("T")


async def maybe_await(value: T | Awaitable[T]) -> T:
    """Await ``value`` if it is awaitable (lets every hook be sync or async)."""
    if inspect.isawaitable(value):
        return await value
    return value


def task_messages(task: dict[str, Any]) -> list[Message]:
    """The prompt of an OpenAI RFT row: its ``messages`` (or a ``prompt`` string as one user message)."""
    if isinstance(task.get("messages"), list):
        return [dict(m) for m in task["messages"]]
    if isinstance(task.get("prompt"), str):
        return [{"role": "user", "content": task["prompt"]}]
    raise ValueError("a task needs 'messages' (a list of chat messages) or 'prompt' (a string)")


def completion_text(completion: str | list[Message]) -> str:
    """The text of a completion given as a string or as a list of messages (last assistant content)."""
    if isinstance(completion, str):
        return completion
    for message in reversed(completion):
        if message.get("role") == "assistant":
            content = message.get("content")
            if isinstance(content, list):
                return "".join(part.get("text", "") for part in content if isinstance(part, dict))
            return str(content or "")
    return ""


class Environment:
    """Common base: holds ``config`` and lists the package's own tasks."""

    kind: ClassVar[str] = "environment"
    """``single_turn``, ``multi_turn`` or ``tool``: how the trainer plays it."""

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        self.config: dict[str, Any] = dict(config or {})

    def tasks(self) -> list[dict[str, Any]] | Awaitable[list[dict[str, Any]]]:
        """Tasks bundled with the package (optional; most jobs bring a tasks file instead)."""
        return []


class SingleTurnEnv(Environment):
    """Score one completion of one prompt."""

    kind: ClassVar[str] = "single_turn"

    def reward(self, task: dict[str, Any], completion: str | list[Message]) -> float | Awaitable[float]:
        """Reward of ``completion`` (text, or messages) for ``task`` (the RFT row). Override this."""
        raise NotImplementedError(f"{type(self).__name__} must implement reward(task, completion)")

    def group_reward(
        self, task: dict[str, Any], completions: list[str | list[Message]]
    ) -> list[float] | Awaitable[list[float]]:
        """Rewards of all completions of one prompt together (relative judging). Default: ``reward`` each."""

        async def each() -> list[float]:
            return [float(await maybe_await(self.reward(task, c))) for c in completions]

        return each()


class MultiTurnEnv(Environment):
    """A conversation with the model: one instance per episode, so instance attributes are episode state."""

    kind: ClassVar[str] = "multi_turn"
    max_turns: ClassVar[int] = 8
    """Most assistant turns in one episode (the package's ``[limits] max_turns`` may lower it)."""
    scores_truncated: ClassVar[bool] = False
    """Whether a turn cut off by the completion budget is still stepped (and so scored when it ends the
    episode). False: a truncated episode ends unscored, with reward 0."""

    def reset(self, task: dict[str, Any]) -> list[Message] | Awaitable[list[Message]]:
        """Start the episode for ``task``; return the first observation. Default: the task's messages."""
        return task_messages(task)

    def step(self, assistant_message: Message) -> StepResult | Awaitable[StepResult]:
        """Answer one assistant message (``{"role": "assistant", "content": ..., "tool_calls": ...}``)."""
        raise NotImplementedError(f"{type(self).__name__} must implement step(assistant_message)")

    def tool_schemas(self) -> list[dict[str, Any]]:
        """OpenAI tool schemas offered to the model (none for a plain multi-turn environment)."""
        return []


class ToolEnv(MultiTurnEnv):
    """A multi-turn environment driven by tool calls.

    Methods decorated with ``@tool`` are offered to the model. Each assistant message with ``tool_calls``
    is answered with one ``tool`` message per call (errors are reported to the model as the tool's
    result). An assistant message without tool calls ends the episode; its reward is
    ``reward(task, messages)`` over the whole conversation.
    """

    kind: ClassVar[str] = "tool"

    def __init__(self, config: dict[str, Any] | None = None) -> None:
        super().__init__(config)
        self.task: dict[str, Any] = {}
        self.messages: list[Message] = []
        self.info: dict[str, Any] = {}
        """Episode details tools and ``reward`` may fill; every step's ``info`` is a copy of it. Numbers
        under ``info["metrics"]`` are averaged over a batch's episodes into the job's metrics events."""

    def forced_tool_call(self, task: dict[str, Any]) -> dict[str, Any] | None:
        """The tool call that opens the episode, or None to let the model write the first turn.

        Default: when ``config["force_first_tool_call"]`` is true, the task's ``tool_call``
        (``{"name": ..., "arguments": {...}}``). Override to derive the call from the task otherwise.
        """
        if not self.config.get("force_first_tool_call"):
            return None
        call = task.get("tool_call")
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            return None
        arguments = call.get("arguments") or {}
        if isinstance(arguments, str):
            arguments = json.loads(arguments or "{}")
        if not isinstance(arguments, dict):
            raise TypeError("a task's tool_call arguments must be a JSON object")
        return {"name": call["name"], "arguments": arguments}

    def tool_schemas(self) -> list[dict[str, Any]]:
        return [get_schema(fn) for fn in self._tools().values()]

    def _tools(self) -> dict[str, Any]:
        found: dict[str, Any] = {}
        for attr in dir(type(self)):
            member = getattr(type(self), attr, None)
            if is_tool(member):
                found[get_schema(member)["function"]["name"]] = getattr(self, attr)
        return found

    def reset(self, task: dict[str, Any]) -> list[Message] | Awaitable[list[Message]]:
        self.task = task
        self.messages = task_messages(task)
        self.info = {}
        return list(self.messages)

    def reward(self, task: dict[str, Any], messages: list[Message]) -> float | Awaitable[float]:
        """Reward of the finished conversation. Override this."""
        raise NotImplementedError(f"{type(self).__name__} must implement reward(task, messages)")

    async def call_tool(self, name: str, arguments: dict[str, Any] | str) -> str:
        """Run tool ``name``; the result as the text of a ``tool`` message."""
        tools = self._tools()
        if name not in tools:
            raise KeyError(f"unknown tool {name!r}; available: {sorted(tools)}")
        if isinstance(arguments, str):
            arguments = json.loads(arguments or "{}")
        if not isinstance(arguments, dict):
            raise TypeError("tool arguments must be a JSON object")
        result = await maybe_await(tools[name](**arguments))
        return result if isinstance(result, str) else json.dumps(result)

    async def step(self, assistant_message: Message) -> StepResult:
        self.messages.append(assistant_message)
        calls = assistant_message.get("tool_calls") or []
        if not calls:
            reward = float(await maybe_await(self.reward(self.task, list(self.messages))))
            return StepResult(observation=[], reward=reward, done=True, info=copy.deepcopy(self.info))
        observation: list[Message] = []
        for call in calls:
            function = call.get("function") or {}
            try:
                content = await self.call_tool(str(function.get("name")), function.get("arguments") or "{}")
            except Exception as exc:  # the model sees its own mistake as the tool's answer
                content = f"error: {error_text(exc)}"
            observation.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": content})
        self.messages.extend(observation)
        return StepResult(observation=observation, reward=0.0, done=False, info=copy.deepcopy(self.info))


async def gather_limited(coros: list[Awaitable[T]]) -> list[T]:
    """Run awaitables concurrently (a batch of reward calls) and keep their order."""
    return list(await asyncio.gather(*coros))

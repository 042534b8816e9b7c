"""TRL's environment format (`GRPOTrainer(environment_factory=..., reward_funcs=...)`) as a tunegate tool
environment, with the package's code unchanged.

TRL's contract (trl 1.16, `environment_factory`): a callable makes one environment instance per rollout;
`reset(**row)` starts it from the dataset row's columns and may return a string appended to the last user
message; every other public method with a Google-style docstring is a tool the model may call; an optional
`get_reward()` scores the finished rollout from the environment's state. `reward_funcs` are called as TRL
calls them, `f(prompts=[...], completions=[...], completion_ids=[...], environments=[...], **columns)`,
each returning one float (or None: not applicable) per completion; the reward is their sum plus
`get_reward()`, as TRL sums them with weight 1. Conversational prompts and completions are lists of chat
messages, as TRL passes them for conversational datasets.

This module is stdlib-only: it runs inside the sandbox.
"""

from __future__ import annotations

import copy
import functools
import inspect
from collections.abc import Callable, Sequence
from typing import Any

from envsdk.env import ToolEnv, maybe_await, task_messages
from envsdk.tools import tool_schema
from envsdk.types import Message

RESERVED = frozenset({"reset", "get_reward"})
"""Public methods of a TRL environment that are not tools."""
PROMPT_KEYS = frozenset({"messages", "prompt"})
"""Task keys that make the prompt rather than the `reset` arguments and reward columns."""

RewardFunc = Callable[..., Any]


@functools.cache
def _tool_names(cls: Any) -> tuple[str, ...]:
    """The names of a TRL environment class's tools: its public methods other than `reset`, `get_reward`."""
    return tuple(
        name
        for name in dir(cls)
        if not name.startswith("_") and name not in RESERVED and inspect.isfunction(getattr(cls, name, None))
    )


@functools.cache
def _tool_schemas(cls: Any) -> tuple[dict[str, Any], ...]:
    return tuple(tool_schema(getattr(cls, name), name) for name in _tool_names(cls))


def tool_methods(env: Any) -> dict[str, Callable[..., Any]]:
    """The tools of a TRL environment instance, bound to it."""
    return {name: getattr(env, name) for name in _tool_names(env.__class__)}


def _columns(task: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in task.items() if k not in PROMPT_KEYS}


def _append_to_last_user(messages: list[Message], text: str) -> list[Message]:
    out = [dict(m) for m in messages]
    for message in reversed(out):
        if message.get("role") == "user":
            message["content"] = f"{message.get('content') or ''}{text}"
            return out
    return [*out, {"role": "user", "content": text}]


def _completion(messages: list[Message], prompt_length: int) -> list[Message]:
    """The rollout's completion as TRL passes it for a conversational prompt: every message after the
    prompt (assistant turns and tool results)."""
    return [dict(m) for m in messages[prompt_length:]]


def trl_environment(
    factory: Callable[[], Any], reward_funcs: Sequence[RewardFunc] = (), *, name: str | None = None
) -> type[ToolEnv]:
    """A :class:`ToolEnv` subclass that plays TRL environment `factory` and scores with `reward_funcs`."""
    if not callable(factory):
        raise TypeError("environment_factory must be a callable that returns an environment")
    funcs = list(reward_funcs)
    for func in funcs:
        if not callable(func):
            raise TypeError(f"reward function {func!r} is not callable")

    class TRLEnvironment(ToolEnv):
        scores_truncated = True  # TRL scores every completion, a truncated one too

        def __init__(self, config: dict[str, Any] | None = None) -> None:
            super().__init__(config)
            self.env: Any = factory()
            if not callable(getattr(self.env, "reset", None)):
                raise TypeError(f"{type(self.env).__name__} must define a callable reset (TRL's contract)")
            if not funcs and not callable(getattr(self.env, "get_reward", None)):
                raise TypeError("give reward_funcs or an environment with get_reward()")
            self.prompt_length = 0

        def _tools(self) -> dict[str, Any]:
            return tool_methods(self.env)

        def tool_schemas(self) -> list[dict[str, Any]]:
            return [copy.deepcopy(schema) for schema in _tool_schemas(self.env.__class__)]

        async def reset(self, task: dict[str, Any]) -> list[Message]:
            self.task = task
            self.info = {}
            self.env = factory()  # one instance per rollout, as TRL makes them
            messages = task_messages(task)
            extra = await maybe_await(self.env.reset(**_columns(task)))
            if isinstance(extra, str) and extra:
                messages = _append_to_last_user(messages, extra)
            self.messages = messages
            self.prompt_length = len(messages)
            return list(messages)

        async def reward(self, task: dict[str, Any], messages: list[Message]) -> float:
            prompt = [dict(m) for m in messages[: self.prompt_length]]
            completion = _completion(messages, self.prompt_length)
            columns = {k: [v] for k, v in _columns(task).items()}
            total = 0.0
            scores: dict[str, float] = {}
            for func in funcs:
                batch = {"prompts": [prompt], "completions": [completion], "completion_ids": [[]]}
                out = await maybe_await(func(**batch, environments=[self.env], **columns))
                values = list(out) if out is not None else [None]
                if len(values) != 1:
                    raise ValueError(f"{_name(func)} returned {len(values)} rewards for one completion")
                if values[0] is not None:
                    scores[_name(func)] = float(values[0])
                    total += float(values[0])
            get_reward = getattr(self.env, "get_reward", None)
            if callable(get_reward):
                value = await maybe_await(get_reward())
                scores[type(self.env).__name__] = float(value)
                total += float(value)
            self.info.setdefault("metrics", {}).update({f"reward/{k}": v for k, v in scores.items()})
            return total

    TRLEnvironment.__name__ = TRLEnvironment.__qualname__ = name or f"TRL[{_name(factory)}]"
    return TRLEnvironment


def _name(obj: Any) -> str:
    return str(getattr(obj, "__name__", type(obj).__name__))

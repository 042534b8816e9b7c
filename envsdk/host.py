"""The RPC surface of one environment: method name + params in, JSON-friendly result out.

:class:`EnvHost` is what runs inside the sandbox (driven by :mod:`envsdk._runner`); the same object can
be used in-process through :class:`InProcessRunner` while writing an environment (no isolation at all --
only for your own code). Methods:

==================  =================================================  ===================================
method              params                                             result
==================  =================================================  ===================================
``describe``        ``{}``                                             ``{"kind", "entrypoint", "tools",
                                                                       "max_turns", "group_reward"}``
``tasks``           ``{}``                                             ``[task, ...]``
``reward_batch``    ``{"items": [{"task", "completion"}, ...]}``       ``[{"reward", "error"}, ...]``
``rewards``         ``{"tasks": [task, ...], "items": [[i, c], ...]}``  ``{"rewards": [float | null, ...],
                                                                       "errors": [[n, message], ...]}``
``group_reward``    ``{"task", "completions": [...]}``                 ``[{"reward", "error"}, ...]``
``reset``           ``{"task", "episode_id"?}``                        ``{"episode_id", "observation",
                                                                       "tools", "max_turns",
                                                                       "forced_tool_call"}``
``step``            ``{"episode_id", "assistant_message"}``            ``StepResult`` as a dict
``close_episode``   ``{"episode_id"}``                                 ``null``
``tools``           ``{}``                                             ``[schema, ...]``
``call_tool``       ``{"name", "arguments", "episode_id"?}``           ``{"content", "error"}``
==================  =================================================  ===================================

``rewards`` is ``reward_batch`` in a compact shape, the one the sandbox sends: each distinct task once, each
item as ``[index into tasks, completion]``, the rewards as one list and only the failed items' messages
(``n`` is the item's position). Synchronous ``reward`` methods are called in a plain loop; only the
awaitables that async ones return are gathered on the event loop.

``describe``'s ``group_reward`` is true when a single-turn class overrides
:meth:`~envsdk.env.SingleTurnEnv.group_reward`: callers then judge all completions of one prompt in one
``group_reward`` call. ``reset``'s ``forced_tool_call`` (``{"name", "arguments"}`` or null) is the tool call
a :class:`~envsdk.env.ToolEnv` wants as the episode's first assistant turn.

Stdlib only: this module is imported by the sandboxed child.
"""

from __future__ import annotations

import asyncio
import importlib
import inspect
import logging
from collections.abc import Awaitable, Iterable
from math import isfinite
from typing import Any

from envsdk.env import Environment, MultiTurnEnv, SingleTurnEnv, ToolEnv, maybe_await
from envsdk.types import RewardResult, StepResult, error_text

logger = logging.getLogger(__name__)


def _finite(value: Any) -> float:
    """A reward as a float; NaN and infinities fail that item alone (they have no place in an advantage)."""
    reward = float(value)
    if not isfinite(reward):
        raise ValueError(f"reward must be a finite number, got {reward}")
    return reward


def _reward_result(value: Any) -> RewardResult:
    try:
        return RewardResult(_finite(value))
    except Exception as exc:
        return RewardResult(None, error_text(exc))


class RemoteError(Exception):
    """An RPC method failed as a whole (not one item of a batch)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def load_entrypoint(entrypoint: str) -> type[Environment]:
    """Import ``module:Class`` and check it is an :class:`Environment` subclass."""
    obj = import_object(entrypoint)
    if not (isinstance(obj, type) and issubclass(obj, Environment)):
        raise RemoteError(
            "entrypoint_error",
            f"{entrypoint} is not a SingleTurnEnv, MultiTurnEnv or ToolEnv subclass",
        )
    if obj in (Environment, SingleTurnEnv, MultiTurnEnv, ToolEnv):
        raise RemoteError("entrypoint_error", f"{entrypoint} is a base class; subclass it")
    return obj


def import_object(path: str) -> Any:
    """The object that ``module:name`` (``name`` may be dotted) names."""
    module_name, sep, attr = path.partition(":")
    if not sep or not module_name or not attr:
        raise RemoteError("entrypoint_error", f"expected 'module:name', got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise RemoteError("entrypoint_error", f"cannot import {module_name!r}: {error_text(exc)}") from exc
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise RemoteError("entrypoint_error", f"module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    return obj


def _verifiers(target: Any, options: dict[str, Any], config: dict[str, Any] | None) -> type[Environment]:
    from envsdk.formats.verifiers import verifiers_environment

    return verifiers_environment(target, config)  # load_environment(**config), once per sandbox


def _atropos(target: Any, options: dict[str, Any], config: dict[str, Any] | None) -> type[Environment]:
    from envsdk.formats.atropos import atropos_environment

    return atropos_environment(target, config)  # made once per sandbox, config over its config_init()'s


def _trl(target: Any, options: dict[str, Any], config: dict[str, Any] | None) -> type[Environment]:
    from envsdk.formats.trl import trl_environment

    funcs: list[Any] = []
    for path in options.get("reward_funcs") or []:
        found = import_object(path)
        funcs.extend(found if isinstance(found, list | tuple) else [found])
    return trl_environment(target, funcs)


def _openenv(target: Any, options: dict[str, Any], config: dict[str, Any] | None) -> type[Environment]:
    from envsdk.formats.openenv import openenv_environment

    return openenv_environment(
        target, tool_name=options.get("tool_name") or "step", text_field=options.get("text_field")
    )


FORMATS = {"verifiers": _verifiers, "atropos": _atropos, "trl": _trl, "openenv": _openenv}
"""Each format's adapter: (the entrypoint's object, the format's options, the package's config) -> the
environment class that plays it (`envsdk.formats`)."""


def load_format(
    format: str, entrypoint: str, options: dict[str, Any] | None, config: dict[str, Any] | None = None
) -> type[Environment]:
    """The environment class that plays ``entrypoint``, written for framework ``format`` (``config``: the
    package's config, for a format whose entrypoint is called with it). What the adapter refuses is an
    ``entrypoint_error``."""
    adapter = FORMATS.get(format)
    if adapter is None:
        raise RemoteError("entrypoint_error", f"unknown environment format {format!r}")
    target = import_object(entrypoint)
    try:
        return adapter(target, options or {}, config)
    except RemoteError:
        raise
    except Exception as exc:
        raise RemoteError("entrypoint_error", f"{entrypoint}: {error_text(exc)}") from exc


def overrides_group_reward(env_cls: type[Environment]) -> bool:
    """Whether a single-turn class judges groups itself (overrides ``SingleTurnEnv.group_reward``)."""
    if not issubclass(env_cls, SingleTurnEnv):
        return False
    return getattr(env_cls, "group_reward", None) is not SingleTurnEnv.group_reward


class EnvHost:
    """Dispatches RPC calls to one environment class (one instance per multi-turn episode)."""

    def __init__(
        self,
        env_cls: type[Environment],
        config: dict[str, Any] | None = None,
        *,
        entrypoint: str = "",
        max_turns: int | None = None,
    ) -> None:
        self.env_cls = env_cls
        self.config = dict(config or {})
        self.entrypoint = entrypoint or f"{env_cls.__module__}:{env_cls.__qualname__}"
        class_turns = getattr(env_cls, "max_turns", None)
        limits = [t for t in (class_turns, max_turns) if isinstance(t, int) and t > 0]
        self.max_turns = min(limits) if limits else None
        self._shared: Environment | None = None
        self._episodes: dict[str, tuple[MultiTurnEnv, int]] = {}
        self._next_episode = 0

    @classmethod
    def from_entrypoint(
        cls,
        entrypoint: str,
        config: dict[str, Any] | None = None,
        *,
        max_turns: int | None = None,
        format: str = "envsdk",
        options: dict[str, Any] | None = None,
    ) -> EnvHost:
        """The host of the package's environment: an envsdk class, or, for another framework's
        ``format``, its entrypoint played through that format's adapter (:mod:`envsdk.formats`)."""
        if format == "envsdk":
            env_cls = load_entrypoint(entrypoint)
        else:
            env_cls = load_format(format, entrypoint, options, config)
        return cls(env_cls, config, entrypoint=entrypoint, max_turns=max_turns)

    @property
    def shared(self) -> Environment:
        """The instance used for stateless calls (rewards, tasks, schemas)."""
        if self._shared is None:
            self._shared = self.env_cls(self.config)
        return self._shared

    async def handle(self, method: str, params: dict[str, Any]) -> Any:
        handler = getattr(self, f"rpc_{method}", None)
        if handler is None:
            raise RemoteError("unknown_method", f"unknown method {method!r}")
        return await handler(**params)

    # -- description -------------------------------------------------------------------------------
    async def rpc_describe(self) -> dict[str, Any]:
        return {
            "kind": self.env_cls.kind,
            "entrypoint": self.entrypoint,
            "tools": await self.rpc_tools(),
            "max_turns": self.max_turns if issubclass(self.env_cls, MultiTurnEnv) else None,
            "group_reward": overrides_group_reward(self.env_cls),
            "scores_truncated": bool(getattr(self.env_cls, "scores_truncated", False)),
        }

    async def rpc_tasks(self) -> list[dict[str, Any]]:
        return list(await maybe_await(self.shared.tasks()))

    async def rpc_tools(self) -> list[dict[str, Any]]:
        env = self.shared
        return env.tool_schemas() if isinstance(env, MultiTurnEnv) else []

    # -- single turn -------------------------------------------------------------------------------
    def _single(self) -> SingleTurnEnv:
        env = self.shared
        if not isinstance(env, SingleTurnEnv):
            raise RemoteError("wrong_kind", f"{self.entrypoint} is {env.kind}, not single_turn")
        return env

    @staticmethod
    def _score_now(
        env: SingleTurnEnv, pairs: Iterable[tuple[Any, Any]]
    ) -> tuple[list[float | None], dict[int, str], list[tuple[int, Awaitable[Any]]]]:
        """Call ``env.reward`` on every ``(task, completion)``: the rewards of sync calls, the errors by
        position, and the awaitables async calls returned (still to be awaited)."""
        rewards: list[float | None] = []
        errors: dict[int, str] = {}
        pending: list[tuple[int, Awaitable[Any]]] = []
        reward = env.reward
        for i, (task, completion) in enumerate(pairs):
            try:
                value = reward(task, completion)
                if inspect.isawaitable(value):
                    pending.append((i, value))
                    rewards.append(None)
                else:
                    rewards.append(_finite(value))
            except Exception as exc:
                rewards.append(None)
                errors[i] = error_text(exc)
        return rewards, errors, pending

    @staticmethod
    async def _finish(
        rewards: list[float | None], errors: dict[int, str], pending: list[tuple[int, Awaitable[Any]]]
    ) -> None:
        """Await the async rewards together and fill them (or their errors) in."""
        results = await asyncio.gather(*(value for _, value in pending), return_exceptions=True)
        for (i, _), result in zip(pending, results, strict=True):
            if isinstance(result, BaseException):
                if not isinstance(result, Exception):
                    raise result
                errors[i] = error_text(result)
                continue
            try:
                rewards[i] = _finite(result)
            except Exception as exc:
                errors[i] = error_text(exc)

    async def rpc_reward_batch(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        env = self._single()
        pairs = ((item.get("task") or {}, item.get("completion", "")) for item in items)
        rewards, errors, pending = self._score_now(env, pairs)
        if pending:
            await self._finish(rewards, errors, pending)
        if not errors:
            return [{"reward": r, "error": None} for r in rewards]
        return [
            {"reward": None, "error": errors[i]} if i in errors else {"reward": r, "error": None}
            for i, r in enumerate(rewards)
        ]

    def rewards(
        self, tasks: list[Any], items: list[list[Any]], loop: asyncio.AbstractEventLoop
    ) -> dict[str, Any]:
        """The ``rewards`` method without a coroutine of its own (``loop`` runs async rewards only)."""
        env = self._single()
        rewards, errors, pending = self._score_now(env, ((tasks[t], c) for t, c in items))
        if pending:
            loop.run_until_complete(self._finish(rewards, errors, pending))
        for i in errors:
            rewards[i] = None
        return {"rewards": rewards, "errors": [[i, message] for i, message in errors.items()]}

    async def rpc_rewards(self, tasks: list[Any], items: list[list[Any]]) -> dict[str, Any]:
        env = self._single()
        rewards, errors, pending = self._score_now(env, ((tasks[t], c) for t, c in items))
        if pending:
            await self._finish(rewards, errors, pending)
        for i in errors:
            rewards[i] = None
        return {"rewards": rewards, "errors": [[i, message] for i, message in errors.items()]}

    async def rpc_group_reward(self, task: dict[str, Any], completions: list[Any]) -> list[dict[str, Any]]:
        env = self._single()
        try:
            values = list(await maybe_await(env.group_reward(task, completions)))
            if len(values) != len(completions):
                raise ValueError(f"group_reward returned {len(values)} rewards for {len(completions)}")
        except Exception as exc:
            return [RewardResult(None, error_text(exc)).to_dict() for _ in completions]
        return [_reward_result(v).to_dict() for v in values]

    # -- multi turn --------------------------------------------------------------------------------
    async def rpc_reset(self, task: dict[str, Any], episode_id: str | None = None) -> dict[str, Any]:
        if not issubclass(self.env_cls, MultiTurnEnv):
            raise RemoteError("wrong_kind", f"{self.entrypoint} is {self.env_cls.kind}, not multi-turn")
        if episode_id is None:
            self._next_episode += 1
            episode_id = f"ep-{self._next_episode}"
        env = self.env_cls(self.config)
        assert isinstance(env, MultiTurnEnv)
        try:
            observation = list(await maybe_await(env.reset(task)))
        except Exception as exc:
            raise RemoteError("env_error", f"reset failed: {error_text(exc)}") from exc
        forced = None
        if isinstance(env, ToolEnv):
            try:
                forced = env.forced_tool_call(task)
            except Exception as exc:
                raise RemoteError("env_error", f"forced_tool_call failed: {error_text(exc)}") from exc
        self._episodes[episode_id] = (env, 0)
        return {
            "episode_id": episode_id,
            "observation": observation,
            "tools": env.tool_schemas(),
            "max_turns": self.max_turns,
            "forced_tool_call": forced,
        }

    async def rpc_step(self, episode_id: str, assistant_message: dict[str, Any]) -> dict[str, Any]:
        if episode_id not in self._episodes:
            raise RemoteError("unknown_episode", f"no open episode {episode_id!r}")
        env, turns = self._episodes[episode_id]
        turns += 1
        try:
            result = await maybe_await(env.step(assistant_message))
            if isinstance(result, dict):
                result = StepResult.from_dict(result)
            if not isinstance(result, StepResult):
                raise TypeError(f"step() must return a StepResult, got {type(result).__name__}")
        except Exception as exc:
            result = StepResult(observation=[], reward=0.0, done=True, error=error_text(exc))
        if not result.done and self.max_turns is not None and turns >= self.max_turns:
            result.done = True
            result.info = {**result.info, "stop_reason": "max_turns"}
        if result.done:
            self._episodes.pop(episode_id, None)
        else:
            self._episodes[episode_id] = (env, turns)
        return result.to_dict()

    async def rpc_close_episode(self, episode_id: str) -> None:
        self._episodes.pop(episode_id, None)

    async def rpc_call_tool(
        self, name: str, arguments: dict[str, Any] | str, episode_id: str | None = None
    ) -> dict[str, Any]:
        env = self._episodes[episode_id][0] if episode_id in self._episodes else self.shared
        if not isinstance(env, ToolEnv):
            raise RemoteError("wrong_kind", f"{self.entrypoint} has no tools")
        try:
            return {"content": await env.call_tool(name, arguments), "error": None}
        except Exception as exc:
            return {"content": None, "error": error_text(exc)}


class InProcessRunner:
    """Runs an :class:`EnvHost` in the calling process with the same ``call`` API as the sandbox.

    No isolation whatsoever: for unit tests and for authoring your own environment.
    """

    def __init__(
        self,
        env: type[Environment] | str,
        config: dict[str, Any] | None = None,
        *,
        max_turns: int | None = None,
    ) -> None:
        if isinstance(env, str):
            self.host = EnvHost.from_entrypoint(env, config, max_turns=max_turns)
        else:
            self.host = EnvHost(env, config, max_turns=max_turns)
        self._loop = asyncio.new_event_loop()

    def call(self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        return self._loop.run_until_complete(self.host.handle(method, params or {}))

    async def acall(self, method: str, params: dict[str, Any] | None = None) -> Any:
        return await self.host.handle(method, params or {})

    def reward_batch(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        result: list[dict[str, Any]] = self.call("reward_batch", {"items": items})
        return result

    def describe(self) -> dict[str, Any]:
        result: dict[str, Any] = self.call("describe", {})
        return result

    def close(self) -> None:
        self._loop.close()

    def __enter__(self) -> InProcessRunner:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

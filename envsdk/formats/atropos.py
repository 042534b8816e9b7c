"""Nous Research's Atropos environment format (an ``atroposlib`` ``BaseEnv`` subclass) as a tunegate
environment, with the package's code unchanged.

Target release: **atroposlib 0.4.0** (PyPI). The package's entrypoint is its ``BaseEnv`` subclass
(``module:Class``); the package's ``config`` (with a job's overrides) updates the fields of the
``BaseEnvConfig`` its ``config_init()`` returns. The environment is made once per sandbox, as Atropos makes
it (``Class(config, server_configs, slurm=False, testing=False)``, then ``await env.setup()``).

An Atropos environment asks its inference server for a group of completions of one prompt
(``self.server.chat_completion(messages=..., n=group_size)`` or ``self.server.completion(prompt=..., n=...)``)
and scores the group in ``collect_trajectories`` (usually through its ``score``), returning a
``ScoredDataGroup`` whose ``scores`` are one per completion. In tunegate the trainer has already generated the
group with the job's current weights, and the sandbox has no network, so the adapter gives the environment,
in place of its OpenAI server, an in-process stand-in (:class:`_PolicyServer`, an ``APIServer`` in Atropos'
own server manager, named by an ``APIServerConfig`` with the env's ``model_name``) that answers its request
with exactly those completions; the environment's own ``collect_trajectories`` and scoring code then run on
the job's current policy's outputs, and the group's ``scores`` become its rewards
(:meth:`~envsdk.env.SingleTurnEnv.group_reward`, one call per prompt group). Sampling arguments the env passes
(``max_tokens``, ``temperature``, ...) are the trainer's business and are not applied to the given group.

* The env's ``group_size`` is set to the trainer's group for each call (the job's number of completions per
  prompt), so it asks for exactly the completions the trainer made.
* A chat request must ask for the task's own prompt (its ``messages``): completions are never scored
  against a prompt they were not generated for.
* A task is the env's item: the row's ``item`` column when it has one, else the row without ``messages``.
  :meth:`tasks` draws items from the env's ``get_next_item`` (64 by default, ``atropos_tasks`` in the
  config) and records the prompt the env asks for as each row's ``messages``.
* A group the env drops (``collect_trajectories`` returns ``None``, as Atropos envs do when all scores are
  equal) is rewarded 0.0 throughout: the same zero advantage, but its mean counts as 0.
* BaseEnv's default ``collect_trajectories`` (``collect_trajectory`` once per completion, each asking for
  ``n=1``) takes the group's completions in order.
* Not supported: ``managed_server`` (it needs token ids and logprobs from the server), envs that call the
  server again after their group (multi-turn or multi-step), and ``evaluate``.

This module is stdlib-only at import time (it runs inside the sandbox); ``atroposlib`` is imported when a
package is loaded, from the package's venv.
"""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections import deque
from typing import Any

from envsdk.env import SingleTurnEnv, completion_text, task_messages
from envsdk.types import Message

DEFAULT_TASKS = 64
"""Items :meth:`tasks` draws from the env's ``get_next_item`` unless the config's ``atropos_tasks`` says."""

_GROUP: contextvars.ContextVar[_Group | None] = contextvars.ContextVar("atropos_group", default=None)


class _Group:
    """The completions of one prompt group, handed out to the env's requests in order."""

    def __init__(self, prompt: list[Message] | None, completions: list[str]) -> None:
        self.prompt = prompt
        self.left = deque(completions)
        self.asked: list[list[Message]] = []

    def take(self, n: int) -> list[str]:
        if n > len(self.left):
            raise RuntimeError(
                f"the environment asked for {n} more completions of this prompt; the trainer's group has "
                f"{len(self.left)} left (tunegate answers with the job's own group, once)"
            )
        return [self.left.popleft() for _ in range(n)]


def _policy_server_class() -> type:
    """The ``APIServer`` that answers an Atropos env with the trainer's completions (defined lazily: it
    subclasses atroposlib's class)."""
    from atroposlib.envs.server_handling.server_baseline import APIServer  # noqa: PLC0415
    from openai.types.chat.chat_completion import ChatCompletion  # noqa: PLC0415
    from openai.types.completion import Completion  # noqa: PLC0415

    class _PolicyServer(APIServer):
        async def check_server_status_task(self, chat_completion: bool = True) -> None:
            self.server_healthy = True

        # Answered directly: APIServer's own methods retry failures (an answer here is not a network call,
        # and a refusal must reach the caller as it is)
        async def chat_completion(self, **kwargs: Any) -> Any:
            kwargs.pop("split", None)
            return await self._chat_completion_wrapper(**kwargs)

        async def completion(self, **kwargs: Any) -> Any:
            kwargs.pop("split", None)
            return await self._completion_wrapper(**kwargs)

        async def _chat_completion_wrapper(self, **kwargs: Any) -> Any:
            group = _current()
            messages = [dict(m) for m in kwargs.get("messages") or []]
            if group.prompt is not None and _plain(messages) != _plain(group.prompt):
                raise RuntimeError(
                    "the environment asked for a prompt the trainer did not generate this group for: "
                    f"{messages!r} is not the task's messages {group.prompt!r}"
                )
            group.asked.append(messages)
            texts = group.take(int(kwargs.get("n") or 1))
            return ChatCompletion.model_validate(
                {
                    "id": "tunegate-policy",
                    "object": "chat.completion",
                    "created": int(time.time()),
                    "model": str(kwargs.get("model") or self.config.model_name),
                    "choices": [
                        {
                            "index": i,
                            "finish_reason": "stop",
                            "message": {"role": "assistant", "content": text},
                        }
                        for i, text in enumerate(texts)
                    ],
                }
            )

        async def _completion_wrapper(self, **kwargs: Any) -> Any:
            group = _current()
            texts = group.take(int(kwargs.get("n") or 1))
            return Completion.model_validate(
                {
                    "id": "tunegate-policy",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": str(kwargs.get("model") or self.config.model_name),
                    "choices": [
                        {"index": i, "finish_reason": "stop", "text": text, "logprobs": None}
                        for i, text in enumerate(texts)
                    ],
                }
            )

        async def _tokens_and_logprobs_completion_wrapper(self, **kwargs: Any) -> Any:
            raise NotImplementedError(
                "tunegate's policy server has no token ids or logprobs (managed_server)"
            )

        async def _get_logprobs_wrapper(self, **kwargs: Any) -> Any:
            raise NotImplementedError("tunegate's policy server has no logprobs")

    return _PolicyServer


def _current() -> _Group:
    group = _GROUP.get()
    if group is None:
        raise RuntimeError("the environment asked for completions outside a group tunegate is scoring")
    return group


def _plain(messages: list[Any]) -> list[tuple[str, str]]:
    return [(str(m.get("role")), str(m.get("content") or "")) for m in messages]


def _item(task: dict[str, Any]) -> Any:
    """The Atropos item of a tunegate task row."""
    if "item" in task:
        return task["item"]
    return {k: v for k, v in task.items() if k != "messages"}


def _scores(result: Any) -> list[float] | None:
    """The scores of what ``collect_trajectories`` returned (a group, or a list of one group, or None)."""
    scored = result[0] if isinstance(result, tuple) else result
    if isinstance(scored, list):
        groups = [g for g in scored if g is not None]
        if len(groups) > 1:
            raise ValueError("collect_trajectories returned several groups for one prompt")
        scored = groups[0] if groups else None
    if scored is None:
        return None
    return [float(s) for s in scored["scores"]]


def atropos_environment(
    env_cls: Any, config: dict[str, Any] | None = None, *, name: str | None = None
) -> type[SingleTurnEnv]:
    """The tunegate environment class that plays Atropos ``BaseEnv`` subclass ``env_cls``."""
    from atroposlib.envs.base import BaseEnv  # noqa: PLC0415 -- from the package's venv, inside the sandbox
    from atroposlib.envs.server_handling.server_baseline import APIServerConfig  # noqa: PLC0415

    if not (isinstance(env_cls, type) and issubclass(env_cls, BaseEnv)):
        raise TypeError(f"{env_cls!r} is not an atroposlib BaseEnv subclass")
    made: Any = env_cls
    overrides = dict(config or {})
    n_tasks = int(overrides.pop("atropos_tasks", DEFAULT_TASKS))
    env_config, server_configs = made.config_init()
    unknown = sorted(set(overrides) - set(type(env_config).model_fields))
    if unknown:
        raise TypeError(f"config keys {unknown} are not fields of {type(env_config).__name__}")
    env_config = env_config.model_copy(update=overrides)
    first = server_configs[0] if isinstance(server_configs, list) and server_configs else server_configs
    policy = APIServerConfig(
        model_name=getattr(first, "model_name", "default"),
        base_url=None,
        api_key="tunegate",
        health_check=False,
    )
    atropos_env = env_cls(env_config, [policy], slurm=False, testing=False)
    atropos_env.server.servers = [_policy_server_class()(policy, atropos_env.server.reasoning_config)]
    lock = asyncio.Lock()
    ready: list[bool] = []

    async def set_up() -> None:
        if not ready:  # Atropos' own order: the env is made, then ``await env.setup()`` once
            await atropos_env.setup()
            ready.append(True)

    title = name or f"atropos[{env_cls.__name__}]"

    async def run_group(item: Any, prompt: list[Message] | None, completions: list[str]) -> list[float]:
        group = _Group(prompt, completions)
        async with lock:
            await set_up()
            atropos_env.config.group_size = len(completions)
            token = _GROUP.set(group)
            try:
                result = await atropos_env.collect_trajectories(item)
            finally:
                _GROUP.reset(token)
        if group.left:
            used, made = len(completions) - len(group.left), len(completions)
            raise RuntimeError(f"the environment asked for {used} of the group's {made} completions")
        scores = _scores(result)
        if scores is None:
            return [0.0] * len(completions)
        if len(scores) != len(completions):
            raise ValueError(f"the environment scored {len(scores)} completions of {len(completions)}")
        return scores

    class AtroposSingleTurn(SingleTurnEnv):
        atropos = atropos_env

        async def tasks(self) -> list[dict[str, Any]]:
            rows = []
            async with lock:
                await set_up()
                for _ in range(n_tasks):
                    item = await atropos_env.get_next_item()
                    group = _Group(None, [""] * atropos_env.config.group_size)
                    token = _GROUP.set(group)
                    try:  # the env's own request names the prompt of the item; its scores are dropped
                        await atropos_env.collect_trajectories(item)
                    finally:
                        _GROUP.reset(token)
                    if group.asked:
                        rows.append({"messages": group.asked[0], "item": item})
            return rows

        async def group_reward(self, task: dict[str, Any], completions: list[Any]) -> list[float]:
            prompt = task_messages(task) if "messages" in task or "prompt" in task else None
            return await run_group(_item(task), prompt, [completion_text(c) for c in completions])

        async def reward(self, task: dict[str, Any], completion: str | list[Message]) -> float:
            return (await self.group_reward(task, [completion]))[0]

    AtroposSingleTurn.__name__ = AtroposSingleTurn.__qualname__ = title
    return AtroposSingleTurn


__all__ = ["DEFAULT_TASKS", "atropos_environment"]

"""Prime Intellect's `verifiers` environment format as a tunegate environment, with the package's code
unchanged.

Target release: **verifiers 0.3.1** (PyPI), the newest with the classic API the Environments Hub's packages
are written for (``import verifiers as vf``: ``vf.SingleTurnEnv``, ``vf.MultiTurnEnv.env_response``,
``vf.Rubric``, ``vf.Parser``/``vf.XMLParser``; in 0.3.1 these live in ``verifiers.legacy`` and answer at
their historical names). verifiers 0.4.0 removed that API (its ``verifiers.v1`` stack has no
``env_response`` and no ``Rubric``), so it is not a target.

The contract, as verifiers' own loader uses it: the package's entrypoint is its module's
``load_environment(**kwargs)``; the package's ``config`` (with a job's overrides) are those keyword
arguments. It returns a ``vf.Environment``:

* its dataset (``question``/``answer``/``info`` columns, or ``prompt`` as chat messages; formatted by
  verifiers with the environment's ``system_prompt``) becomes the package's :meth:`tasks` (``messages``,
  ``answer``, ``info`` and the other columns);
* a task row is turned back into verifiers' rollout input (``prompt`` from the row's ``messages``, or its
  ``prompt`` string or message list, or its ``question``; ``answer``, ``info`` and other columns as they
  are), and the rollout state is made by verifiers' own ``init_state``;
* a ``vf.SingleTurnEnv`` plays as a tunegate :class:`SingleTurnEnv`: the completion becomes the rollout's
  one turn and the reward is what the environment's rubric (``await env.rubric.score_rollout(state)``, the
  weighted sum of its reward functions, called with the keyword arguments they ask for: ``prompt``,
  ``completion``, ``answer``, ``state``, ``info``, ``parser``, ...) writes into ``state["reward"]``;
* any other ``vf.MultiTurnEnv`` plays as a tunegate :class:`MultiTurnEnv`: each assistant turn is recorded
  in the trajectory, the environment's stop conditions (``is_completed``) are checked, and its
  ``env_response`` answers; when it stops (or ``env_response`` sets ``final_env_response``) the rollout is
  rendered and cleaned up by verifiers and scored by the rubric as above.

The rubric's per-function scores go to ``info["metrics"]`` as ``reward/<function name>`` (multi-turn), as
they go to ``state["metrics"]``. This module is stdlib-only at import time (it runs inside the sandbox);
verifiers is imported when a package is loaded, from the package's venv.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

from envsdk.env import MultiTurnEnv, SingleTurnEnv, task_messages
from envsdk.types import Message, StepResult

PROMPT_KEYS = frozenset({"messages", "prompt", "question"})
"""Task keys that make the rollout's prompt; every other key is a column of the rollout input."""


def _vf() -> Any:
    import verifiers as vf  # noqa: PLC0415 -- from the package's venv, inside the sandbox

    return vf


def _plain(message: Any) -> Message:
    """A verifiers message (a pydantic model) as a plain chat message dict."""
    if hasattr(message, "model_dump"):
        dumped: dict[str, Any] = message.model_dump(exclude_none=True)
        return dumped
    return dict(message)


def _plain_all(messages: Any) -> list[Message]:
    if isinstance(messages, str):
        return [{"role": "user", "content": messages}]
    return [_plain(m) for m in messages or []]


def _json_safe(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if hasattr(value, "model_dump"):
        return _plain(value)
    if value is None or isinstance(value, str | int | float | bool):
        return value
    return str(value)


def rollout_input(env: Any, task: dict[str, Any]) -> dict[str, Any]:
    """verifiers' rollout input (a dataset row) for a tunegate task row."""
    row = {k: v for k, v in task.items() if k not in PROMPT_KEYS}
    if isinstance(task.get("messages"), list) or isinstance(task.get("prompt"), str):
        prompt: list[Message] = task_messages(task)
    elif isinstance(task.get("prompt"), list):
        prompt = [dict(m) for m in task["prompt"]]
    elif isinstance(task.get("question"), str):  # formatted as verifiers formats its dataset's questions
        prompt = []
        if getattr(env, "system_prompt", None):
            prompt.append({"role": "system", "content": env.system_prompt})
        prompt.extend(dict(m) for m in getattr(env, "few_shot", None) or [])
        prompt.append({"role": "user", "content": task["question"]})
    else:
        raise ValueError("a task needs 'messages', 'prompt' or 'question'")
    row.setdefault("answer", "")
    row.setdefault("info", {})
    row.setdefault("example_id", 0)
    return {**row, "prompt": prompt}


def dataset_tasks(env: Any) -> list[dict[str, Any]]:
    """The environment's dataset (as verifiers formatted it) as tunegate task rows."""
    dataset = env.get_dataset() if getattr(env, "dataset_source", None) is not None else None
    if dataset is None:
        return []
    rows: list[dict[str, Any]] = []
    for row in (dataset[i] for i in range(len(dataset))):
        task = {k: _json_safe(v) for k, v in dict(row).items() if k not in ("prompt", "example_id")}
        task["messages"] = _plain_all(row["prompt"])
        rows.append(task)
    return rows


def _model_free_client(vf: Any) -> Any:
    """A verifiers ``Client`` that is never asked for a response: the model's turns come from tunegate."""
    from verifiers.clients import Client  # noqa: PLC0415

    class TunegateTurns(Client):
        def setup_client(self, config: Any) -> None:
            return None

        async def _refuse(self, *args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("tunegate plays the model's turns; verifiers is not asked for a response")

        to_native_tool = to_native_prompt = get_native_response = _refuse
        raise_from_native_response = from_native_response = _refuse

        async def close(self) -> None:
            return None

    return TunegateTurns(None)


class Rollout:
    """One verifiers rollout driven turn by turn from outside (the steps of ``MultiTurnEnv.rollout``)."""

    def __init__(self, env: Any, client: Any) -> None:
        self.env = env
        self.client = client
        self.state: Any = None
        self.prompt: Any = None

    async def start(self, task: dict[str, Any]) -> list[Message]:
        from verifiers.utils.message_utils import maybe_normalize_messages  # noqa: PLC0415

        env = self.env
        state = await env.init_state(rollout_input(env, task), self.client, "tunegate")
        state["timing"].generation.start = state["timing"].setup.start = 0.0
        state = await env.setup_state(state) or state
        self.state = state
        self.prompt = maybe_normalize_messages(await env.get_prompt_messages(state), field_name="prompt")
        return _plain_all(self.prompt)

    async def turn(self, assistant: Message | str) -> tuple[list[Message], bool]:
        """Record the model's turn; the environment's answer and whether the rollout has stopped."""
        from verifiers.utils.message_utils import maybe_normalize_messages, normalize_messages  # noqa: PLC0415

        env, state = self.env, self.state
        if isinstance(assistant, str):
            assistant = {"role": "assistant", "content": assistant}
        completion = normalize_messages([assistant], field_name="completion")
        step = {
            "prompt": self.prompt,
            "completion": completion,
            "response": None,
            "tokens": None,
            "reward": None,
            "advantage": None,
            "is_truncated": False,
            "trajectory_id": state["trajectory_id"],
            "extras": {},
        }
        await env.add_trajectory_step(state, step)
        if await env.is_completed(state):
            return [], True
        before = len(self.prompt) + len(completion)
        prompt = maybe_normalize_messages(await env.get_prompt_messages(state), field_name="prompt")
        if state.get("final_env_response") is not None:
            await env.is_completed(state)  # records the stop condition
            return _plain_all(state["final_env_response"]), True
        self.prompt = prompt
        return _plain_all(prompt[before:]), False

    async def score(self) -> tuple[float, dict[str, float]]:
        """Finish the rollout as verifiers does (cleanup renders the completion) and score it with the
        environment's rubric."""
        env, state = self.env, self.state
        await env.cleanup(state)
        if env.score_rollouts:
            await env.rubric.score_rollout(state)
        else:
            await env.rubric.dummy_score_rollout(state)
        await env.rubric.cleanup(state)
        metrics = {f"reward/{k}": float(v) for k, v in (state.get("metrics") or {}).items()}
        return float(state["reward"]), metrics


def verifiers_environment(
    load_environment: Callable[..., Any], config: dict[str, Any] | None = None, *, name: str | None = None
) -> type[SingleTurnEnv] | type[MultiTurnEnv]:
    """The tunegate environment class that plays ``load_environment(**config)``'s verifiers environment."""
    if not callable(load_environment):
        raise TypeError("the entrypoint must be a module's load_environment function")
    vf = _vf()
    env = load_environment(**dict(config or {}))
    if not isinstance(env, vf.Environment):
        raise TypeError(f"load_environment returned {type(env).__name__}, not a verifiers Environment")
    if not isinstance(env, vf.MultiTurnEnv):
        raise TypeError(f"{type(env).__name__} is not a vf.MultiTurnEnv (nor a vf.SingleTurnEnv)")
    client = _model_free_client(vf)
    title = name or f"verifiers[{type(env).__name__}]"

    if isinstance(env, vf.SingleTurnEnv):

        class VerifiersSingleTurn(SingleTurnEnv):
            vf_env = env

            def tasks(self) -> list[dict[str, Any]]:
                return dataset_tasks(env)

            async def reward(self, task: dict[str, Any], completion: str | list[Message]) -> float:
                rollout = Rollout(env, client)
                await rollout.start(task)
                if isinstance(completion, str):
                    await rollout.turn(completion)
                else:
                    for message in completion:
                        if message.get("role") == "assistant":
                            await rollout.turn(message)
                reward, _ = await rollout.score()
                return reward

        VerifiersSingleTurn.__name__ = VerifiersSingleTurn.__qualname__ = title
        return VerifiersSingleTurn

    class VerifiersMultiTurn(MultiTurnEnv):
        vf_env = env
        max_turns = env.max_turns if env.max_turns > 0 else MultiTurnEnv.max_turns

        def __init__(self, config: dict[str, Any] | None = None) -> None:
            super().__init__(config)
            self.rollout = Rollout(env, client)

        def tasks(self) -> list[dict[str, Any]]:
            return dataset_tasks(env)

        async def reset(self, task: dict[str, Any]) -> list[Message]:
            self.rollout = Rollout(env, client)
            return await self.rollout.start(task)

        async def step(self, assistant_message: Message) -> StepResult:
            observation, done = await self.rollout.turn(assistant_message)
            if not done:
                return StepResult(observation=observation, reward=0.0, done=False)
            reward, metrics = await self.rollout.score()
            info = {"metrics": metrics, "stop_condition": self.rollout.state.get("stop_condition")}
            return StepResult(observation=observation, reward=reward, done=True, info=copy.deepcopy(info))

    VerifiersMultiTurn.__name__ = VerifiersMultiTurn.__qualname__ = title
    return VerifiersMultiTurn


__all__ = ["Rollout", "dataset_tasks", "rollout_input", "verifiers_environment"]

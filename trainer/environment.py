"""Reinforcement learning on an uploaded environment package, played in its sandbox.

``spec.environment`` (``package_dir``, ``config``) names an extracted package (the worker unpacks
the upload with ``envsdk.archive.safe_extract``). :class:`EnvironmentSession` owns its
:class:`envsdk.Sandbox` (restarted after a crash or a timeout) and gives the trainer:

* single-turn packages: :meth:`EnvironmentSession.reward_func`, a TRL reward function that sends the whole
  generation batch to the sandbox in one ``reward_batch`` call (or one ``group_reward`` call per prompt
  when the package says it judges groups);
* multi-turn and tool packages: :meth:`EnvironmentSession.rollout_func`, TRL's ``rollout_func`` playing
  every episode ``reset -> generate -> step ...`` until the environment is done, ``max_turns`` or
  ``max_completion_length`` (which covers the whole episode). Turns are token concatenations; the tokens of
  the environment's messages (user replies, tool results) get ``env_mask`` 0 so only the model's own tokens
  carry loss. Tool calls are parsed from the model's ``<tool_call>`` blocks and executed by the
  environment's ``step`` inside the sandbox. The episode's total reward reaches GRPO through
  :meth:`EnvironmentSession.episode_reward_func`. When ``reset`` names a ``forced_tool_call`` (a tool
  package with ``force_first_tool_call`` in its config), that call is the episode's first assistant turn,
  rendered by the chat template as the model would write it and masked out of the loss (``env_mask`` 0:
  the policy did not sample it); the model writes every later turn.

Failures are data: an item or an episode that raises scores 0 and is counted (``episode_failures``, and
their share of the batch ``env_error_rate``, which the job's ``error_rate`` guard watches); the job goes on.
When every call of :data:`FAIL_AFTER` batches in a row failed, the environment is broken and the job fails
with ``environment_error`` naming the last cause. Episode metrics (``turns_mean``, ``tool_calls_mean``,
``episode_failures``) join the job's ``metrics`` events, and so do the numbers an
environment reports under its last step's ``info["metrics"]`` (names with a ``/``, such as
``tools/sandboxed_fraction``), each averaged over the episodes that reported it.

Size: over 450 lines, and left whole: an episode's play is one loop (reset, a sampled turn, step, the
environment's reply) over the episode's state, which every part of it keeps in step: its tokens, their loss
mask and the sampler's log-probabilities of them (:mod:`trainer.mismatch`).
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from envsdk.errors import EnvSDKError, SandboxError
from trainer.contract import TrainerSpec
from trainer.data import ITEM_COLUMN
from trainer.errors import TrainerError
from trainer.generation import generate_turn as _generate
from trainer.generation import stop_ids
from trainer.turns import assistant_message, assistant_turn_ids, suffix_ids, template_ids

logger = logging.getLogger(__name__)

FAIL_AFTER = 3
"""Consecutive batches in which every call failed before the job fails with ``environment_error``."""
MULTI_TURN_KINDS = ("multi_turn", "tool")
RESERVED_METRIC_PREFIXES = ("rewards/", "completions/", "sampling/", "clip_ratio/")
"""Metric names of the trainer itself that an environment's ``info["metrics"]`` may not shadow."""


@dataclass
class Episode:
    """One episode being played by :meth:`EnvironmentSession.rollout_func`."""

    task: dict[str, Any]
    messages: list[dict[str, Any]] = field(default_factory=list)
    episode_id: str | None = None
    prompt_ids: list[int] = field(default_factory=list)
    completion_ids: list[int] = field(default_factory=list)
    env_mask: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)  # the sampler's; None: not sampled
    reward: float = 0.0
    turns: int = 0
    tool_calls: int = 0
    done: bool = False
    error: str | None = None
    info: dict[str, Any] = field(default_factory=dict)
    forced_tool_call: dict[str, Any] | None = None


class EnvironmentSession:
    """The job's environment package, running in its sandbox for the whole job."""

    def __init__(self, spec: TrainerSpec) -> None:
        if spec.environment is None:
            raise TrainerError("invalid_spec", "environment.package_dir is required")
        from trainer.envpool import open_sandbox

        try:
            self.sandbox = open_sandbox(spec)  # on the env servers when any is registered, else here
            self.info: dict[str, Any] = self.sandbox.start()
        except EnvSDKError as exc:
            raise TrainerError("environment_error", f"the environment did not start: {exc.message}") from None
        self.kind = str(self.info.get("kind") or "")
        if self.kind not in ("single_turn", *MULTI_TURN_KINDS):
            raise TrainerError("environment_error", f"unknown environment kind {self.kind!r}")
        turns = [t for t in (self.info.get("max_turns"), self.sandbox.limits.max_turns) if isinstance(t, int)]
        self.max_turns = max(1, min(turns)) if turns else 8
        self.uses_group_reward = bool(self.info.get("group_reward"))
        self.scores_truncated = bool(self.info.get("scores_truncated"))
        """A turn cut off by the completion budget is stepped all the same (the environment's format scores
        every completion, as TRL does); else the episode ends there, unscored."""
        self.name = self.sandbox.manifest.name
        self._failed_batches = 0
        self.last_error: str | None = None
        self.env_wait_s = 0.0
        """Seconds spent waiting on environment calls since the last reset (``env_wait_s`` of a step)."""
        self._threads: ThreadPoolExecutor | None = None
        self._timing_paused = False
        self.pipeline: Any = None
        """On env servers, the :class:`trainer.pipeline.RewardPipeline` scoring groups as they generate."""
        logger.info("environment %s (%s) started: %s", self.name, self.kind, self.info)

    @property
    def multi_turn(self) -> bool:
        return self.kind in MULTI_TURN_KINDS

    def close(self) -> None:
        if self._threads is not None:
            self._threads.shutdown(wait=False)
        self.sandbox.close()

    # -- calls and failure accounting ------------------------------------------------------------
    def _call(self, method: str, params: dict[str, Any]) -> Any:
        """One sandbox call; a dead sandbox is restarted before the next call. Env servers that keep dying
        on the package (``servers_lost``) fail the job."""
        return self._guarded(lambda: self.sandbox.call(method, params))

    def _call_each(self, method: str, each: list[dict[str, Any]]) -> list[Any]:
        """``method`` once per params of ``each``: in turn here, all at once on env servers."""
        many = getattr(self.sandbox, "call_many", None)
        if many is None:
            return [self._call(method, params) for params in each]
        return list(self._guarded(lambda: many(method, each)))

    def _guarded(self, call: Callable[[], Any]) -> Any:
        started = time.monotonic()
        try:
            if not self.sandbox.running:
                try:
                    self.sandbox.start()
                except SandboxError as exc:
                    raise SandboxError(exc.code, f"restart failed: {exc.message}") from None
            return call()
        except SandboxError as exc:
            if exc.code in ("servers_lost", "package_refused"):
                raise TrainerError("environment_error", f"environment {self.name}: {exc.message}") from None
            raise
        finally:
            if not self._timing_paused:
                self.env_wait_s += time.monotonic() - started

    def _waited(self, log: Callable[[str, float], Any]) -> None:
        """Log the step's ``env_wait_s`` (and ``env_retries`` on env servers) and start counting again."""
        log("env_wait_s", self.env_wait_s)
        self.env_wait_s = 0.0
        retries = getattr(self.sandbox, "retries", None)
        if retries is not None:
            log("env_retries", float(retries))

    def _batch_done(self, calls: int, failures: int, error: str | None) -> None:
        """Count a batch; ``environment_error`` after ``FAIL_AFTER`` batches of nothing but failures."""
        if error:
            self.last_error = error
        if calls > 0 and failures >= calls:
            self._failed_batches += 1
            logger.warning("environment %s: every call of the batch failed: %s", self.name, error)
            if self._failed_batches >= FAIL_AFTER:
                raise TrainerError(
                    "environment_error",
                    f"environment {self.name} failed every call in {FAIL_AFTER} batches in a row; "
                    f"last error: {self.last_error}",
                )
        else:
            self._failed_batches = 0

    # -- single turn ---------------------------------------------------------------------------------
    def reward_func(self) -> Callable[..., list[float | None]]:
        """TRL reward function of a single-turn package."""

        def environment(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
            tasks = _tasks(kwargs, len(completions))
            payload = [_completion_payload(c) for c in completions]
            results: list[dict[str, Any]]
            try:
                if self.pipeline is not None:
                    results = self.pipeline.rewards(tasks, payload)
                    _log(kwargs, "env_sent_early", self.pipeline.early_fraction)
                elif self.uses_group_reward:
                    results = self._group_rewards(tasks, payload)
                else:
                    items = [{"task": t, "completion": c} for t, c in zip(tasks, payload, strict=True)]
                    results = self._call("reward_batch", {"items": items})
            except SandboxError as exc:
                results = [{"reward": None, "error": f"{exc.code}: {exc.message}"}] * len(completions)
            failures = [r for r in results if r.get("reward") is None]
            error = next((str(r.get("error")) for r in failures), None)
            _log(kwargs, "episode_failures", float(len(failures)))
            _log(kwargs, "env_error_rate", len(failures) / max(len(results), 1))
            self._waited(lambda name, value: _log(kwargs, name, value))
            self._batch_done(len(results), len(failures), error)
            return [float(r["reward"]) if r.get("reward") is not None else 0.0 for r in results]

        return environment

    def _group_rewards(self, tasks: list[dict[str, Any]], completions: list[Any]) -> list[dict[str, Any]]:
        """``group_reward`` once per run of equal tasks (GRPO's groups are consecutive)."""
        groups: list[dict[str, Any]] = []
        start = 0
        while start < len(tasks):
            end = start + 1
            while end < len(tasks) and tasks[end] == tasks[start]:
                end += 1
            groups.append({"task": tasks[start], "completions": completions[start:end]})
            start = end
        return [result for group in self._call_each("group_reward", groups) for result in group]

    # -- multi turn ----------------------------------------------------------------------------------
    def episode_reward_func(self) -> Callable[..., list[float | None]]:
        """TRL reward function reading the episode results that :meth:`rollout_func` returned."""

        def environment(prompts: list[Any], completions: list[Any], **kwargs: Any) -> list[float | None]:
            rewards = kwargs.get("env_reward") or [0.0] * len(completions)
            return [float(r) if r is not None else 0.0 for r in rewards]

        return environment

    def rollout_func(
        self, hp_max_completion_length: int, temperature: float
    ) -> Callable[..., dict[str, Any]]:
        """TRL ``rollout_func``: plays one episode per prompt (prompts arrive repeated per generation)."""

        def rollout(prompts: list[Any], trainer: Any) -> dict[str, Any]:
            inputs = getattr(trainer, "tunegate_inputs", None) or []
            tasks = [_row(x) for x in inputs] if len(inputs) == len(prompts) else [{} for _ in prompts]
            for task, prompt in zip(tasks, prompts, strict=True):
                task.setdefault("messages", prompt)
            episodes = self.play(trainer, tasks, hp_max_completion_length, temperature)
            failures = [e for e in episodes if e.error]
            n = max(len(episodes), 1)
            trainer._log_metric("turns_mean", sum(e.turns for e in episodes) / n)
            trainer._log_metric("tool_calls_mean", sum(e.tool_calls for e in episodes) / n)
            trainer._log_metric("episode_failures", float(len(failures)))
            trainer._log_metric("env_error_rate", len(failures) / n)
            for name, value in info_metrics(episodes).items():
                trainer._log_metric(name, value)
            self._waited(trainer._log_metric)
            self._batch_done(len(episodes), len(failures), next((e.error for e in failures), None))
            return {
                "prompt_ids": [e.prompt_ids for e in episodes],
                "completion_ids": [e.completion_ids for e in episodes],
                "logprobs": [e.logprobs for e in episodes],  # for trainer.mismatch
                "env_mask": [e.env_mask for e in episodes],
                "env_reward": [0.0 if e.error else e.reward for e in episodes],
            }

        return rollout

    def play(
        self, trainer: Any, tasks: list[dict[str, Any]], budget: int, temperature: float
    ) -> list[Episode]:
        """Play one episode per task with the trainer's current policy; never raises for env failures."""
        tokenizer = trainer.processing_class
        episodes = [Episode(task=t) for t in tasks]

        def open_episode(ep: Episode) -> None:
            try:
                opened = self._call("reset", {"task": ep.task})
                ep.episode_id = str(opened["episode_id"])
                ep.messages = list(opened.get("observation") or [])
                if not ep.messages:
                    raise ValueError("reset returned no messages")
                ep.prompt_ids = template_ids(tokenizer, ep.messages, opened.get("tools") or None)
                ep.forced_tool_call = opened.get("forced_tool_call") or None
            except (SandboxError, ValueError, KeyError, TypeError) as exc:
                ep.error = f"reset failed: {exc}"
                ep.done = True
                ep.prompt_ids = template_ids(tokenizer, list(ep.task.get("messages") or []), None)
                return
            if ep.forced_tool_call:
                self._forced_turn(ep, opened.get("tools") or None, budget, tokenizer)

        self._each(open_episode, episodes)
        for _ in range(self.max_turns):
            active = [ep for ep in episodes if not ep.done]
            if not active:
                break
            generated, scored = _generate(
                trainer,
                [ep.prompt_ids + ep.completion_ids for ep in active],
                [budget - len(ep.completion_ids) for ep in active],
                temperature,
            )
            turns = list(zip(active, generated, scored, strict=True))
            self._each(lambda t: self._advance(t[0], t[1], budget, tokenizer, logprobs=t[2]), turns)
        self._each(self._close_episode, [ep for ep in episodes if not ep.done and ep.episode_id is not None])
        for ep in episodes:
            if not ep.completion_ids:  # TRL needs at least one completion token
                ep.completion_ids = [tokenizer.eos_token_id]
                ep.env_mask, ep.logprobs = [0], [None]
        return episodes

    def _each(self, work: Callable[[Any], None], items: list[Any]) -> None:
        """``work`` on each item: in turn in the trainer's own sandbox (one process), all at once on env
        servers (each episode's calls go to its own server), where the wait counts once: the wall time."""
        if not hasattr(self.sandbox, "call_many") or len(items) < 2:
            for item in items:
                work(item)
            return
        if self._threads is None:
            self._threads = ThreadPoolExecutor(max_workers=32, thread_name_prefix="episode")
        started = time.monotonic()
        self._timing_paused = True
        try:
            list(self._threads.map(work, items))
        finally:
            self._timing_paused = False
            self.env_wait_s += time.monotonic() - started

    def _forced_turn(
        self, ep: Episode, tools: list[dict[str, Any]] | None, budget: int, tokenizer: Any
    ) -> None:
        """Play the episode's forced first tool call as its first assistant turn (tokens masked out)."""
        from envsdk.rollout import forced_assistant_message

        assert ep.forced_tool_call is not None
        assistant = forced_assistant_message(ep.forced_tool_call)
        ids = assistant_turn_ids(tokenizer, ep.messages, tools, ep.forced_tool_call)
        if len(ids) >= budget:  # no room for the call and an answer: let the model write the turn instead
            logger.warning("forced tool call of %d tokens does not fit a budget of %d", len(ids), budget)
            return
        self._advance(ep, ids, budget, tokenizer, assistant=assistant, trained=False)

    def _advance(
        self,
        ep: Episode,
        ids: list[int],
        budget: int,
        tokenizer: Any,
        *,
        assistant: dict[str, Any] | None = None,
        trained: bool = True,
        logprobs: list[float | None] | None = None,
    ) -> None:
        """Add one assistant turn (sampled, with the sampler's ``logprobs``, or given as ``assistant`` with
        ``trained=False``) to the episode and answer it with the environment's ``step``."""
        ep.completion_ids += ids
        ep.env_mask += [1 if trained else 0] * len(ids)
        ep.logprobs += logprobs if logprobs is not None else [None] * len(ids)
        ep.turns += 1
        finished = bool(ids) and ids[-1] in stop_ids(tokenizer)
        if assistant is None:
            assistant = assistant_message(tokenizer.decode(ids, skip_special_tokens=False), ep.turns)
        ep.messages.append(assistant)
        if not finished:  # out of completion budget mid-turn: the episode is truncated
            if not self.scores_truncated:
                ep.done = True
                self._close_episode(ep)
                return
            # its last turn ends the episode and is scored (a cut-off tool call is not run)
            ep.messages[-1] = assistant = {k: v for k, v in assistant.items() if k != "tool_calls"}
        try:
            step = self._call("step", {"episode_id": ep.episode_id, "assistant_message": assistant})
        except SandboxError as exc:
            ep.error, ep.done = f"{exc.code}: {exc.message}", True
            return
        ep.tool_calls += len(assistant.get("tool_calls") or [])
        ep.reward += float(step.get("reward") or 0.0)
        if step.get("info"):
            ep.info = dict(step["info"])
        if step.get("error"):
            ep.error, ep.done = str(step["error"]), True
            return
        if step.get("done"):
            ep.done = True
            return
        observation = list(step.get("observation") or [])
        if not observation:
            return
        suffix = suffix_ids(tokenizer, observation, assistant)
        if len(ep.completion_ids) + len(suffix) >= budget:  # no room left for another model turn
            ep.done = True
            self._close_episode(ep)
            return
        ep.messages += observation
        ep.completion_ids += suffix
        ep.env_mask += [0] * len(suffix)
        ep.logprobs += [None] * len(suffix)

    def _close_episode(self, ep: Episode) -> None:
        try:
            self._call("close_episode", {"episode_id": ep.episode_id})
        except SandboxError as exc:
            logger.debug("close_episode failed: %s", exc)


# -- helpers -----------------------------------------------------------------------------------------


def info_metrics(episodes: list[Episode]) -> dict[str, float]:
    """Numbers under the episodes' ``info["metrics"]``, each averaged over the episodes reporting it."""
    values: dict[str, list[float]] = {}
    for ep in episodes:
        metrics = ep.info.get("metrics")
        if not isinstance(metrics, dict):
            continue
        for name, value in metrics.items():
            if "/" not in str(name) or str(name).startswith(RESERVED_METRIC_PREFIXES):
                continue
            if isinstance(value, int | float) and value == value:  # numbers and bools, not NaN
                values.setdefault(str(name), []).append(float(value))
    return {name: sum(v) / len(v) for name, v in values.items()}


def _row(x: dict[str, Any]) -> dict[str, Any]:
    raw = x.get(ITEM_COLUMN)
    if isinstance(raw, str):
        value = json.loads(raw)
        return value if isinstance(value, dict) else {}
    return dict(raw or {})


def _tasks(kwargs: dict[str, Any], n: int) -> list[dict[str, Any]]:
    rows = kwargs.get(ITEM_COLUMN) or ["{}"] * n
    return [_row({ITEM_COLUMN: r}) for r in rows]


def _completion_payload(completion: Any) -> Any:
    """A TRL completion as the environment sees it: text, or a list of plain messages."""
    if isinstance(completion, str):
        return completion
    return [
        {"role": m.get("role", "assistant"), "content": m.get("content") or ""}
        for m in completion
        if isinstance(m, dict)
    ]


def _log(kwargs: dict[str, Any], name: str, value: float) -> None:
    log_metric = kwargs.get("log_metric")
    if callable(log_metric):
        log_metric(name, value)


def environment_trainer_class() -> type:
    """``GRPOTrainer`` that keeps the current batch's rows for :meth:`EnvironmentSession.rollout_func`
    (TRL hands a rollout function only the prompts; an episode's ``reset`` needs the whole task row)."""
    from trl import GRPOTrainer

    class EnvironmentGRPOTrainer(GRPOTrainer):
        tunegate_inputs: list[dict[str, Any]] | None = None

        def _generate_and_score_completions(self, inputs: list[dict[str, Any]]) -> dict[str, Any]:
            self.tunegate_inputs = inputs
            return super()._generate_and_score_completions(inputs)

    return EnvironmentGRPOTrainer

"""Rewards scored while the batch is still being generated, on env servers (:mod:`envsdk.remote`).

TRL's ``GRPOTrainer`` generates a whole batch, then calls the reward functions and waits for them. On env
servers a single-turn job's rewards need not wait for the batch: :class:`RewardPipeline` sends each group (a
run of completions of one task, as GRPO lays them out) for scoring the moment its last completion ends, while
the model still generates the rest of the batch, and the reward function collects the results.

* During generation (transformers' ``generate``), :class:`GroupStreamer` sees each decoding step's tokens (the
  ``streamer`` of ``generate``); a group whose completions all reached an end-of-turn token is decoded exactly
  as TRL decodes it and sent.
* When generation returns, every group not sent yet goes (:meth:`RewardPipeline.offer` with TRL's own
  completions), so scoring also overlaps what TRL computes before rewards (reference and old log-probs).
* The reward function (:meth:`RewardPipeline.rewards`) offers every group again: a group sent with the very
  same task and completion reuses its requests, any other is sent now. So each completion is scored once, on
  exactly what TRL hands the reward function, and what is learned does not change: the same completions (the
  streamer only reads tokens), the same rewards, in the same order.

With vLLM the batch comes back at once: groups are sent when it returns. A trainer with no env server (its own
sandbox) does none of this.
"""

from __future__ import annotations

import functools
import json
import logging
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from contextlib import contextmanager
from typing import Any

from trainer.environment import EnvironmentSession, _completion_payload, _row, environment_trainer_class

logger = logging.getLogger(__name__)


def groups(tasks: list[dict[str, Any]]) -> list[tuple[int, int]]:
    """``[start, end)`` of each run of equal tasks (GRPO's groups are consecutive)."""
    spans: list[tuple[int, int]] = []
    start = 0
    while start < len(tasks):
        end = start + 1
        while end < len(tasks) and tasks[end] == tasks[start]:
            end += 1
        spans.append((start, end))
        start = end
    return spans


class RewardPipeline:
    """The rewards of one batch, sent group by group ahead of the reward function (see the module)."""

    def __init__(self, session: EnvironmentSession) -> None:
        self.session = session
        self._sent: dict[int, tuple[str, list[Future[Any]]]] = {}
        """Group start -> (its request's content, the futures of its results)."""
        self.sent_early = 0
        """Completions of the current batch sent during generation."""
        self.early_fraction = 0.0
        """Of the last batch's completions, the share sent during generation (``env_sent_early``)."""

    def offer(self, start: int, tasks: list[dict[str, Any]], payloads: list[Any]) -> None:
        """Send group ``[start, start + len(tasks))`` for scoring unless the same one was sent already."""
        content = json.dumps([tasks, payloads], sort_keys=True)
        sent = self._sent.get(start)
        if sent is not None and sent[0] == content:
            return
        if sent is not None:
            logger.warning("group at %d changed after it was sent for scoring: sent again", start)
        self._sent[start] = (content, self.session._guarded(lambda: self._send(tasks, payloads)))

    def offer_all(self, tasks: list[dict[str, Any]], payloads: list[Any]) -> None:
        for start, end in groups(tasks):
            self.offer(start, tasks[start:end], payloads[start:end])

    def rewards(self, tasks: list[dict[str, Any]], payloads: list[Any]) -> list[dict[str, Any]]:
        """The batch's results in order: groups sent ahead are collected, the others sent now."""
        self.offer_all(tasks, payloads)
        futures = [self._sent[start][1] for start, _ in groups(tasks)]
        self._sent.clear()
        self.early_fraction = min(self.sent_early, len(tasks)) / max(len(tasks), 1)
        self.sent_early = 0
        box: Any = self.session.sandbox
        chunks = self.session._guarded(lambda: [box.gather(f) for f in futures])
        return [result for group in chunks for chunk in group for result in chunk]

    def _send(self, tasks: list[dict[str, Any]], payloads: list[Any]) -> list[Future[Any]]:
        box: Any = self.session.sandbox
        if self.session.uses_group_reward:
            return [box.submit("group_reward", {"task": tasks[0], "completions": payloads})]
        items = [{"task": t, "completion": c} for t, c in zip(tasks, payloads, strict=True)]
        return list(box.submit_reward_batch(items))

    def streamer(
        self, tasks: list[dict[str, Any]], decode: Callable[[list[int]], Any], eos: set[int]
    ) -> GroupStreamer:
        """A ``generate`` streamer that sends each group of ``tasks`` once its completions all ended;
        ``decode`` makes a completion's payload from its tokens as TRL would."""

        def ready(start: int, end: int, ids: list[list[int]]) -> None:
            self.offer(start, tasks[start:end], [decode(x) for x in ids])
            self.sent_early += end - start

        return GroupStreamer(groups(tasks), eos, ready)


class GroupStreamer:
    """transformers' streamer interface (``put``, ``end``): the first ``put`` is the prompts, each later one a
    decoding step's token per row. Calls ``ready(start, end, ids)`` once per group whose rows all ended (their
    tokens up to and including the first end-of-turn token); it never changes what is generated."""

    def __init__(
        self, spans: list[tuple[int, int]], eos: set[int], ready: Callable[[int, int, list[list[int]]], None]
    ) -> None:
        self.spans = list(spans)
        self.eos = eos
        self.ready = ready
        self.ids: list[list[int]] = []
        self.done: list[bool] = []
        self.failed = False

    def put(self, value: Any) -> None:
        if self.failed:
            return
        try:
            if value.dim() > 1:  # the prompts, before the first step
                self.ids = [[] for _ in range(value.shape[0])]
                self.done = [False] * value.shape[0]
                return
            for row, token in enumerate(value.tolist()):
                if not self.done[row]:
                    self.ids[row].append(int(token))
                    self.done[row] = int(token) in self.eos
            finished = [(s, e) for s, e in self.spans if all(self.done[s:e])]
            for start, end in finished:
                self.spans.remove((start, end))
                self.ready(start, end, self.ids[start:end])
        except Exception:  # noqa: BLE001 - never break generation: the groups go when it returns
            logger.exception("sending groups during generation failed; they go when it ends")
            self.failed = True

    def end(self) -> None:
        pass


@contextmanager
def streaming(model: Any, streamer: GroupStreamer) -> Iterator[None]:
    """``model.generate`` called with ``streamer`` inside the block (TRL's generation call takes none)."""
    model.generate = functools.partial(model.generate, streamer=streamer)
    try:
        yield
    finally:
        del model.generate


def pipelined_trainer_class(pipeline: RewardPipeline) -> type:
    """``GRPOTrainer`` (keeping the batch's rows, :func:`trainer.environment.environment_trainer_class`) whose
    generation sends each group's rewards through ``pipeline`` as the group ends."""
    from trl.data_utils import is_conversational

    base: Any = environment_trainer_class()

    class PipelinedGRPOTrainer(base):
        def _batch_tasks(self) -> list[dict[str, Any]]:
            return [_row(x) for x in (self.tunegate_inputs or [])]

        def _generate_single_turn(self, prompt_ids: Any, *args: Any, **kwargs: Any) -> Any:
            tokenizer = self.processing_class
            schema = getattr(tokenizer, "response_template", None) or getattr(
                tokenizer, "response_schema", None
            )
            tasks = self._batch_tasks()
            if (
                self.use_vllm
                or self.use_transformers_continuous_batching
                or schema is not None  # TRL parses such completions itself: sent when generation returns
                or len(tasks) != len(prompt_ids)
            ):
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)
            conversational = is_conversational({"prompt": (self.tunegate_inputs or [{}])[0].get("prompt")})

            def decode(ids: list[int]) -> Any:
                text = tokenizer.decode(ids, skip_special_tokens=True)
                return [{"role": "assistant", "content": text}] if conversational else text

            streamer = pipeline.streamer(tasks, decode, set(self.eos_token_ids))
            with streaming(self.accelerator.unwrap_model(self.model_wrapped), streamer):
                return super()._generate_single_turn(prompt_ids, *args, **kwargs)

        def _generate(self, prompts: list[Any]) -> Any:
            out = super()._generate(prompts)
            tasks = self._batch_tasks()
            if len(tasks) == len(out[3]):  # the completions TRL made: groups not sent yet go now
                pipeline.offer_all(tasks, [_completion_payload(c) for c in out[3]])
            return out

    return PipelinedGRPOTrainer

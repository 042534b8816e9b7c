"""The bridge from a Hugging Face/TRL training loop to the trainer's events, and the SIGTERM stop.

``EventCallback`` turns every ``on_log`` into a ``metrics`` event (TRL's names mapped to the job's: ``loss``
-> ``train_loss``, ``reward`` -> ``reward_mean`` ...), every ``on_save`` into a ``checkpoint`` event, counts
trained tokens across resumes, and when a stop was requested finishes the current step, saves and stops.

With a :class:`trainer.evaluation.Validator` it also evaluates: before the first step (a ``metrics`` event
for step 0 with the base model's ``valid_*`` and ``full_valid_*``), every ``eval_interval`` steps on the
fixed sample (``valid_*`` in that step's event) and at every checkpoint on every row (``full_valid_*`` in
that step's event and in the checkpoint's metrics), and names the best checkpoint at the end.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainer.distributed import anyone
from trainer.evaluation import Validator
from trainer.events import EventWriter

logger = logging.getLogger(__name__)

TOKENS_FILE = "tunegate_tokens.json"
"""Written into every checkpoint: ``{"trained_tokens": int}`` so a resumed job keeps counting."""

_RENAMES = {
    "loss": "train_loss",
    "reward": "reward_mean",
    "completions/mean_length": "completion_length_mean",
    "mean_token_accuracy": "train_mean_token_accuracy",
}
_SKIP = {"num_tokens", "total_flos", "train_runtime", "train_samples_per_second", "train_steps_per_second"}


def map_metrics(logs: dict[str, Any]) -> dict[str, Any]:
    """TRL/transformers log keys -> event metric keys (unknown numeric keys pass through unchanged)."""
    out: dict[str, Any] = {}
    for key, value in logs.items():
        if key in _SKIP or not isinstance(value, int | float):
            continue
        if key in _RENAMES:
            out[_RENAMES[key]] = value
        elif key.startswith("rewards/") and key.endswith("/mean"):
            out[key[: -len("/mean")]] = value
        else:
            out[key] = value
    return out


def read_checkpoint_tokens(checkpoint: str | Path) -> int:
    """Tokens trained up to a checkpoint written by this trainer (0 when unknown)."""
    try:
        data = json.loads((Path(checkpoint) / TOKENS_FILE).read_text())
        return int(data.get("trained_tokens", 0))
    except (OSError, ValueError, TypeError):
        return 0


class EventCallback(TrainerCallback):
    """Emits ``metrics``/``checkpoint`` events and honours ``stop_requested``."""

    def __init__(
        self,
        events: EventWriter,
        *,
        stop_requested: threading.Event,
        tokens_offset: int = 0,
        tokens_restored_by_state: bool = False,
        validator: Validator | None = None,
        eval_interval: int = 0,
    ) -> None:
        self.events = events
        self.validator = validator
        self.eval_interval = eval_interval
        self.pending: dict[str, Any] = {}
        """Evaluation numbers of the current step, added to its metrics event."""
        self.best: tuple[int, float] | None = None
        """(step, primary full-validation number) of the best checkpoint so far."""
        self.stop_requested = stop_requested
        self.tokens_offset = tokens_offset
        # GRPO counts tokens in TrainerState (restored on resume); SFT/DPO count from 0 in each process.
        self.tokens_restored_by_state = tokens_restored_by_state
        self._cum_at_start: float | None = None
        self.trained_tokens = tokens_offset
        self.last_metrics: dict[str, Any] = {}
        self.last_checkpoint: str | None = None
        self.stopped_at: int | None = None
        self.summary: dict[str, Any] = {}

    def on_train_begin(self, args, state, control, **kwargs):
        self._cum_at_start = float(state.num_input_tokens_seen or 0) if self.tokens_restored_by_state else 0.0
        self.events.message(
            f"Training started at step {state.global_step} of {state.max_steps}", step=state.global_step
        )
        if self.validator is not None and state.global_step == 0:
            data = {"step": 0, **self.validator.periodic(), **self.validator.full()}
            self.events.metrics(0, state.max_steps, data)

    def on_step_end(self, args, state, control, **kwargs):
        if anyone(self.stop_requested.is_set()) and self.stopped_at is None:  # all ranks stop at one step
            self.stopped_at = state.global_step
            control.should_log = True
            control.should_save = True
            control.should_training_stop = True
        elif self.validator is not None:
            # The flow callback (first in line) has already decided whether this step logs and saves; an
            # evaluation loop run now resets those decisions (its own log clears should_log), so they are
            # put back after it.
            decided = (control.should_log, control.should_save, control.should_training_stop)
            step = state.global_step
            if control.should_save or step >= state.max_steps:
                self.pending = {**self.validator.periodic(), **self.validator.full()}
            elif self.eval_interval and step % self.eval_interval == 0:
                self.pending = self.validator.periodic()
            control.should_log, control.should_save, control.should_training_stop = decided
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if "train_runtime" in logs:  # the end-of-training summary, not a step
            self.summary = map_metrics(logs)
            return
        if any(key.startswith("eval_") for key in logs):  # the validator's own evaluation loop
            return
        if "num_tokens" in logs and self._cum_at_start is not None:
            self.trained_tokens = self.tokens_offset + int(float(logs["num_tokens"]) - self._cum_at_start)
        data = map_metrics(logs)
        step = state.global_step
        data = {"step": step, **data, **self.pending, "tokens": self.trained_tokens}
        self.pending = {}
        self.last_metrics = data
        self.events.metrics(step, state.max_steps, data)

    def on_save(self, args, state, control, **kwargs):
        path = (Path(args.output_dir) / f"checkpoint-{state.global_step}").resolve()
        if args.process_index == 0:
            (path / TOKENS_FILE).write_text(json.dumps({"trained_tokens": self.trained_tokens}))
        self.last_checkpoint = str(path)
        metrics = dict(self.last_metrics)
        metrics["step"] = state.global_step
        self.events.checkpoint(state.global_step, str(path), metrics)
        if self.validator is not None:
            value = metrics.get(f"full_valid_{self.validator.primary}")
            best = self.best[1] if self.best is not None else None
            if isinstance(value, int | float) and self.validator.better(value, best):
                self.best = (state.global_step, float(value))

    def announce_best(self) -> None:
        """A message naming the checkpoint with the best full-validation score (when there was one)."""
        if self.validator is None or self.best is None:
            return
        step, value = self.best
        name = f"full_valid_{self.validator.primary}"
        self.events.message(
            f"Best checkpoint: step {step} ({name} {value:.4f})",
            step=step,
            data={"best_checkpoint_step": step, "metric": name, "value": value},
        )

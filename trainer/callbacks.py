"""The bridge from a Hugging Face/TRL training loop to the trainer's events, and the SIGTERM stop.

``EventCallback`` turns every ``on_log`` into a ``metrics`` event (TRL's names mapped to the job's: ``loss``
-> ``train_loss``, ``reward`` -> ``reward_mean`` ...), every ``on_save`` into a ``checkpoint`` event, counts
trained tokens across resumes, and when a stop was requested finishes the current step, saves and stops.
"""

from __future__ import annotations

import json
import logging
import threading
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from trainer.events import EventWriter

logger = logging.getLogger(__name__)

TOKENS_FILE = "tunegate_tokens.json"
"""Written into every checkpoint: ``{"trained_tokens": int}`` so a resumed job keeps counting."""

_RENAMES = {
    "loss": "train_loss",
    "reward": "reward_mean",
    "completions/mean_length": "completion_length_mean",
    "mean_token_accuracy": "train_mean_token_accuracy",
    "eval_loss": "valid_loss",
    "eval_mean_token_accuracy": "valid_mean_token_accuracy",
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
    ) -> None:
        self.events = events
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

    def on_step_end(self, args, state, control, **kwargs):
        if self.stop_requested.is_set() and self.stopped_at is None:
            self.stopped_at = state.global_step
            control.should_log = True
            control.should_save = True
            control.should_training_stop = True
        return control

    def on_log(self, args, state, control, logs=None, **kwargs):
        logs = dict(logs or {})
        if "train_runtime" in logs:  # the end-of-training summary, not a step
            self.summary = map_metrics(logs)
            return
        if "num_tokens" in logs and self._cum_at_start is not None:
            self.trained_tokens = self.tokens_offset + int(float(logs["num_tokens"]) - self._cum_at_start)
        data = map_metrics(logs)
        step = state.global_step
        if "valid_loss" in data:
            # An evaluation (run at checkpoint steps, after that step's metrics event): its numbers ride on
            # the checkpoint and result events, as OpenAI's checkpoint metrics do.
            self.last_metrics.update({k: v for k, v in data.items() if k.startswith("valid_")})
            return
        data = {"step": step, **data, "tokens": self.trained_tokens}
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

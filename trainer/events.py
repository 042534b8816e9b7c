"""JSON-lines events on stdout: the trainer's only channel to the worker that spawned it.

Every event is one :data:`trainer.contract.TrainerEvent` as one JSON object on one line, flushed at once.
Nothing else may reach stdout, so ``EventWriter.claim_stdout()`` points ``sys.stdout`` at stderr (library
prints and progress bars go there) and keeps the real stdout for events. NaN and infinite numbers become
``null``.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import threading
from typing import Any, Literal, TextIO

from pydantic import BaseModel

from trainer import contract

logger = logging.getLogger(__name__)


def _clean(value: Any) -> Any:
    """Make a value JSON-safe: NaN/inf become null, tensors and numpy scalars plain numbers."""
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_clean(v) for v in value]
    if hasattr(value, "item") and callable(value.item):
        try:
            value = value.item()
        except (ValueError, RuntimeError):
            return None
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


class EventWriter:
    """Writes events as JSON lines; safe to call from several threads."""

    def __init__(self, stream: TextIO) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    @classmethod
    def claim_stdout(cls, *, reports: bool = True) -> EventWriter:
        """Take the process's stdout for events and send any other stdout writes to stderr. A process that
        does not report (a rank other than 0 of a job on several devices) writes its events nowhere."""
        writer = cls(sys.stdout if reports else open(os.devnull, "w"))  # noqa: SIM115 - lives with the process
        sys.stdout = sys.stderr
        return writer

    def emit(self, event: BaseModel) -> None:
        """Write one event and flush."""
        line = json.dumps(_clean(event.model_dump()), separators=(",", ":"), default=str)
        with self._lock:
            self._stream.write(line + "\n")
            self._stream.flush()

    def message(
        self,
        message: str,
        *,
        level: Literal["info", "warn", "error"] = "info",
        step: int | None = None,
        data: dict[str, Any] | None = None,
    ) -> None:
        """A human-readable milestone (``data``: numbers that go with it)."""
        logger.info("%s", message)
        self.emit(contract.MessageEvent(level=level, message=message, step=step, data=data))

    def metrics(self, step: int, total_steps: int, data: dict[str, Any]) -> None:
        """The numbers of one training step."""
        self.emit(contract.MetricsEvent(step=step, total_steps=total_steps, data=data))

    def checkpoint(self, step: int, path: str, metrics: dict[str, Any]) -> None:
        """A resumable checkpoint (also loadable as a LoRA adapter) was written."""
        self.emit(contract.CheckpointEvent(step=step, path=path, metrics=metrics))

    def result(self, adapter_path: str, trained_tokens: int, steps: int, metrics: dict[str, Any]) -> None:
        """The job finished; the final adapter is at ``adapter_path``."""
        self.emit(
            contract.ResultEvent(
                adapter_path=adapter_path, trained_tokens=trained_tokens, steps=steps, metrics=metrics
            )
        )

    def stopped(self, step: int, checkpoint: str | None) -> None:
        """The job stopped on SIGTERM after saving ``checkpoint``."""
        self.emit(contract.StoppedEvent(step=step, checkpoint=checkpoint))

    def error(self, code: str, message: str) -> None:
        """The job failed; ``message`` is one line without a traceback."""
        one_line = " ".join(str(message).split())[:2000]
        self.emit(contract.ErrorEvent(code=code, message=one_line))

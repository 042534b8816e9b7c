"""The trainer's one error type: a stable ``code`` plus a one-line message, reported as an ``error`` event."""

from __future__ import annotations


class TrainerError(Exception):
    """A job failure the trainer can name.

    Codes in use: ``invalid_spec``, ``invalid_training_file``, ``invalid_validation_file``, ``invalid_model``,
    ``invalid_checkpoint``, ``grader_error``, ``environment_error``,
    ``out_of_memory``, ``trainer_error`` (anything unexpected).
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message

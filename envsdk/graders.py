"""OpenAI graders as library objects: the place they are reached from envsdk.

The grader implementations (``string_check``, ``text_similarity``, ``score_model``, ``python``,
``multi``) live in ``trainer/graders.py``; envsdk does not import the trainer, so this module only names
the grader types a job's ``grader`` may use and the protocol a grader object follows. A ``GraderEnv``
wrapping a grader as a :class:`~envsdk.env.SingleTurnEnv` belongs here when it is needed.
"""

from __future__ import annotations

from typing import Any, Protocol

GRADER_TYPES = ("string_check", "text_similarity", "score_model", "label_model", "python", "multi")
"""The ``type`` values of OpenAI's reinforcement fine-tuning graders."""


class Grader(Protocol):
    """A grader scores one sample against one task row (``item``), like OpenAI's graders."""

    def grade(self, sample: dict[str, Any], item: dict[str, Any]) -> float: ...

"""
Guess Environment Implementation.

The environment hides a number from 1 to 10 (the task's ``target``) and answers each guess with
"higher", "lower" or "correct". A correct guess scores 1.0 and ends the episode; any other whole number
scores 0.1 (a well-formed guess); anything else scores 0. The episode ends after three guesses.
"""

import re
from uuid import uuid4

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import State

try:
    from ..models import GuessAction, GuessObservation
except ImportError:
    from models import GuessAction, GuessObservation

MAX_GUESSES = 3


class GuessEnvironment(Environment):
    """Guess a number with higher/lower feedback."""

    # Each WebSocket session gets its own instance; nothing is shared between them.
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self):
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self._target = 7
        self._left = MAX_GUESSES

    def reset(self, seed=None, episode_id=None, target=None, **kwargs) -> GuessObservation:
        self._state = State(episode_id=episode_id or str(uuid4()), step_count=0)
        self._target = int(target) if target is not None else 7
        self._left = MAX_GUESSES
        return GuessObservation(
            message="I am thinking of a number from 1 to 10.",
            guesses_left=self._left,
            done=False,
            reward=0.0,
        )

    def step(self, action: GuessAction) -> GuessObservation:  # type: ignore[override]
        self._state.step_count += 1
        self._left -= 1
        found = re.search(r"-?\d+", action.guess)
        if found is None:
            message, reward, done = "not a number", 0.0, False
        elif int(found.group()) == self._target:
            message, reward, done = "correct", 1.0, True
        else:
            message = "higher" if int(found.group()) < self._target else "lower"
            reward, done = 0.1, False
        return GuessObservation(
            message=message,
            guesses_left=self._left,
            done=done or self._left <= 0,
            reward=reward,
            metadata={"step": self._state.step_count},
        )

    @property
    def state(self) -> State:
        return self._state

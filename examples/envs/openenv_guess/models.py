"""Data models for the Guess environment: the Action the model takes and the Observation it gets back."""

from openenv.core.env_server.types import Action, Observation
from pydantic import Field


class GuessAction(Action):
    """Action for the Guess environment: a guess at the hidden number."""

    guess: str = Field(..., description="Your guess: a whole number from 1 to 10")


class GuessObservation(Observation):
    """Observation from the Guess environment: feedback on the last guess."""

    message: str = Field(default="", description="Feedback: higher, lower, correct, or not a number")
    guesses_left: int = Field(default=0, description="Guesses left in this episode")

"""Data for the Tinker API's tests, in the `tinker` SDK's types."""

from __future__ import annotations

from tinker import types


def datum(tokens: list[int]) -> types.Datum:
    """Next-token prediction on `tokens`, every target weighted 1."""
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )

"""The Evals API's `stored_completions` data source, checked: an eval's `data_source_config` of that type and
a run's `stored_completions` source, field by field (a bad one is a 400 whose `param` names it). What the
source reads is `gateway.evals.stored`'s."""

from __future__ import annotations

from typing import Any

from gateway.capture.protocol import check_metadata
from gateway.errors import InvalidRequest

MAX_STORED_ITEMS = 10_000
"""Most stored completions one run grades (the run keeps their ids)."""
STORED_IDS = "_stored_completion_ids"
"""Where a run's data source keeps the ids of the stored completions its create selected (the worker reads
them; the API does not show them)."""
STORED_ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "string"},
        "model": {"type": "string"},
        "created": {"type": "integer"},
        "metadata": {"type": "object"},
        "input": {"type": "array", "items": {"type": "object"}},
    },
    "required": ["id", "model", "created", "metadata", "input"],
}
"""The item of a stored completion (`gateway.evals.stored.item_of`): its id, the model asked for, when it
was made, its metadata, and the request's messages as `input`."""


def stored_config(config: dict[str, Any], sample_schema: dict[str, Any]) -> dict[str, Any]:
    """A `stored_completions` config as the eval shows it: its `metadata` (checked as OpenAI checks it, null
    for none) and the `schema` of its items and of the samples graders read (`sample_schema`)."""
    metadata = check_metadata(config.get("metadata"), "data_source_config.metadata")
    schema = {
        "type": "object",
        "properties": {"item": STORED_ITEM_SCHEMA, "sample": sample_schema},
        "required": ["item", "sample"],
    }
    return {"type": "stored_completions", "metadata": metadata or None, "schema": schema}


def check_nothing_sampled(ds: dict[str, Any]) -> None:
    """A run's data source over stored completions without a `model` (their answers graded as they are)
    has no `input_messages` or `sampling_params` either (else a 400 naming `data_source.model`)."""
    for name in ("input_messages", "sampling_params"):
        if ds.get(name) is not None:
            raise InvalidRequest(
                f"data_source.{name} is for sampling a model anew: name it in data_source.model (without a "
                "model, the stored answers themselves are graded).",
                param="data_source.model",
            )


def check_stored_source(source: dict[str, Any]) -> dict[str, Any]:
    """A `stored_completions` source with every filter (null where not given)."""
    param = "data_source.source"
    out: dict[str, Any] = {"type": "stored_completions"}
    out["metadata"] = check_metadata(source.get("metadata"), f"{param}.metadata") or None
    model = source.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise InvalidRequest("data_source.source.model must name a model.", param=f"{param}.model")
    out["model"] = model
    for name in ("created_after", "created_before"):
        value = source.get(name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
            raise InvalidRequest(
                f"data_source.source.{name} must be a Unix time in seconds.", param=f"{param}.{name}"
            )
        out[name] = value
    after, before = out["created_after"], out["created_before"]
    if after is not None and before is not None and before <= after:
        raise InvalidRequest(
            "data_source.source.created_before must be later than created_after.",
            param=f"{param}.created_before",
        )
    limit = source.get("limit")
    if limit is not None and (
        isinstance(limit, bool) or not isinstance(limit, int) or not 1 <= limit <= MAX_STORED_ITEMS
    ):
        raise InvalidRequest(
            f"data_source.source.limit must be an integer from 1 to {MAX_STORED_ITEMS}.",
            param=f"{param}.limit",
        )
    out["limit"] = limit
    return out

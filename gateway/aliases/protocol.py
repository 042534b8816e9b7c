"""Request and response shapes of the aliases API."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from gateway.protocol import OpenAIBaseModel


class AliasWrite(OpenAIBaseModel):
    """`POST /v1/aliases`: create alias `name`, or move it, to point at `model`."""

    name: str = Field(min_length=1, max_length=512)
    model: str = Field(min_length=1, max_length=512)


class Alias(OpenAIBaseModel):
    """An alias and what it serves now."""

    object: Literal["model.alias"] = "model.alias"
    name: str
    model: str
    """The model id it points at (a fine-tuned model, a checkpoint, a version id or a base model)."""
    version: str | None
    """What a request naming the alias is served by now (`X-Tunegate-Model-Version`); None when the model it
    points at is gone (requests then answer 404)."""
    created_at: int
    updated_at: int


class AliasList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[Alias]


class AliasDeleted(OpenAIBaseModel):
    name: str
    object: Literal["model.alias"] = "model.alias"
    deleted: bool = True

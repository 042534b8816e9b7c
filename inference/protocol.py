"""OpenAI-compatible request models of the engine, and their translation into sampling parameters.

Requests accept unknown fields (``extra="allow"``) the way the OpenAI API and vLLM do, so newer SDKs keep
working; the fields the engine acts on are validated here and turned into :class:`SamplingParams`.
"""

from __future__ import annotations

import logging
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from inference.errors import BadRequestError
from inference.sampling import SamplingParams

logger = logging.getLogger(__name__)

MAX_N = 16
MAX_TOP_LOGPROBS = 20


class OpenAIBaseModel(BaseModel):
    """Base of every request model: unknown fields are kept, not refused."""

    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIBaseModel):
    include_usage: bool = False


class _SamplingFields(OpenAIBaseModel):
    model: str
    n: int = Field(default=1, ge=1, le=MAX_N)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    """Keep generating past end-of-sequence tokens (as vLLM's extra parameter of the same name)."""
    stop_token_ids: list[int] | None = Field(default=None, max_length=16)
    """Tokens that end a choice and stay in its token ids, not in its text (vLLM's extra parameter)."""

    @field_validator("stop")
    @classmethod
    def _stop_list(cls, value: str | list[str] | None) -> str | list[str] | None:
        if isinstance(value, list) and len(value) > 16:
            raise ValueError("at most 16 stop sequences")
        return value

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    return_token_ids: bool = False
    """Answer with the prompt's token ids (``prompt_token_ids``) and each choice's (``token_ids``; in a
    stream, the first chunk's ``prompt_token_ids`` and each chunk's new ``token_ids``), as vLLM's extra
    parameter."""
    chat_template: str | None = Field(default=None, max_length=65_536)
    """A chat template for this request instead of the model's (rendered in a sandboxed Jinja), as vLLM's
    extra parameter."""
    chat_template_kwargs: dict[str, Any] | None = None
    """Extra variables for the chat template (such as ``enable_thinking``), as vLLM's extra parameter."""

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        if self.top_logprobs and not self.logprobs:
            raise BadRequestError("top_logprobs requires logprobs to be true.", param="top_logprobs")
        max_tokens = self.max_completion_tokens or self.max_tokens or default_max_tokens
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=self.stop_list(),
            logprobs=self.logprobs,
            top_logprobs=self.top_logprobs or 0,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or [],
        )

    def forced_tool(self) -> str | None:
        """The function a tool call must name, when ``tool_choice`` forces one; ``None`` otherwise."""
        choice = self.tool_choice
        if choice is None or choice in ("auto", "none"):
            return None
        if not self.tools:
            raise BadRequestError("tool_choice requires tools.", param="tool_choice")
        names = [t.get("function", {}).get("name") for t in self.tools if isinstance(t, dict)]
        if choice == "required":
            if not names or not isinstance(names[0], str):
                raise BadRequestError("tools[0] has no function name.", param="tools")
            return names[0]
        if isinstance(choice, dict):
            name = (choice.get("function") or {}).get("name")
            if not isinstance(name, str) or name not in names:
                raise BadRequestError(
                    f"tool_choice names an unknown function: {name!r}.", param="tool_choice"
                )
            return name
        raise BadRequestError(f"Invalid tool_choice: {choice!r}.", param="tool_choice")

    def tools_enabled(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"

    def wants_json(self) -> bool:
        fmt = (self.response_format or {}).get("type")
        return fmt in ("json_object", "json_schema")


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions`` (legacy text completions)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    return_tokens_as_token_ids: bool = False
    """vLLM's extra parameter: logprobs name each token `token_id:<id>` (not its text)."""
    return_token_ids: bool = False
    """vLLM's extra parameter: each choice carries its prompt's token ids (``prompt_token_ids``) and its
    sampled ids (``token_ids``); in a stream, a choice's first chunk carries ``prompt_token_ids`` and every
    chunk its new ``token_ids``."""

    def to_sampling_params(self, default_max_tokens: int) -> SamplingParams:
        return SamplingParams(
            max_tokens=self.max_tokens or 16,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            seed=self.seed,
            stop=self.stop_list(),
            logprobs=self.logprobs is not None,
            top_logprobs=self.logprobs or 0,
            ignore_eos=self.ignore_eos,
            stop_token_ids=self.stop_token_ids or [],
        )


class LoadLoraAdapterRequest(OpenAIBaseModel):
    """``POST /v1/load_lora_adapter`` (vLLM's runtime LoRA endpoint)."""

    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    load_inplace: bool = False
    base_model_name: str | None = None


class UnloadLoraAdapterRequest(OpenAIBaseModel):
    """``POST /v1/unload_lora_adapter``."""

    lora_name: str = Field(min_length=1)
    lora_int_id: int | None = None


FinishReason = Literal["stop", "length", "tool_calls"]

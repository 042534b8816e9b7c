"""An inference engine's error answers as the gateway's own errors: the one mapping, whichever engine runs.

The embedded engine and vLLM speak one HTTP contract but word some refusals differently; every engine answer
of status 400 and above passes through here, so that a client sees one envelope for one fault:

- a prompt over the model's context: 400 `context_length_exceeded`, `param` the request's own field
  (`messages` for chat, `prompt` for completions). vLLM names the count it checked instead (`input_tokens`,
  or `input_text` for its bound on characters) and its `code` is the HTTP status, an integer;
- a model the engine does not serve: 404 `model_not_found`, `param: "model"` (vLLM's message also lists the
  engine's own model names, which are left out);
- the load of an adapter (`adapter_load_error`):
  - a rank above the engine's `--max-lora-rank`: 400 `adapter_rank_too_large`, naming the rank and the limit
    (vLLM answers 500). The gateway refuses such an adapter itself, before any engine is asked, where it
    can read the adapter's `adapter_config.json` (`engines.AdapterLoader`);
  - files missing (vLLM answers 404, the embedded engine 400): 500 `adapter_files_missing`. A registered
    model whose files are gone is the server's state gone wrong, not the client's request, and no retry
    mends it; the path is logged, never answered;
  - any other refusal: 500 `adapter_load_failed`;
- anything else keeps the engine's status, message, `param` and (string) `code`, its `type` made OpenAI's.

vLLM ends its validation messages with `(parameter=..., value=...)`; that tail is dropped, since `param`
carries the field (and, mapped, may name another one).
"""

from __future__ import annotations

import logging
import re
from typing import Any

import orjson

from gateway.errors import APIError, InvalidRequest, UpstreamError

logger = logging.getLogger(__name__)

CONTEXT_PARAMS = frozenset({"input_tokens", "input_text"})
"""vLLM's `param` when a prompt does not fit the context: the tokens, or the characters, it counted."""
_VLLM_TAIL = re.compile(r"\s*\(parameter=[^()]*\)\s*$")
_RANK = re.compile(r"LoRA rank (\d+) is greater than max_lora_rank (\d+)")


class AdapterLoadFailed(APIError):
    """An engine refused to load a model's adapter for a reason no other error names."""

    status = 500
    type = "server_error"
    default_code = "adapter_load_failed"


class AdapterFilesMissing(APIError):
    """A registered model's adapter files are not where its row says (see the module)."""

    status = 500
    type = "server_error"
    default_code = "adapter_files_missing"

    def __init__(self, model: str) -> None:
        super().__init__(f"Model '{model}' cannot be served: its adapter files are missing on the server.")


class AdapterRankTooLarge(InvalidRequest):
    """A model's LoRA rank is above what the engines reserve memory for (`--max-lora-rank`)."""

    default_code = "adapter_rank_too_large"

    def __init__(self, model: str, rank: int, limit: int) -> None:
        super().__init__(
            f"Model '{model}' cannot be served: it is a LoRA adapter of rank {rank}, and the inference "
            f"engine serves ranks up to {limit}.",
            param="model",
        )


def _error_fields(raw: bytes) -> dict[str, Any] | None:
    """The `error` object of an engine's answer (vLLM's envelope, or its older flat `{"object": "error"}`)."""
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if not isinstance(data, dict):
        return None
    err = data.get("error")
    return err if isinstance(err, dict) else data


def prompt_param(path: str) -> str:
    """The field that holds the prompt of a request to `path`."""
    return "prompt" if path.endswith("/v1/completions") else "messages"


def engine_error(status: int, raw: bytes, *, model: str, path: str) -> UpstreamError:
    """An engine's error answer to a completion (`path`) for `model` (the id the client gave), as the
    gateway's own error (see the module)."""
    message = f"The inference engine answered with status {status}."
    type_: Any = None
    param: Any = None
    code: Any = None
    err = _error_fields(raw)
    if err is not None:
        message = _VLLM_TAIL.sub("", str(err.get("message") or message))
        type_, param, code = err.get("type"), err.get("param"), err.get("code")
    elif raw:
        message = raw.decode(errors="replace")[:500]
    if status == 400 and (
        param in CONTEXT_PARAMS or code == "context_length_exceeded" or "maximum context length" in message
    ):
        return UpstreamError(
            400,
            message,
            type_="invalid_request_error",
            param=prompt_param(path),
            code="context_length_exceeded",
        )
    if status == 404 and (param == "model" or code == "model_not_found" or "model" in message.lower()):
        return UpstreamError(
            404,
            f"The model `{model}` does not exist.",
            type_="invalid_request_error",
            param="model",
            code="model_not_found",
        )
    if status >= 500:
        type_ = "server_error"
    elif not type_ or type_ in ("BadRequestError", "NotFoundError"):
        type_ = "invalid_request_error"
    return UpstreamError(
        status,
        message,
        type_=str(type_),
        param=str(param) if param is not None else None,
        code=code if isinstance(code, str) else None,
    )


def adapter_load_error(status: int, raw: bytes, *, model: str, url: str, path: str) -> APIError:
    """An engine's refusal (at `url`) to load the adapter of `model` from `path`, as the gateway's own error
    (see the module); the engine's words are logged."""
    text = raw.decode(errors="replace")
    err = _error_fields(raw)
    message = str(err.get("message") or "") if err is not None else text
    rank = _RANK.search(message)
    if rank is not None:
        logger.warning("engine %s refused adapter %s: rank %s over %s", url, model, *rank.groups())
        return AdapterRankTooLarge(model, int(rank.group(1)), int(rank.group(2)))
    if (status == 404 and "No adapter found" in message) or "No adapter_config.json found" in message:
        logger.error("model %s cannot be served: no adapter in %s (engine %s)", model, path, url)
        return AdapterFilesMissing(model)
    logger.warning("engine %s refused adapter %s: %s", url, model, text[:300])
    return AdapterLoadFailed(f"The inference engine could not load model '{model}'.")

"""Model calls a request causes besides its own completion: a `score_model` or `label_model` grader in
`graders/run`, a model playing an episode in `environments/run`.

They take the path every model call takes: the gateway's own `POST /v1/chat/completions`, with the key the
request came with. So the code that serves a client's chat decides for them too (`gateway.serving.service`):
the model must be a base model or one of the caller's organisation (an unknown model and another
organisation's both answer 404 `model_not_found`); the key's and the organisation's rate limits and the
monthly budget apply; each call is a usage row of the organisation, under that key. Work that outlives a
request (an eval run, a training job) does the same with a key minted for it (`gateway.tenancy.scoped`).

- `check_models` runs the chat route's model lookup before any work, so a request naming a model it may not
  use gets the chat route's 404, with `param` naming the field (`grader.model`,
  `grader.graders.judge.model`, `model`).
- `GatewayModels` makes the synchronous clients a worker thread calls with (`inference()` for model
  graders, `policy()` for an episode), pointed at `Settings.internal_gateway_url()`, without retries. The
  first refusal of access the gateway answers one of them (`RELAYED_STATUSES`: 429 `rate_limit_exceeded` or
  `insufficient_quota`, a 404 for a model deleted meanwhile, a key revoked meanwhile) is kept, and
  `raise_refusal()` answers it as the request's own error, with the same status and envelope. Any other
  failure of a call (a prompt too long for the model, an engine down) stays what it was: a grading error
  in the grader's result, an error of the episode.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from envsdk.inference_client import ChatReply, InferenceClient, InferenceError
from gateway.deps import Resources
from gateway.errors import UpstreamError
from gateway.serving import service
from gateway.settings import Settings
from gateway.tenancy.keys import Principal

if TYPE_CHECKING:
    from envsdk.rollout import Policy

CALL_TIMEOUT_S = 300.0
"""Longest wait for one model call made for a request."""
RELAYED_STATUSES = frozenset({401, 403, 404, 429})
"""Answers of the gateway to a model call that refuse the caller the call itself: the request answers them."""


async def check_models(res: Resources, who: Principal, fields: Iterable[tuple[str, str]]) -> None:
    """Each `(model, param)` resolved for the caller as the chat route resolves it; else that route's 404
    `model_not_found` (the same for an unknown model and another organisation's), `param` naming the field."""
    for model, param in fields:
        await service.resolve(res, who, model, param=param)


def relayed(status: int, error: dict[str, Any] | None, retry_after: str | None) -> UpstreamError:
    """The gateway's refusal of a model call, as an error of the request that caused it: the same status,
    message, type, param and code, and its `retry-after`."""
    error = error or {}
    param, code = error.get("param"), error.get("code")
    refusal = UpstreamError(
        status,
        str(error.get("message") or f"A model call of this request was refused (HTTP {status})."),
        type_=str(error.get("type") or "invalid_request_error"),
        param=param if isinstance(param, str) else None,
        code=code if isinstance(code, str) else None,
    )
    if retry_after:
        refusal.headers = {"retry-after": retry_after}
    return refusal


class GatewayModels:
    """The model calls of one request, through the gateway with the caller's key; a context manager that
    closes the clients it made."""

    def __init__(self, settings: Settings, key: str) -> None:
        self.base_url = f"{settings.internal_gateway_url()}/v1"
        self._key = key
        self._lock = threading.Lock()
        self._refusal: UpstreamError | None = None
        self._clients: list[Any] = []

    def __enter__(self) -> GatewayModels:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        for client in self._clients:
            client.close()
        self._clients.clear()

    def keep(self, refusal: UpstreamError) -> None:
        """Remember a refusal (the first one wins)."""
        with self._lock:
            if self._refusal is None:
                self._refusal = refusal

    def raise_refusal(self) -> None:
        """Raise the first refusal (`RELAYED_STATUSES`) the gateway answered a call of this request."""
        if self._refusal is not None:
            raise self._refusal

    def inference(self) -> InferenceClient:
        """An `InferenceClient` for model graders."""
        client = _Inference(self, self.base_url, self._key, timeout=CALL_TIMEOUT_S, max_retries=0)
        self._clients.append(client)
        return client

    def policy(self, model: str, **create_kwargs: Any) -> Policy:
        """`envsdk.rollout.openai_policy` for `model` (an episode's turns), keeping the gateway's refusals."""
        import openai

        from envsdk.rollout import openai_policy

        client = openai.OpenAI(
            base_url=self.base_url, api_key=self._key, max_retries=0, timeout=CALL_TIMEOUT_S
        )
        self._clients.append(client)
        inner = openai_policy(client, model, **create_kwargs)

        def generate(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> dict[str, Any]:
            try:
                return inner(messages, tools)
            except openai.APIStatusError as exc:
                if exc.status_code in RELAYED_STATUSES:
                    try:
                        body = exc.response.json()
                    except ValueError:
                        body = None
                    error = body.get("error") if isinstance(body, dict) else None
                    error = error if isinstance(error, dict) else None
                    self.keep(relayed(exc.status_code, error, exc.response.headers.get("retry-after")))
                raise

        return generate


class _Inference(InferenceClient):
    """An `InferenceClient` that hands the gateway's refusals to its `GatewayModels`."""

    def __init__(self, owner: GatewayModels, base_url: str, api_key: str, **kwargs: Any) -> None:
        super().__init__(base_url, api_key, **kwargs)
        self._owner = owner

    def chat(self, model: str, messages: list[dict[str, Any]], **sampling: Any) -> ChatReply:
        try:
            return super().chat(model, messages, **sampling)
        except InferenceError as exc:
            if exc.status in RELAYED_STATUSES:
                self._owner.keep(relayed(exc.status, exc.error, exc.retry_after))
            raise

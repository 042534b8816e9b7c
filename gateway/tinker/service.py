"""The Tinker API's logic: what the SDK asks first (its client config, the server's capabilities) and
sessions; the rest by the SDK's own clients:

- `gateway.tinker.training`: training models and their requests (`TrainingClient`);
- `gateway.tinker.sampling`: sampling sessions and samples (`SamplingClient`);
- `gateway.tinker.futures`: `retrieve_future` and `cancel_future` of any request;
- `gateway.tinker.rest`: training runs, checkpoints and `weights_info` (`RestClient`);
- `gateway.tinker.owned`: the ids a request names, resolved to the caller's own rows (404 for another's).
"""

from __future__ import annotations

from typing import Any

from gateway.deps import Resources
from gateway.errors import not_found
from gateway.ids import new_id
from gateway.tenancy.keys import Principal
from gateway.tinker import protocol as p
from gateway.tinker import store, training
from gateway.tinker.paths import valid_session_id


# ---------------------------------------------------------------------------------------------- config
def client_config(res: Resources) -> dict[str, Any]:
    """Feature flags for the SDK: API keys (no token exchange), plain httpx, no zstd; how long it waits on a
    spent budget (402) before raising; and how it splits a `forward_backward` batch into requests that each
    fit this server's bounds (`training.chunk_limits`), sent one after another. The training process adds
    up the gradients of consecutive requests until `optim_step`, and the SDK sums their `loss:sum` and
    joins their outputs in order, so a batch trains the same in one request or in several."""
    chunk_data, chunk_bytes = training.chunk_limits(res.settings)
    return {
        "billing_exception_max_pause_duration_sec": res.settings.tinker_budget_pause_s,
        "pjwt_auth_enabled": False,
        "credential_default_source": "api_key",
        "use_pyqwest_transport": False,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "fwdbwd_max_chunk_len": chunk_data,
        "fwdbwd_max_chunk_bytes_count": chunk_bytes,
    }


def capabilities(res: Resources) -> dict[str, Any]:
    """The base models. `tokenizer_id` (`get_info`'s, which the SDK's type of this answer drops) is for
    clients that load a tokenizer by model name before they make a model, as tinker-cookbook does."""
    tokenizer = res.settings.tokenizer_of
    models = [
        {"model_name": name, "trainable": True, "sampleable": True, "tokenizer_id": tokenizer(name)}
        for name in res.settings.base_models
    ]
    return {"supported_models": models}


# ---------------------------------------------------------------------------------------------- sessions
async def create_session(res: Resources, who: Principal, body: p.CreateSessionRequest) -> dict[str, Any]:
    session_id = new_id("ts-")
    await store.create_session(
        res.pool, session_id=session_id, org_id=who.organization_id, key_id=who.api_key_id,
        tags=body.tags, metadata=body.user_metadata, sdk=body.sdk_version,
    )  # fmt: skip
    return {"type": "create_session", "session_id": session_id}


async def heartbeat(res: Resources, who: Principal, session_id: str) -> dict[str, Any]:
    if not valid_session_id(session_id) or not await store.beat_session(
        res.pool, session_id=session_id, org_id=who.organization_id
    ):
        raise not_found("session", session_id)
    return {"type": "session_heartbeat"}


async def finish_session(
    res: Resources, who: Principal, session_id: str, body: p.FinishSessionRequest
) -> dict[str, Any]:
    """Record the end the client reports (the first report wins). Its models are saved and let their
    slots go once their open requests are answered, as idle ones are (`gateway.tinker.holder`)."""
    org_id, reason = who.organization_id, body.reason.type
    if not valid_session_id(session_id) or not await store.finish_session(
        res.pool, session_id=session_id, org_id=org_id, reason=reason, detail=body.detail
    ):
        raise not_found("session", session_id)
    return {"type": "finish_session"}

"""Futures: `retrieve_future` and `cancel_future` of any Tinker request (training or sampling).

`retrieve_future` answers by waiting a while for the request's row to finish (a long poll: the SDK asks again
at once after a `try_again`), woken by the answer's notice. A request of a model whose holder stopped
beating fails, so the SDK raises instead of waiting.
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.deps import Resources
from gateway.errors import not_found
from gateway.tenancy.keys import Principal
from gateway.tinker import store
from gateway.tinker.paths import valid_request_id
from gateway.tinker.rows import FutureRow
from gateway.tinker.sampling import SAMPLE_TIMEOUT_S

LONG_POLL_S = 10.0
"""Longest a `retrieve_future` waits for its request before answering `try_again`."""
RECHECK_S = 1.0
"""Longest a waiting `retrieve_future` goes without reading its request (between wake-ups)."""


async def _request(res: Resources, who: Principal, request_id: str) -> FutureRow | None:
    if not valid_request_id(request_id):
        return None
    return await store.get_request(res.pool, request_id=request_id, org_id=who.organization_id)


async def retrieve(res: Resources, who: Principal, request_id: str) -> tuple[bytes, str]:
    """`(body, media type)` of a finished request; a long poll, then `try_again`."""
    deadline = time.monotonic() + LONG_POLL_S
    while True:
        with res.notices.watching(store.ANSWER_CHANNEL, request_id) as answered:  # before the read
            row = await _request(res, who, request_id)
            left = deadline - time.monotonic()
            if row is not None and row.status not in ("done", "failed") and left > 0:
                # woken when it is answered; read again at least every RECHECK_S (a lost holder or notice)
                await res.notices.wait(answered, min(left, RECHECK_S))
                row = await _request(res, who, request_id)
        if row is None:
            raise not_found("future", request_id, param="request_id")
        if row.status == "done":
            assert row.result is not None  # a request is done with its answer
            media = "application/x-protobuf" if row.result_type == "proto" else "application/json"
            return bytes(row.result), media
        if row.status == "failed":
            return orjson.dumps(
                {"error": row.error, "category": row.category or "unknown"}
            ), "application/json"
        if row.model_id is not None and await _holder_lost(res, row.model_id):
            continue  # its requests were failed just now
        if row.kind == "sample" and row.age_s > SAMPLE_TIMEOUT_S + 30:  # its gateway went away
            await store.finish(
                res.pool, request_id=request_id, error="Sampling was interrupted.", category="server"
            )
            continue
        if time.monotonic() >= deadline:
            body = {"type": "try_again", "request_id": request_id, "queue_state": "active"}
            return orjson.dumps(body), "application/json"


async def cancel(res: Resources, who: Principal, request_id: str) -> dict[str, Any]:
    """`cancel_future`: accepted for a request of the caller's organisation, which runs on to its end (the
    SDK sends it only when the dynamic config enables it, which this server does not); 404 for any other."""
    if await _request(res, who, request_id) is None:
        raise not_found("future", request_id, param="request_id")
    return {}


async def _holder_lost(res: Resources, model_id: str) -> bool:
    """True (and the model's open requests failed) when the worker holding the model stopped beating."""
    held = await store.holder(res.pool, model_id=model_id, stale_s=res.settings.stale_after_s)
    if held is None or held.worker_id is None or held.alive:
        return False
    await store.lose(res.pool, model_id=model_id, reason=store.lost_reason(model_id))
    return True

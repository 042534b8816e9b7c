"""Sampling (the SDK's `SamplingClient`): sampling sessions on a base model or a sampler checkpoint, and
`asample`.

Sampling goes through the gateway's own `POST /v1/completions` with the caller's key: the engines, the
adapter loading, rate limits, budgets and metering of chat apply to it unchanged. A sample request is a row
of `tinker_requests` with no model, finished by a task of this process; `retrieve_future` reads it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import httpx

from gateway.deps import Resources
from gateway.errors import InvalidRequest, not_found
from gateway.ids import new_id
from gateway.tenancy.keys import Principal
from gateway.tinker import owned, store, wire
from gateway.tinker import protocol as p
from gateway.tinker.paths import sampler_id_of, valid_sampler_id
from gateway.tinker.rows import SamplerRow

logger = logging.getLogger(__name__)

SAMPLE_TIMEOUT_S = 300.0
"""Longest a sampling request waits for the engines; one older than this (and a margin) was lost with its
gateway, and `retrieve_future` fails it."""


async def _sampler_checkpoint(res: Resources, who: Principal, path: str) -> tuple[str, str]:
    """`(base model, served model)` of a sampler checkpoint (a request's `model_path`): the OpenAI model the
    engines answer for."""
    ckpt = await owned.checkpoint(res, who, path, "sampler", param="model_path")
    assert ckpt.served_model is not None  # every sampler checkpoint is registered as a served model
    return ckpt.base_model, ckpt.served_model


async def create_sampler(res: Resources, who: Principal, body: p.CreateSamplingSessionRequest) -> dict:
    if body.model_path:
        base, served = await _sampler_checkpoint(res, who, body.model_path)
    elif body.base_model:
        owned.known_base(res, body.base_model)
        base = served = body.base_model
    else:
        raise InvalidRequest("Give model_path or base_model.", param="model_path")
    owned.seq_id(body.sampling_session_seq_id, "sampling_session_seq_id")
    await owned.own_session(res, who, body.session_id)
    sampler_id = sampler_id_of(body.session_id, body.sampling_session_seq_id)
    if not await store.create_sampler(
        res.pool, sampler_id=sampler_id, org_id=who.organization_id, session_id=body.session_id,
        base_model=base, model_path=body.model_path, served_model=served,
    ):  # fmt: skip
        raise owned.taken("sampling session", sampler_id, "sampling_session_seq_id")
    return {"type": "create_sampling_session", "sampling_session_id": sampler_id}


async def _sampler(res: Resources, who: Principal, sampler_id: str, *, param: str | None) -> SamplerRow:
    row = None
    if valid_sampler_id(sampler_id):
        row = await store.get_sampler(res.pool, sampler_id=sampler_id, org_id=who.organization_id)
    if row is None:
        raise not_found("sampler", sampler_id, param=param)
    return row


async def get_sampler(res: Resources, who: Principal, sampler_id: str) -> dict[str, Any]:
    row = await _sampler(res, who, sampler_id, param=None)
    return {"sampler_id": sampler_id, "base_model": row.base_model, "model_path": row.model_path}


async def sample(res: Resources, who: Principal, key: str, body: p.SampleRequest) -> dict[str, Any]:
    if body.sampling_session_id:
        sampler = await _sampler(res, who, body.sampling_session_id, param="sampling_session_id")
        served = sampler.served_model
    elif body.model_path:
        _, served = await _sampler_checkpoint(res, who, body.model_path)
    elif body.base_model:
        owned.known_base(res, body.base_model)
        served = body.base_model
    else:
        raise InvalidRequest("Give sampling_session_id, model_path or base_model.")
    request_id = new_id("tr-")
    await store.add_request(
        res.pool, request_id=request_id, org_id=who.organization_id, model_id=None, kind="sample", payload={}
    )
    task = asyncio.get_running_loop().create_task(_sample(res, key, served, body, request_id))
    _running.add(task)
    task.add_done_callback(_running.discard)
    ids = [f"{request_id}:{i}" for i in range(body.num_samples)]
    return {"request_id": request_id, "sample_sequence_ids": ids}


_running: set[asyncio.Task[None]] = set()


async def _sample(res: Resources, key: str, served: str, body: p.SampleRequest, request_id: str) -> None:
    sp = body.sampling_params
    request: dict[str, Any] = {
        "model": served,
        "prompt": body.prompt.tokens(),
        "n": body.num_samples,
        "max_tokens": sp.max_tokens or 16,
        "temperature": sp.temperature,
        "top_p": sp.top_p,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
    }
    if sp.seed is not None:
        request["seed"] = sp.seed
    if isinstance(sp.stop, list) and sp.stop and isinstance(sp.stop[0], int):
        request["stop_token_ids"] = sp.stop  # vLLM's parameter: the stop token stays in the tokens
    elif sp.stop:
        request["stop"] = sp.stop
    url = f"{res.settings.internal_gateway_url()}/v1/completions"
    try:
        async with httpx.AsyncClient(timeout=SAMPLE_TIMEOUT_S) as client:
            resp = await client.post(url, json=request, headers={"Authorization": f"Bearer {key}"})
        if resp.status_code != 200:
            error = resp.json().get("error", {}).get("message") or resp.text[:300]
            category = "user" if 400 <= resp.status_code < 500 else "server"
            await store.finish(res.pool, request_id=request_id, error=error, category=category)
            return
        sequences = [_sequence(choice) for choice in sorted(resp.json()["choices"], key=lambda c: c["index"])]
        await store.finish(
            res.pool, request_id=request_id, result=wire.encode_samples(sequences), result_type="proto"
        )
    except Exception as exc:  # noqa: BLE001 — the future's answer; nothing else waits on this task
        logger.exception("sampling request %s failed", request_id)
        await store.finish(
            res.pool, request_id=request_id, error=f"Sampling failed: {exc}", category="server"
        )


def _sequence(choice: dict[str, Any]) -> dict[str, Any]:
    lp = choice.get("logprobs") or {}
    tokens = [int(t.removeprefix("token_id:")) for t in lp.get("tokens") or []]
    return {
        "tokens": tokens,
        "logprobs": [float(x) if x is not None else 0.0 for x in lp.get("token_logprobs") or []],
        "stop_reason": "length" if choice.get("finish_reason") == "length" else "stop",
    }

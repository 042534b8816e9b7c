"""The Tinker API's logic: sessions, training models and their requests, sampling, futures and listings.

Training requests are rows of `tinker_requests`, answered in order by the worker holding the model
(`gateway.tinker.holder`); this side inserts them, wakes a worker when none holds the model, and answers
`retrieve_future` by waiting a while for the row to finish (a long poll: the SDK asks again at once after a
`try_again`). A request of a model whose holder stopped beating fails, so the SDK raises instead of waiting.
Sampling goes through the gateway's own `POST /v1/completions` with the caller's key: the engines, the
adapter loading, rate limits, budgets and metering of chat apply to it unchanged.

Another organisation's model, session, future, sampler or checkpoint answers 404, exactly like an unknown one.
The ids a client names follow one policy (`gateway.tinker.paths`): a session it names must be one of its
organisation's own (else 404, as an unknown one), its models and samplers live in that session, and an id it
already uses there is refused (400 `duplicate_id`); an id of another shape is unknown (404), a `tinker://`
path of another shape or a sequence number out of range is a bad request (400).
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import orjson

from gateway.deps import Resources
from gateway.errors import BudgetSpent, InsufficientQuota, InvalidRequest, not_found
from gateway.ids import new_id
from gateway.queue import enqueue
from gateway.tenancy.keys import Principal
from gateway.tinker import protocol as p
from gateway.tinker import store, wire, wire_decode
from gateway.tinker.paths import (
    MAX_SEQ_ID,
    RUN_TINKER_MODEL,
    SEGMENT,
    model_id_of,
    parse_tinker_path,
    sampler_id_of,
    tinker_path,
    valid_model_id,
    valid_name,
    valid_request_id,
    valid_sampler_id,
    valid_seq_id,
    valid_session_id,
)
from gateway.tinker.rows import (
    CheckpointRow,
    FutureRow,
    ModelCheckpointRow,
    SamplerRow,
    TrainingModelRow,
)
from trainer.spec import tinker_loss_error

logger = logging.getLogger(__name__)

LONG_POLL_S = 10.0
"""Longest a `retrieve_future` waits for its request before answering `try_again`."""
RECHECK_S = 1.0
"""Longest a waiting `retrieve_future` goes without reading its request (between wake-ups)."""
SAMPLE_TIMEOUT_S = 300.0


# ---------------------------------------------------------------------------------------------- config
def client_config(res: Resources) -> dict[str, Any]:
    """Feature flags for the SDK: API keys (no token exchange), plain httpx, one forward_backward request
    per call (its chunks in order), no zstd; how long it waits on a spent budget (402) before raising."""
    return {
        "billing_exception_max_pause_duration_sec": res.settings.tinker_budget_pause_s,
        "pjwt_auth_enabled": False,
        "credential_default_source": "api_key",
        "use_pyqwest_transport": False,
        "parallel_fwdbwd_chunks": False,
        "proto_compress_fwdbwd": False,
        "fwdbwd_max_chunk_len": 100_000,
        "fwdbwd_max_chunk_bytes_count": 1_000_000_000,
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


# ---------------------------------------------------------------------------------------------- ids
async def _own_session(res: Resources, who: Principal, session_id: str, *, param: str = "session_id") -> None:
    """404 unless `session_id` is a session of the caller's organisation (another's answers as an unknown)."""
    if not valid_session_id(session_id) or not await store.own_session(
        res.pool, session_id=session_id, org_id=who.organization_id
    ):
        raise not_found("session", session_id, param=param)


def _seq_id(seq_id: int, param: str) -> int:
    if not valid_seq_id(seq_id):
        message = f"'{param}' must be between 0 and {MAX_SEQ_ID}."
        raise InvalidRequest(message, param=param, code="invalid_value")
    return seq_id


def _taken(what: str, ident: str, param: str) -> InvalidRequest:
    """The answer for an id the caller's organisation already uses in its session (the SDK counts ids up from
    0 per session, so only a client that repeats itself meets it; 400, which the SDK does not retry)."""
    return InvalidRequest(
        f"The {what} id '{ident}' is already in use in this session; give another '{param}'.",
        param=param,
        code="duplicate_id",
    )


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


# ---------------------------------------------------------------------------------------------- models
def _base(res: Resources, name: str) -> None:
    if name not in res.settings.base_models:
        known = ", ".join(sorted(res.settings.base_models))
        raise InvalidRequest(f"Unknown base model '{name}'; this server trains: {known}.", param="base_model")


async def _model(res: Resources, who: Principal, model_id: str) -> TrainingModelRow:
    row = None
    if valid_model_id(model_id):
        row = await store.get_model(res.pool, model_id=model_id, org_id=who.organization_id)
    if row is None:
        raise not_found("model", model_id, param="model_id")
    return row


async def _done_future(
    res: Resources, who: Principal, kind: str, result: dict[str, Any], model_id: str
) -> dict:
    request_id = new_id("tr-")
    await store.add_request(
        res.pool, request_id=request_id, org_id=who.organization_id, model_id=None, kind=kind, payload={}
    )
    await store.finish(res.pool, request_id=request_id, result=orjson.dumps(result))
    return {"request_id": request_id, "model_id": model_id}


async def create_model(res: Resources, who: Principal, body: p.CreateModelRequest) -> dict[str, Any]:
    _base(res, body.base_model)
    lora = body.lora_config or p.LoraConfig()
    if not (lora.train_attn or lora.train_mlp):
        raise InvalidRequest("Enable train_attn or train_mlp: this server trains no other layers.")
    config = {
        "rank": lora.rank,
        "seed": lora.seed,
        "train_attn": lora.train_attn,
        "train_mlp": lora.train_mlp,
    }
    model_id = await _new_model(
        res, who, body.session_id, body.model_seq_id, base_model=body.base_model, rank=lora.rank,
        lora_config=config, metadata=body.user_metadata,
    )  # fmt: skip
    return await _done_future(
        res, who, "create_model", {"model_id": model_id, "type": "create_model"}, model_id
    )


async def _new_model(
    res: Resources,
    who: Principal,
    session_id: str,
    model_seq_id: int,
    *,
    base_model: str,
    rank: int,
    lora_config: dict[str, Any],
    metadata: object,
) -> str:
    """Record the training model `model_seq_id` of the caller's session `session_id`; its id."""
    _seq_id(model_seq_id, "model_seq_id")
    await _own_session(res, who, session_id)
    model_id = model_id_of(session_id, model_seq_id)
    row = await store.create_model(
        res.pool, model_id=model_id, org_id=who.organization_id, key_id=who.api_key_id,
        session_id=session_id, base_model=base_model, rank=rank, lora_config=lora_config, metadata=metadata,
    )  # fmt: skip
    if row is None:
        raise _taken("model", model_id, "model_seq_id")
    return model_id


async def get_info(res: Resources, who: Principal, model_id: str) -> dict[str, Any]:
    row = await _model(res, who, model_id)
    base = row.base_model
    return {
        "type": "get_info",
        "model_id": model_id,
        "model_data": p.model_data(base, res.settings.tokenizer_of(base)),
        "is_lora": True,
        "lora_rank": row.lora_rank,
        "model_name": base,
    }


async def submit(
    res: Resources, who: Principal, model_id: str, kind: str, payload: dict[str, Any], *, tokens: int = 0
) -> dict:
    """Queue one request of a training model (in arrival order) and make sure a worker holds the model.

    A request that computes on `tokens` tokens is first held to the key's and the organisation's token rate
    limits and to the monthly budget, priced as the prompt tokens of a completion of the base model (as the
    worker meters it), nothing queued when over: 429 `rate_limit_exceeded` (the SDK backs off and retries),
    or, for a spent budget, 402 `insufficient_quota`: the SDK's billing status, on which it holds the loop
    for `tinker_budget_pause_s`, retrying, before it raises `BillingError`."""
    row = await _model(res, who, model_id)
    if row.lost:
        raise InvalidRequest(row.lost + " Load your last saved state into a new training client.")
    if tokens:
        try:
            admission = await res.guard.admit(who.organization_id, who.api_key_id, row.base_model, tokens, 0)
        except InsufficientQuota as exc:
            raise BudgetSpent(exc.message) from None
        res.guard.settle(admission, tokens, 0)  # the count is exact: the tokens are in the request
    request_id = new_id("tr-")
    await store.add_request(
        res.pool,
        request_id=request_id,
        org_id=who.organization_id,
        model_id=model_id,
        kind=kind,
        payload=payload,
    )
    held = await store.holder(res.pool, model_id=model_id, stale_s=res.settings.stale_after_s)
    if held is None or held.worker_id is None or not held.alive:
        await enqueue(res.queue, res.settings.queue_name, model_id, time.time_ns(), function=RUN_TINKER_MODEL)
    return {"request_id": request_id, "model_id": model_id}


async def forward_backward(res: Resources, who: Principal, body: bytes) -> dict[str, Any]:
    """Decode and check the whole request (`gateway.tinker.wire_decode`: sizes and shapes before anything is
    expanded, then the loss's inputs and the base model's vocabulary), so that the training process gets
    nothing it would fail on; each refusal is a 400 naming the field."""
    settings = res.settings
    limit = settings.tinker_max_numbers or settings.max_request_body_bytes // 2
    try:
        req = wire_decode.decode_forward_backward(body, max_numbers=limit)
    except wire.WireError as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None
    loss_error = tinker_loss_error(req.loss_fn)
    if loss_error is not None:
        raise InvalidRequest(loss_error, param="loss_fn", code="unknown_loss_fn")
    base = (await _model(res, who, req.model_id)).base_model
    known = base in settings.base_models  # else the training process checks against its embedding
    try:
        req.check_inputs(wire_decode.vocabulary_size(settings.base_model_path(base)) if known else None)
    except wire.WireError as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None
    kind = "forward" if req.forward_only else "forward_backward"
    return await submit(res, who, req.model_id, kind, req.payload(), tokens=req.tokens)


async def optim_step(res: Resources, who: Principal, body: p.OptimStepRequest) -> dict[str, Any]:
    params = body.adam_params or p.AdamParams()
    return await submit(res, who, body.model_id, "optim_step", params.model_dump())


def _name(given: str | None, prefix: str) -> str:
    name = given or f"{prefix}-{new_id('', 8)}"
    if not valid_name(name):
        raise InvalidRequest(
            f"Invalid checkpoint name {name!r}: use letters, digits, '.', '_' and '-'.", param="path"
        )
    return name


async def save_weights(res: Resources, who: Principal, body: p.SaveWeightsRequest) -> dict[str, Any]:
    payload = {"name": _name(body.path, "state"), "ttl_seconds": body.ttl_seconds}
    return await submit(res, who, body.model_id, "save_weights", payload)


async def save_for_sampler(res: Resources, who: Principal, body: p.SaveWeightsRequest) -> dict[str, Any]:
    """A sampler checkpoint; one saved for a sampling client at once (no name: the SDK's
    `save_weights_and_get_sampling_client`, whose checkpoints are ephemeral) expires after
    `tinker_ephemeral_ttl_s`, as Tinker's do."""
    payload: dict[str, Any] = {"name": _name(body.path, "sampler"), "ttl_seconds": body.ttl_seconds}
    if body.path is None and body.sampling_session_seq_id is not None:
        row = await _model(res, who, body.model_id)
        sampler_id = sampler_id_of(
            row.session_id, _seq_id(body.sampling_session_seq_id, "sampling_session_seq_id")
        )
        if await store.get_sampler(res.pool, sampler_id=sampler_id, org_id=who.organization_id):
            raise _taken("sampling session", sampler_id, "sampling_session_seq_id")
        payload["session_id"] = row.session_id
        payload["sampler_id"] = sampler_id
        payload["ttl_seconds"] = res.settings.tinker_ephemeral_ttl_s
    return await submit(res, who, body.model_id, "save_weights_for_sampler", payload)


async def _checkpoint(
    res: Resources, who: Principal, path: str, kind: str | None = None, *, param: str = "path"
) -> ModelCheckpointRow:
    """The caller's checkpoint at the `tinker://` path `path` (the request's field `param`): 400 for a path
    of another shape, 404 for one of no checkpoint of the caller's organisation."""
    parsed = parse_tinker_path(path)
    if parsed is None or (kind is not None and parsed[1] != kind):
        raise InvalidRequest(f"Invalid tinker path {path!r}.", param=param)
    row = await store.get_checkpoint(
        res.pool, org_id=who.organization_id, model_id=parsed[0], kind=parsed[1], name=parsed[2]
    )
    if row is None:
        raise not_found("checkpoint", path, param=param)
    return row


async def load_weights(res: Resources, who: Principal, body: p.LoadWeightsRequest) -> dict[str, Any]:
    ckpt = await _checkpoint(res, who, body.path, "training")
    if body.optimizer and not ckpt.with_optimizer:
        raise InvalidRequest("This checkpoint holds no optimizer state.", param="optimizer")
    model_id = body.model_id
    if model_id is None:  # a new model made by loading the checkpoint (create_training_client_from_state)
        if body.session_id is None or body.model_seq_id is None:
            raise InvalidRequest("load_weights needs model_id, or session_id and model_seq_id.")
        model_id = await _new_model(
            res, who, body.session_id, body.model_seq_id, base_model=ckpt.base_model, rank=ckpt.lora_rank,
            lora_config=ckpt.lora_config, metadata=body.user_metadata,
        )  # fmt: skip
    payload = {"dir": ckpt.path, "optimizer": body.optimizer, "path": body.path}
    return await submit(res, who, model_id, "load_weights", payload)


# ---------------------------------------------------------------------------------------------- sampling
async def _sampler_checkpoint(res: Resources, who: Principal, path: str) -> tuple[str, str]:
    """`(base model, served model)` of a sampler checkpoint (a request's `model_path`): the OpenAI model the
    engines answer for."""
    ckpt = await _checkpoint(res, who, path, "sampler", param="model_path")
    assert ckpt.served_model is not None  # every sampler checkpoint is registered as a served model
    return ckpt.base_model, ckpt.served_model


async def create_sampler(res: Resources, who: Principal, body: p.CreateSamplingSessionRequest) -> dict:
    if body.model_path:
        base, served = await _sampler_checkpoint(res, who, body.model_path)
    elif body.base_model:
        _base(res, body.base_model)
        base = served = body.base_model
    else:
        raise InvalidRequest("Give model_path or base_model.", param="model_path")
    _seq_id(body.sampling_session_seq_id, "sampling_session_seq_id")
    await _own_session(res, who, body.session_id)
    sampler_id = sampler_id_of(body.session_id, body.sampling_session_seq_id)
    if not await store.create_sampler(
        res.pool, sampler_id=sampler_id, org_id=who.organization_id, session_id=body.session_id,
        base_model=base, model_path=body.model_path, served_model=served,
    ):  # fmt: skip
        raise _taken("sampling session", sampler_id, "sampling_session_seq_id")
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
        _base(res, body.base_model)
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


# ---------------------------------------------------------------------------------------------- futures
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
    reason = (
        f"The worker holding model {model_id} stopped responding; its unsaved weights are lost. "
        "Load your last saved state into a new training client."
    )
    await store.lose(res.pool, model_id=model_id, reason=reason)
    return True


# ---------------------------------------------------------------------------------------------- listings
def _checkpoint_json(row: CheckpointRow) -> dict[str, Any]:
    return {
        "checkpoint_id": f"{SEGMENT[row.kind]}/{row.name}",
        "checkpoint_type": row.kind,
        "time": row.created_at.isoformat(),
        "tinker_path": tinker_path(row.model_id, row.kind, row.name),
        "size_bytes": row.size_bytes,
        "public": False,
        "expires_at": row.expires_at.isoformat() if row.expires_at else None,
    }


async def list_checkpoints(res: Resources, who: Principal, model_id: str | None) -> dict[str, Any]:
    if model_id is not None:
        await _model(res, who, model_id)
    rows = await store.list_checkpoints(res.pool, org_id=who.organization_id, model_id=model_id)
    return {"checkpoints": [_checkpoint_json(r) for r in rows], "cursor": None}


async def _run_json(res: Resources, who: Principal, row: TrainingModelRow) -> dict[str, Any]:
    ckpts = await store.list_checkpoints(res.pool, org_id=who.organization_id, model_id=row.id)
    last = {kind: next((c for c in ckpts if c.kind == kind), None) for kind in ("training", "sampler")}
    return {
        "training_run_id": row.id,
        "base_model": row.base_model,
        "model_owner": row.organization_id,
        "is_lora": True,
        "corrupted": row.lost is not None,
        "lora_rank": row.lora_rank,
        "last_request_time": row.last_request_at.isoformat(),
        "last_checkpoint": _checkpoint_json(last["training"]) if last["training"] else None,
        "last_sampler_checkpoint": _checkpoint_json(last["sampler"]) if last["sampler"] else None,
        "user_metadata": row.user_metadata,
    }


async def training_run(res: Resources, who: Principal, model_id: str) -> dict[str, Any]:
    return await _run_json(res, who, await _model(res, who, model_id))


async def training_runs(res: Resources, who: Principal, limit: int, offset: int) -> dict[str, Any]:
    rows, total = await store.list_models(res.pool, org_id=who.organization_id, limit=limit, offset=offset)
    runs = [await _run_json(res, who, r) for r in rows]
    return {"training_runs": runs, "cursor": {"offset": offset, "limit": limit, "total_count": total}}


async def weights_info(res: Resources, who: Principal, path: str) -> dict[str, Any]:
    row = await _checkpoint(res, who, path, param="tinker_path")
    config = row.lora_config
    return {
        "base_model": row.base_model,
        "is_lora": True,
        "lora_rank": row.lora_rank,
        "train_mlp": config.get("train_mlp"),
        "train_attn": config.get("train_attn"),
        "train_unembed": False,
    }

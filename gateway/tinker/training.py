"""Training models and their requests (the SDK's `TrainingClient`): create_model, get_info, forward and
forward_backward, optim_step, saving and loading weights.

A training request is a row of `tinker_requests`, answered in order by the worker holding the model
(`gateway.tinker.holder`); this side checks it, inserts it and wakes a worker when none holds the model. Its
answer is read back through `retrieve_future` (`gateway.tinker.futures`).
"""

from __future__ import annotations

import time
from typing import Any

import orjson

from gateway.deps import Resources
from gateway.errors import BudgetSpent, InsufficientQuota, InvalidRequest
from gateway.ids import new_id
from gateway.jobs.validation import refuse_unservable_rank
from gateway.queue import enqueue
from gateway.settings import Settings
from gateway.tenancy.keys import Principal
from gateway.tinker import owned, store, wire, wire_decode
from gateway.tinker import protocol as p
from gateway.tinker.paths import RUN_TINKER_MODEL, model_id_of, sampler_id_of, valid_name
from gateway.tinker.rows import TrainingModelRow
from gateway.tinker.wire_fields import MAX_FIELDS
from trainer.contract import tinker_loss_error

FIELDS_A_DATUM = 64
"""Protocol buffer fields a datum may take for the SDK's batches to stay within the decoder's bound
(`MAX_FIELDS`) in chunks of `MAX_FIELDS // FIELDS_A_DATUM` data: one of supervised learning takes 15 to 19
(one chunk of input tokens, `target_tokens` and `weights`), one of reinforcement learning 21 to 27 (with
`logprobs` and `advantages`); 64 leaves room for input tokens in a dozen chunks and more inputs."""
FRAMING_A_DATUM = 512
"""Bytes a datum's protocol buffer framing may add to what the SDK counts of it (4 bytes a token and each
input's values): tags, lengths and input names, 54 to 162 bytes for the SDK's own data."""
FRAMING_A_REQUEST = 4096
"""Bytes of a request's own fields: the model id, the loss and its config."""
INLINE_BODY_BYTES = 4096
"""Largest `forward_backward` body decoded on the event loop: about a millisecond at most, as much as the
trip to a process of the CPU pool and back (at most some 60 data of a token each, 15 fields a datum)."""


def max_numbers(settings: Settings) -> int:
    """Most numbers one `forward_backward` request may decode to (`tinker_max_numbers`)."""
    return settings.tinker_max_numbers or settings.max_request_body_bytes // 2


def chunk_limits(settings: Settings) -> tuple[int, int]:
    """`(data, bytes)`: most data, and most bytes as the SDK counts them, of one `forward_backward` request
    when the SDK splits a batch into several (`fwdbwd_max_chunk_len`, `fwdbwd_max_chunk_bytes_count` of its
    client config), so that each request fits the body cap and the decoder's bounds whatever the batch.

    The SDK counts a datum's numbers, never its framing: the chunk's data are bounded so that their framing
    takes at most a quarter of the body (`FRAMING_A_DATUM` each) and their fields the decoder's bound
    (`FIELDS_A_DATUM` each), and its bytes leave room for that framing under the body cap. A dense value
    takes at least 4 bytes, so 4 bytes a number also keeps a chunk within `max_numbers` (sparse inputs, which
    the SDK counts at their stored size, may still decode past it: a 400 naming the field). One datum over
    the byte bound goes alone, and is refused as a body over the cap (413)."""
    cap = settings.max_request_body_bytes
    data = max(1, min(MAX_FIELDS // FIELDS_A_DATUM, cap // (4 * FRAMING_A_DATUM)))
    size = min(cap - data * FRAMING_A_DATUM - FRAMING_A_REQUEST, 4 * max_numbers(settings))
    return data, max(1, size)


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
    """A training model; its rank at most the engines' largest (`engine_max_lora_rank`), as a job's `lora_r`:
    the SDK allows up to 256, but sampling from an adapter of a higher rank is refused."""
    owned.known_base(res, body.base_model)
    lora = body.lora_config or p.LoraConfig()
    refuse_unservable_rank(
        lora.rank, res.settings.engine_max_lora_rank, field="rank", param="lora_config.rank"
    )
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
    owned.seq_id(model_seq_id, "model_seq_id")
    await owned.own_session(res, who, session_id)
    model_id = model_id_of(session_id, model_seq_id)
    row = await store.create_model(
        res.pool, model_id=model_id, org_id=who.organization_id, key_id=who.api_key_id,
        session_id=session_id, base_model=base_model, rank=rank, lora_config=lora_config, metadata=metadata,
    )  # fmt: skip
    if row is None:
        raise owned.taken("model", model_id, "model_seq_id")
    return model_id


async def get_info(res: Resources, who: Principal, model_id: str) -> dict[str, Any]:
    row = await owned.model(res, who, model_id)
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
    res: Resources,
    who: Principal,
    model_id: str,
    kind: str,
    payload: dict[str, Any] | store.JsonText,
    *,
    tokens: int = 0,
) -> dict:
    """Queue one request of a training model (in arrival order) and make sure a worker holds the model.

    A request that computes on `tokens` tokens is first held to the key's and the organisation's token rate
    limits and to the monthly budget, priced as the prompt tokens of a completion of the base model (as the
    worker meters it), nothing queued when over: 429 `rate_limit_exceeded` (the SDK backs off and retries),
    or, for a spent budget, 402 `insufficient_quota`: the SDK's billing status, on which it holds the loop
    for `tinker_budget_pause_s`, retrying, before it raises `BillingError`."""
    return await queue_request(res, who, await owned.model(res, who, model_id), kind, payload, tokens=tokens)


async def queue_request(
    res: Resources,
    who: Principal,
    row: TrainingModelRow,
    kind: str,
    payload: dict[str, Any] | store.JsonText,
    *,
    tokens: int = 0,
) -> dict:
    """`submit` for a model the caller's request already resolved to its row."""
    model_id = row.id
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


async def _decode(res: Resources, who: Principal, body: bytes) -> tuple[wire_decode.ForwardBackward, str]:
    """The request and its payload as JSON (`wire_decode.decode_to_json`), or a 400 naming the field. A
    body over `INLINE_BODY_BYTES` is decoded in the gateway's CPU pool, as one of the organisation's
    CPU-heavy calls (`gateway.offload`: 429 when it has them all running): its decoding and encoding cost
    up to tens of milliseconds of the interpreter's lock, which would stall every other request here."""
    limit = max_numbers(res.settings)
    try:
        if len(body) <= INLINE_BODY_BYTES:
            return wire_decode.decode_to_json(body, max_numbers=limit)
        return await res.offload.cpu(who.organization_id, wire_decode.decode_to_json, body, max_numbers=limit)
    except wire.WireError as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None


async def forward_backward(res: Resources, who: Principal, body: bytes) -> dict[str, Any]:
    """Decode and check the whole request (`gateway.tinker.wire_decode`: sizes and shapes before anything is
    expanded, then the loss's inputs and the base model's vocabulary), so that the training process gets
    nothing it would fail on; each refusal is a 400 naming the field."""
    settings = res.settings
    req, payload = await _decode(res, who, body)
    loss_error = tinker_loss_error(req.loss_fn)
    if loss_error is not None:
        raise InvalidRequest(loss_error, param="loss_fn", code="unknown_loss_fn")
    row = await owned.model(res, who, req.model_id)
    base = row.base_model
    known = base in settings.base_models  # else the training process checks against its embedding
    try:
        req.check_inputs(wire_decode.vocabulary_size(settings.base_model_path(base)) if known else None)
    except wire.WireError as exc:
        raise InvalidRequest(exc.message, param=exc.param) from None
    kind = "forward" if req.forward_only else "forward_backward"
    return await queue_request(res, who, row, kind, store.JsonText(payload), tokens=req.tokens)


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
    row = await owned.model(res, who, body.model_id)
    if body.path is None and body.sampling_session_seq_id is not None:
        sampler_id = sampler_id_of(
            row.session_id, owned.seq_id(body.sampling_session_seq_id, "sampling_session_seq_id")
        )
        if await store.get_sampler(res.pool, sampler_id=sampler_id, org_id=who.organization_id):
            raise owned.taken("sampling session", sampler_id, "sampling_session_seq_id")
        payload["session_id"] = row.session_id
        payload["sampler_id"] = sampler_id
        payload["ttl_seconds"] = res.settings.tinker_ephemeral_ttl_s
    return await queue_request(res, who, row, "save_weights_for_sampler", payload)


async def load_weights(res: Resources, who: Principal, body: p.LoadWeightsRequest) -> dict[str, Any]:
    ckpt = await owned.checkpoint(res, who, body.path, "training")
    if body.optimizer and not ckpt.with_optimizer:
        raise InvalidRequest("This checkpoint holds no optimizer state.", param="optimizer")
    model_id = body.model_id
    if model_id is None:  # a new model made by loading the checkpoint (create_training_client_from_state)
        if body.session_id is None or body.model_seq_id is None:
            raise InvalidRequest("load_weights needs model_id, or session_id and model_seq_id.")
        limit = res.settings.engine_max_lora_rank
        if ckpt.lora_rank > limit:  # saved while the server served higher ranks than it does now
            raise InvalidRequest(
                f"This checkpoint's adapter has rank {ckpt.lora_rank}, above the largest adapter rank this "
                f"server serves ({limit}): a model made from it could not be used.",
                param="path",
                code="invalid_value",
            )
        model_id = await _new_model(
            res, who, body.session_id, body.model_seq_id, base_model=ckpt.base_model, rank=ckpt.lora_rank,
            lora_config=ckpt.lora_config, metadata=body.user_metadata,
        )  # fmt: skip
    payload = {"dir": ckpt.path, "optimizer": body.optimizer, "path": body.path}
    return await submit(res, who, model_id, "load_weights", payload)

"""The Tinker wire decoder (`gateway.tinker.wire_decode`): every malformed `forward_backward` refused,
naming the field, before anything is expanded; the same refusals as 400s through a running gateway; and
the training process answering what still reaches it as the caller's error.

Malformed bodies are built with the SDK's own protocol buffer classes (`tinker.proto.tinker_public_pb2`),
well-formed ones with the SDK's encoder (`forward_backward_request_to_proto`), so the decoder is held to what
the SDK sends.
"""

from __future__ import annotations

import io
import json
import math
import tracemalloc
from collections.abc import Callable, Iterator
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto

from gateway.tinker import wire
from gateway.tinker.wire_decode import decode_forward_backward, vocabulary_size
from gateway.tinker.wire_fields import MAX_FIELDS, fields_left
from tests.support.stack import GatewayServer, Tenant
from trainer.tiny import shipped_model_dir

LIMIT = 1_000_000
TOKENS = [5, 17, 42, 9]
TARGETS = [17, 42, 9, 33]


def sdk_body(data: list[types.Datum], loss: str = "cross_entropy", config: dict | None = None) -> bytes:
    """A `forward_backward` body exactly as the SDK encodes it."""
    request = types.ForwardBackwardRequest(
        model_id="m",
        seq_id=1,
        forward_backward_input=types.ForwardBackwardInput(data=data, loss_fn=loss, loss_fn_config=config),
    )
    return forward_backward_request_to_proto(request).SerializeToString()


def dense(values: Any, dtype: int = pb.DTYPE_FLOAT32, shape: list[int] | None = None) -> pb.Tensor:
    np_dtype = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
    raw = values if isinstance(values, bytes) else np.asarray(values, dtype=np_dtype[dtype]).tobytes()
    return pb.Tensor(dense=raw, dtype=dtype, shape=shape or [])


def csr(
    shape: list[int], crow: list[int], col: list[int], values: Any, dtype: int = pb.DTYPE_FLOAT32
) -> pb.Tensor:
    np_dtype = np.float32 if dtype == pb.DTYPE_FLOAT32 else np.int64
    sparse = pb.SparseCsr(
        values=np.asarray(values, dtype=np_dtype).tobytes(),
        crow_indices=np.asarray(crow, dtype=np.int64).tobytes(),
        col_indices=np.asarray(col, dtype=np.int64).tobytes(),
    )
    return pb.Tensor(sparse_csr=sparse, dtype=dtype, shape=shape)


def raw_body(
    tokens: bytes | list[int] = TOKENS,
    inputs: dict[str, pb.Tensor] | None = None,
    *,
    model_id: str = "m",
    config: dict[str, float] | None = None,
) -> bytes:
    """A one-datum `ForwardBackwardRequest` with `inputs` over a valid `target_tokens` (cross-entropy)."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    raw = tokens if isinstance(tokens, bytes) else np.asarray(tokens, dtype=np.int32).tobytes()
    datum.model_input.add().encoded_text.tokens = raw
    datum.loss_fn_inputs["target_tokens"].CopyFrom(dense(TARGETS, pb.DTYPE_INT64))
    for name, tensor in (inputs or {}).items():
        datum.loss_fn_inputs[name].CopyFrom(tensor)
    for key, value in (config or {}).items():
        msg.loss_fn_config[key] = value
    return msg.SerializeToString()


def hostile_sparse(model_id: str = "m", side: int = 3000) -> bytes:
    """A few dozen bytes declaring a `side` x `side` sparse `target_tokens` with no entries."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray([1], dtype=np.int32).tobytes()
    datum.loss_fn_inputs["target_tokens"].CopyFrom(csr([side, side], [0, 0], [], [], pb.DTYPE_INT64))
    return msg.SerializeToString()


WEIGHTS = "data[0].loss_fn_inputs.weights"
MALFORMED: dict[str, tuple[bytes, str | None, str]] = {
    "token bytes not a multiple of 4": (
        raw_body(np.asarray(TOKENS, dtype=np.int32).tobytes()[:-1]),
        "data[0].model_input",
        "15 bytes, not a whole number of 4-byte int32 values",
    ),
    "dense bytes not a multiple of 4": (
        raw_body(inputs={"weights": dense(b"\0" * 15)}),
        WEIGHTS,
        "15 bytes, not a whole number of 4-byte float32 values",
    ),
    "dense bytes against the shape": (
        raw_body(inputs={"weights": dense([1.0] * 4, shape=[2, 3])}),
        WEIGHTS,
        "dense holds 4 values; the shape [2, 3] declares 6",
    ),
    "a negative sparse shape": (
        raw_body(inputs={"weights": csr([-1, 4], [0], [], [])}),
        WEIGHTS,
        "shape [-1, 4] has a negative dimension",
    ),
    "a 1-D sparse shape with rows": (
        raw_body(inputs={"weights": csr([4], [0, 1, 1, 1, 1], [0], [1.0])}),
        WEIGHTS,
        "needs a 2-D shape (rows, columns); it declares [4]",
    ),
    "a sparse column out of range": (
        raw_body(inputs={"weights": csr([1, 4], [0, 1], [7], [1.0])}),
        WEIGHTS,
        "col_indices must lie in 0..3",
    ),
    "a negative sparse column": (
        raw_body(inputs={"weights": csr([1, 4], [0, 1], [-1], [1.0])}),
        WEIGHTS,
        "col_indices must lie in 0..3",
    ),
    "sparse rows against the shape": (
        raw_body(inputs={"weights": csr([2, 2], [0, 1], [0], [1.0])}),
        WEIGHTS,
        "crow_indices has 2 entries; a shape of 2 rows needs 3",
    ),
    "falling sparse row pointers": (
        raw_body(inputs={"weights": csr([2, 2], [0, 2, 1], [0, 1], [1.0, 1.0])}),
        WEIGHTS,
        "must rise from 0 to the number of values (2) and never fall",
    ),
    "row pointers past the values": (
        raw_body(inputs={"weights": csr([2, 2], [0, 1, 3], [0, 1], [1.0, 1.0])}),
        WEIGHTS,
        "must rise from 0 to the number of values (2)",
    ),
    "values and columns that do not pair up": (
        raw_body(inputs={"weights": csr([1, 4], [0, 2], [0, 1], [1.0])}),
        WEIGHTS,
        "1 values for 2 column indexes",
    ),
    "a column given twice in a row": (
        raw_body(inputs={"weights": csr([1, 4], [0, 2], [1, 1], [1.0, 2.0])}),
        WEIGHTS,
        "must rise strictly within each row",
    ),
    "sparse index bytes not a multiple of 8": (
        raw_body(
            inputs={
                "weights": pb.Tensor(
                    sparse_csr=pb.SparseCsr(crow_indices=b"\0" * 12), dtype=pb.DTYPE_FLOAT32, shape=[1, 4]
                )
            }
        ),
        WEIGHTS,
        "crow_indices is 12 bytes, not a whole number of 8-byte int64 values",
    ),
    "more entries than tokens": (
        raw_body(inputs={"weights": dense([1.0] * 5)}),
        WEIGHTS,
        "5 entries for 4 input tokens",
    ),
    "NaN": (
        raw_body(inputs={"weights": dense([1.0, math.nan, 1.0, 1.0])}),
        WEIGHTS,
        "NaN or infinity",
    ),
    "infinity in a sparse tensor": (
        raw_body(inputs={"weights": csr([1, 4], [0, 1], [2], [math.inf])}),
        WEIGHTS,
        "NaN or infinity",
    ),
    "NaN in the loss config": (
        raw_body(config={"beta": math.nan}),
        "loss_fn_config.beta",
        "loss_fn_config 'beta' is nan",
    ),
    "a negative input token": (
        raw_body([5, -3, 42, 9]),
        "data[0].model_input",
        "negative token id (-3)",
    ),
    "a negative target token": (
        raw_body(inputs={"target_tokens": dense([17, -1, 9, 33], pb.DTYPE_INT64)}),
        "data[0].loss_fn_inputs.target_tokens",
        "negative token id (-1)",
    ),
    "fractional target tokens": (
        raw_body(inputs={"target_tokens": dense([17, 42.5, 9, 33])}),
        "data[0].loss_fn_inputs.target_tokens",
        "whole token ids",
    ),
    "an unsupported dtype": (
        raw_body(inputs={"weights": pb.Tensor(dense=b"\0" * 8, dtype=pb.DTYPE_BFLOAT16)}),
        WEIGHTS,
        "Unsupported tensor dtype DTYPE_BFLOAT16",
    ),
    "too many dimensions": (
        raw_body(inputs={"weights": dense([1.0] * 4, shape=[1] * 9 + [4])}),
        WEIGHTS,
        "10 dimensions; at most 8",
    ),
    "no input tokens": (raw_body([]), "data[0].model_input", "no input tokens"),
    "no data": (
        pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy").SerializeToString(),
        "data",
        "forward_backward needs at least one datum.",
    ),
    "a body that is not a ForwardBackwardRequest": (b"\xff\xff\xff", None, "not a ForwardBackwardRequest"),
}


# ---------------------------------------------------------------------------------------------- the decoder
@pytest.mark.parametrize("case", MALFORMED)
def test_each_malformed_request_is_refused_naming_the_field(case: str) -> None:
    body, param, message = MALFORMED[case]
    with pytest.raises(wire.WireError) as caught:
        decode_forward_backward(body, max_numbers=LIMIT)
    assert caught.value.param == param
    assert message in caught.value.message


def test_a_datum_without_target_tokens_or_with_an_image_is_refused() -> None:
    msg = pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.asarray(TOKENS, dtype=np.int32).tobytes()
    datum.loss_fn_inputs["weights"].CopyFrom(dense([1.0] * 4))
    with pytest.raises(wire.WireError) as caught:
        decode_forward_backward(msg.SerializeToString(), max_numbers=LIMIT)
    assert (caught.value.param, caught.value.message) == (
        "data[0].loss_fn_inputs",
        "data[0] has no loss_fn_input 'target_tokens'.",
    )
    datum.model_input.add().image.data = b"\x89PNG"
    with pytest.raises(wire.WireError) as caught:
        decode_forward_backward(msg.SerializeToString(), max_numbers=LIMIT)
    assert caught.value.param == "data[0].model_input"
    assert caught.value.message == "Chunk 1 is image: only encoded_text chunks are supported."


@pytest.mark.parametrize("side", [3000, 2**31, 2**62])
def test_a_huge_declared_sparse_shape_costs_nothing(side: int) -> None:
    body = hostile_sparse(side=side)
    assert len(body) < 100
    tracemalloc.start()
    try:
        with pytest.raises(wire.WireError) as caught:
            decode_forward_backward(body, max_numbers=LIMIT)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert caught.value.param == "data[0].loss_fn_inputs.target_tokens"
    assert caught.value.message == (
        f"The tensor has {side * side} entries for 1 input tokens; give one per token."
    )
    assert peak < 64 * 1024, peak  # the 3000 x 3000 shape alone is 72 MB of int64


def sparse_heavy(model_id: str, data: int, tokens: int, extra: int) -> bytes:
    """`data` data of `tokens` tokens, each with `extra` empty 1 x `tokens` sparse inputs (a few bytes each
    on the wire, `tokens` numbers each once expanded) besides its dense `target_tokens`."""
    msg = pb.ForwardBackwardRequest(model_id=model_id, loss_fn="cross_entropy")
    for _ in range(data):
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = np.ones(tokens, dtype=np.int32).tobytes()
        datum.loss_fn_inputs["target_tokens"].CopyFrom(dense([1] * tokens, pb.DTYPE_INT64))
        for k in range(extra):
            datum.loss_fn_inputs[f"x{k:02d}"].CopyFrom(csr([1, tokens], [0, 0], [], []))
    return msg.SerializeToString()


def test_the_request_is_bounded_in_numbers_whatever_its_sparse_inputs_expand_to() -> None:
    body = sparse_heavy("m", data=3, tokens=100, extra=10)
    decoded = decode_forward_backward(body, max_numbers=3600)  # 3 x (100 tokens + 11 inputs of 100)
    assert decoded.tokens == 300 and [len(d["inputs"]) for d in decoded.data] == [11, 11, 11]
    assert decoded.data[2]["inputs"]["x09"] == [0.0] * 100
    with pytest.raises(wire.WireError) as caught:
        decode_forward_backward(body, max_numbers=3599)
    assert caught.value.param == "data[2].loss_fn_inputs.x09"  # the last input counted (in name order)
    assert caught.value.message.startswith("The request decodes to more than 3599 numbers")


def holds_messages(descriptor: Any) -> bool:
    return any(f.message_type is not None for f in descriptor.fields)


def fields_of(msg: Any) -> int:
    """The fields of a parsed message, each repeated value one, counting those of the messages that hold
    messages too (the reference the count on raw bytes must match)."""
    total = 0
    for field, value in msg.ListFields():
        kind = field.message_type
        if kind is not None and kind.GetOptions().map_entry:
            inner = kind.fields_by_name["value"].message_type
            if holds_messages(kind):  # an entry of a message value: its key and value counted too
                total += sum(3 + (fields_of(value[k]) if holds_messages(inner) else 0) for k in value)
            else:
                total += len(value)
            continue
        values = value if field.is_repeated else [value]
        total += sum(1 + (fields_of(v) if kind is not None and holds_messages(kind) else 0) for v in values)
    return total


def test_fields_are_counted_on_the_raw_bytes_as_protobuf_parses_them() -> None:
    ppo = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS),
        loss_fn_inputs={"target_tokens": TARGETS, "advantages": [0.5] * 4, "logprobs": [-1.0] * 4},
    )
    bodies = [raw_body(), sdk_body([ppo, ppo], "ppo", {"clip_low_threshold": 0.7}), hostile_sparse(side=100)]
    for body in bodies:
        left = fields_left(body, MAX_FIELDS)
        assert MAX_FIELDS - left == fields_of(pb.ForwardBackwardRequest.FromString(body))
    # a packed shape counts a value a byte: its most (3000 takes two)
    left = fields_left(hostile_sparse(), MAX_FIELDS)
    assert MAX_FIELDS - left == fields_of(pb.ForwardBackwardRequest.FromString(hostile_sparse())) + 2


def test_a_request_of_too_many_fields_is_refused_before_it_is_parsed() -> None:
    """Parsing and walking cost a little for each field however small: a body of many tiny ones is
    refused on a count of its raw bytes, as quickly as any other."""
    sft = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS),
        loss_fn_inputs={"target_tokens": TARGETS, "weights": [1.0] * 4},
    )
    fits = (MAX_FIELDS - 3) // 15  # model_id, seq_id, loss_fn; 15 fields a datum
    decoded = decode_forward_backward(sdk_body([sft] * fits), max_numbers=LIMIT)
    assert len(decoded.data) == fits == 545
    many_chunks = pb.ForwardBackwardRequest(model_id="m", loss_fn="cross_entropy")
    datum = many_chunks.data.add()
    for _ in range(MAX_FIELDS // 2 + 1):  # a chunk and its encoded_text: two fields each
        datum.model_input.add().encoded_text.tokens = np.ones(1, dtype=np.int32).tobytes()
    wide = pb.ForwardBackwardRequest(model_id="m")  # the packed shape the body's last field
    wide.data.add().loss_fn_inputs["target_tokens"].shape.extend([1] * MAX_FIELDS)
    configured = pb.ForwardBackwardRequest.FromString(raw_body())
    for k in range(MAX_FIELDS):
        configured.loss_fn_config[f"k{k}"] = 1.0
    refused = [
        sdk_body([sft] * (fits + 1)),
        many_chunks.SerializeToString(),
        wide.SerializeToString(),
        configured.SerializeToString(),
        b"\x1a\x00" * (MAX_FIELDS + 1),  # empty data
        b"\xf8\x07\x01" * (MAX_FIELDS + 1),  # a field the schema does not have
    ]
    for body in refused:
        with pytest.raises(wire.WireError) as caught:
            decode_forward_backward(body, max_numbers=LIMIT)
        assert (caught.value.param, caught.value.message) == (
            "data",
            f"The request holds more than {MAX_FIELDS} protocol buffer fields (data, their chunks and "
            "loss_fn_inputs, and what those hold); send its data in smaller forward_backward calls.",
        )
    for broken in (raw_body()[:-1], b"\x1a\x05\x0a", b"\x0b", b"\x08" + b"\xff" * 11):
        with pytest.raises(wire.WireError) as caught:
            decode_forward_backward(broken, max_numbers=LIMIT)
        assert caught.value.param is None
        assert caught.value.message.startswith("The body is not a ForwardBackwardRequest")


def test_what_the_sdk_sends_decodes_to_one_entry_per_token() -> None:
    weights = torch.zeros(1, 20)
    weights[0, 3] = 0.5
    targets = torch.arange(1, 21)[None, :]
    sparse = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(20))),
        loss_fn_inputs={"target_tokens": targets, "weights": weights},
    )
    assert sparse.loss_fn_inputs["weights"].sparse_crow_indices == [0, 1]  # the SDK sent it sparse
    plain = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS),
        loss_fn_inputs={
            "target_tokens": TARGETS,
            "advantages": [0.5, -1.0, 0.0, 2.0],
            "logprobs": [-1.0] * 4,
        },
    )
    decoded = decode_forward_backward(
        sdk_body([sparse, plain], "ppo", {"clip_low_threshold": 0.7}), max_numbers=LIMIT
    )
    assert (decoded.model_id, decoded.seq_id, decoded.loss_fn, decoded.forward_only) == ("m", 1, "ppo", False)
    assert decoded.loss_fn_config == {"clip_low_threshold": pytest.approx(0.7)}
    assert decoded.tokens == 24 and decoded.top_ids == [(19, 20), (42, 42)]
    assert decoded.data[0] == {
        "tokens": list(range(20)),
        "inputs": {"target_tokens": list(range(1, 21)), "weights": [0.0] * 3 + [0.5] + [0.0] * 16},
    }
    assert decoded.data[1] == {
        "tokens": TOKENS,
        "inputs": {"advantages": [0.5, -1.0, 0.0, 2.0], "logprobs": [-1.0] * 4, "target_tokens": TARGETS},
    }
    config = decoded.loss_fn_config
    assert decoded.payload() == {
        "loss_fn": "ppo",
        "loss_fn_config": config,
        "forward_only": False,
        "data": decoded.data,
    }


def test_inputs_are_checked_against_the_loss_and_the_vocabulary() -> None:
    plain = types.Datum(
        model_input=types.ModelInput.from_ints(TOKENS), loss_fn_inputs={"target_tokens": TARGETS}
    )
    decoded = decode_forward_backward(sdk_body([plain, plain], "importance_sampling"), max_numbers=LIMIT)
    with pytest.raises(wire.WireError) as caught:
        decoded.check_inputs(None)
    assert (caught.value.param, caught.value.message) == (
        "data[0].loss_fn_inputs",
        "The loss 'importance_sampling' needs the loss_fn_input 'logprobs'; data[0] has none.",
    )
    decoded = decode_forward_backward(sdk_body([plain, plain]), max_numbers=LIMIT)
    decoded.check_inputs(43)  # ids up to 42
    decoded.check_inputs(None)
    with pytest.raises(wire.WireError) as caught:
        decoded.check_inputs(42)
    assert (caught.value.param, caught.value.message) == (
        "data[0].model_input",
        "Token id 42 is out of the model's vocabulary (ids 0 to 41).",
    )
    with pytest.raises(wire.WireError) as caught:
        decoded.check_inputs(34)
    assert caught.value.param == "data[0].model_input"
    late = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]), loss_fn_inputs={"target_tokens": [2, 99]}
    )
    decoded = decode_forward_backward(sdk_body([plain, late]), max_numbers=LIMIT)
    with pytest.raises(wire.WireError) as caught:
        decoded.check_inputs(50)
    assert caught.value.param == "data[1].loss_fn_inputs.target_tokens"
    assert (
        vocabulary_size(shipped_model_dir())
        == json.loads((shipped_model_dir() / "config.json").read_text())["vocab_size"]
    )
    assert vocabulary_size(shipped_model_dir() / "missing") is None


# ------------------------------------------------------------------------------------- the training process
def test_the_training_process_answers_bad_data_as_the_callers_error() -> None:
    """What a gateway that does not know the vocabulary (or an older queued payload) lets through."""
    from trainer.tinker_session import serve

    vocab = vocabulary_size(shipped_model_dir())
    assert vocab is not None

    def fb(
        tokens: list[int], inputs: dict[str, Any], loss: str = "cross_entropy", config: dict | None = None
    ) -> dict:
        datum = {"tokens": tokens, "inputs": inputs}
        return {"op": "forward_backward", "loss_fn": loss, "loss_fn_config": config, "data": [datum]}

    requests = [
        {"op": "init", "base_path": str(shipped_model_dir()), "rank": 4, "seed": 0},
        fb([5, vocab], {"target_tokens": [1, 2]}),
        fb([5, 6], {"target_tokens": [1, vocab + 7]}),
        fb([5, 6], {"target_tokens": [1, -2]}),
        fb([5, 6], {"target_tokens": [1, 2], "weights": [1.0, None]}),  # NaN, once written as JSON
        fb([], {"target_tokens": []}),
        fb(
            [5, 6],
            {"target_tokens": [1, 2], "logprobs": [0.0, 0.0], "advantages": [1.0, 1.0]},
            "dro",
            {"beta": "x"},
        ),
        fb([5, 6], {"target_tokens": [1, 2]}),
    ]
    out = io.StringIO()
    serve(io.StringIO("".join(json.dumps(r) + "\n" for r in requests)), out)
    replies = [json.loads(line) for line in out.getvalue().splitlines()]
    assert replies[0] == {"ok": True, "result": {}}
    errors = [(r["ok"], r.get("category"), r.get("error")) for r in replies[1:-1]]
    out_of_vocabulary = f"holds a token id out of the model's vocabulary (0 to {vocab - 1})."
    assert errors == [
        (False, "user", f"data[0].model_input {out_of_vocabulary}"),
        (False, "user", f"data[0].loss_fn_inputs.target_tokens {out_of_vocabulary}"),
        (False, "user", f"data[0].loss_fn_inputs.target_tokens {out_of_vocabulary}"),
        (False, "user", "data[0].loss_fn_inputs.weights must be a list of numbers."),
        (False, "user", "data[0].model_input must be a non-empty list of token ids."),
        (False, "user", "loss_fn_config 'beta' must be a finite number, not 'x'."),
    ]
    assert replies[-1]["ok"], replies[-1]  # and the process goes on


# ---------------------------------------------------------------------------------------------- over HTTP
@pytest.fixture
def api(stack: GatewayServer, tenant: Tenant) -> Iterator[httpx.Client]:
    with httpx.Client(
        base_url=f"{stack.url}/api/v1", headers={"X-API-Key": "tml-" + tenant.key}, timeout=60
    ) as client:
        yield client


@pytest.fixture
def model_id(api: httpx.Client) -> str:
    """A training model of the tenant (made only: nothing here is ever queued for a worker)."""
    session = api.post("/create_session", json={"tags": [], "sdk_version": "test"})
    session.raise_for_status()
    made = api.post(
        "/create_model",
        json={"session_id": session.json()["session_id"], "model_seq_id": 0, "base_model": "tiny-chat",
              "lora_config": {"rank": 4}},
    )  # fmt: skip
    made.raise_for_status()
    return str(made.json()["model_id"])


def refusal(resp: httpx.Response) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error" and error["code"] is None
    return dict(error)


PROTOBUF = {"Content-Type": "application/x-protobuf"}


@pytest.mark.parametrize(
    "case",
    [
        "token bytes not a multiple of 4",
        "dense bytes not a multiple of 4",
        "a negative sparse shape",
        "a 1-D sparse shape with rows",
        "a sparse column out of range",
        "NaN",
        "NaN in the loss config",
        "a negative input token",
        "no data",
    ],
)
def test_malformed_tensors_are_a_400_naming_the_field(api: httpx.Client, model_id: str, case: str) -> None:
    body, param, message = MALFORMED[case]
    patched = pb.ForwardBackwardRequest.FromString(body)
    patched.model_id = model_id
    error = refusal(api.post("/forward_backward", content=patched.SerializeToString(), headers=PROTOBUF))
    assert error["param"] == param
    assert message in error["message"]


def test_the_hostile_sparse_request_is_refused(api: httpx.Client, model_id: str) -> None:
    body = hostile_sparse(model_id)
    assert len(body) < 150  # a 3000 x 3000 tensor declared in as many bytes as the attack's
    error = refusal(api.post("/forward_backward", content=body, headers=PROTOBUF))
    assert error == {
        "message": "The tensor has 9000000 entries for 1 input tokens; give one per token.",
        "type": "invalid_request_error",
        "param": "data[0].loss_fn_inputs.target_tokens",
        "code": None,
    }


def test_many_sparse_inputs_are_bounded(stack: GatewayServer, api: httpx.Client, model_id: str) -> None:
    """A body of under a megabyte whose sparse inputs would expand to more numbers than the bound."""
    limit = stack.settings.tinker_max_numbers or stack.settings.max_request_body_bytes // 2
    tokens, extra = 1000, 19
    data = limit // (tokens * (extra + 2)) + 1
    body = sparse_heavy(model_id, data, tokens, extra)
    assert len(body) < stack.settings.max_request_body_bytes
    error = refusal(api.post("/forward_backward", content=body, headers=PROTOBUF))
    assert error["param"].startswith(f"data[{data - 1}].loss_fn_inputs.x")  # where it went over
    assert error["message"].startswith(f"The request decodes to more than {limit} numbers")


def test_the_sdk_gets_a_bad_request_for_nan_and_out_of_vocabulary_ids(
    stack: GatewayServer, tenant: Tenant
) -> None:
    vocab = vocabulary_size(stack.settings.base_model_path("tiny-chat"))
    assert vocab is not None
    with tinker.ServiceClient(base_url=stack.url, api_key="tml-" + tenant.key) as service:
        tc = service.create_lora_training_client(base_model="tiny-chat", rank=4)

        def refused(tokens: list[int], inputs: dict[str, Any]) -> Callable[[], object]:
            datum = types.Datum(model_input=types.ModelInput.from_ints(tokens), loss_fn_inputs=inputs)
            return lambda: tc.forward_backward([datum], "cross_entropy").result()

        cases = [
            (refused([1, 2], {"target_tokens": [2, 3], "weights": [1.0, math.nan]}), "NaN or infinity"),
            (
                refused([1, vocab], {"target_tokens": [2, 3]}),
                f"Token id {vocab} is out of the model's vocabulary",
            ),
            (refused([1, 2], {"target_tokens": [2, vocab + 5]}), f"Token id {vocab + 5} is out of"),
        ]
        for call, message in cases:
            with pytest.raises(tinker.BadRequestError, match=message):
                call()

"""The checked decoder of Tinker's `forward_backward` requests (`ForwardBackwardRequest` of
`gateway.tinker.wire`): `decode_forward_backward` turns a request into plain lists, what the training
process reads.

The decoder is the one place a request's bytes become numbers, and it trusts none of them: every length,
shape and index is checked against the bytes that carry it, and every size is counted against a bound,
before an array is allocated; a sparse tensor is expanded only once its declared dense size is known to be
one entry per input token and within the request's bound. Each refusal is a `WireError` naming the field
(`data[3].loss_fn_inputs.weights`), which the gateway answers as a 400.
"""

from __future__ import annotations

import bisect
import functools
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import orjson

from gateway.tinker.wire import ForwardBackwardRequest, WireError
from gateway.tinker.wire_fields import check_fields
from trainer.contract import model_defaults, tinker_required_inputs

_DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype(np.float32), 2: np.dtype(np.int64), 3: np.dtype(np.int32)}
"""DTYPE_FLOAT32, DTYPE_INT64 (what the SDK sends) and DTYPE_INT32."""
_DTYPE_NAMES = {0: "DTYPE_UNSPECIFIED", 4: "DTYPE_BFLOAT16"}
_INDEX = np.dtype(np.int64)  # CSR row pointers and column indexes, as the SDK writes them
_TOKEN = np.dtype(np.int32)  # encoded_text chunks, as the SDK writes them
TARGET_TOKENS = "target_tokens"
MAX_DIMS = 8
"""Most dimensions a tensor's declared shape may have (the SDK sends 1-D and 2-D ones)."""


@dataclass(slots=True)
class ForwardBackward:
    """A decoded `ForwardBackwardRequest`: what the training process reads, and what the gateway checks."""

    model_id: str
    seq_id: int
    loss_fn: str
    loss_fn_config: dict[str, float | str]
    forward_only: bool
    data: list[dict[str, Any]]
    """Each datum's `tokens` (ints) and `inputs` (name -> flat list, one entry per token)."""
    tokens: int
    """Input tokens of all the data together (what the request is metered and rate limited on)."""
    top_ids: list[tuple[int, int]] = field(default_factory=list)
    """Each datum's largest input token id and largest target token id."""
    input_names: list[tuple[str, ...]] = field(default_factory=list)
    """Each datum's `loss_fn_inputs` names (what `check_inputs` reads, with or without `data`)."""

    def payload(self) -> dict[str, Any]:
        """The request as the training process reads it (`trainer.tinker_session`)."""
        return {
            "loss_fn": self.loss_fn,
            "loss_fn_config": self.loss_fn_config,
            "forward_only": self.forward_only,
            "data": self.data,
        }

    def check_inputs(self, vocab_size: int | None) -> None:
        """Refuse a datum without an input its loss reads, or with a token id out of the base model's
        vocabulary (`vocab_size`, None when unknown: the training process checks its embedding then)."""
        needed = tinker_required_inputs(self.loss_fn)
        for i, names in enumerate(self.input_names):
            missing = [name for name in needed if name not in names]
            if missing:
                raise WireError(
                    f"The loss '{self.loss_fn}' needs the loss_fn_input '{missing[0]}'; data[{i}] has none.",
                    f"data[{i}].loss_fn_inputs",
                )
        if vocab_size is None:
            return
        for i, (top_input, top_target) in enumerate(self.top_ids):
            for top, param in (
                (top_input, f"data[{i}].model_input"),
                (top_target, f"data[{i}].loss_fn_inputs.{TARGET_TOKENS}"),
            ):
                if top >= vocab_size:
                    raise WireError(
                        f"Token id {top} is out of the model's vocabulary (ids 0 to {vocab_size - 1}).", param
                    )


@dataclass(slots=True)
class _Group:
    """The `loss_fn_inputs` of one dtype and role (`target_tokens` or not) of all data, in request order:
    their values are read in one array, and one check covers them all."""

    dtype: np.dtype[Any]
    where: list[tuple[int, str]] = field(default_factory=list)
    """(datum, input name) of each tensor."""
    parts: list[Any] = field(default_factory=list)
    """Each tensor's dense bytes, or its `Tensor` message when it is sparse (expanded in the second pass)."""
    ends: list[int] = field(default_factory=list)
    """Where each tensor's values end in `values`."""
    values: np.ndarray[Any, Any] = field(default_factory=lambda: np.empty(0))

    def param(self, index: int) -> str:
        """The field holding entry `index` of `values`."""
        datum, name = self.where[bisect.bisect_right(self.ends, index)]
        return _input_param(datum, name)

    def starts(self) -> list[int]:
        return [0, *self.ends[:-1]]


def _input_param(datum: int, name: str) -> str:
    return f"data[{datum}].loss_fn_inputs.{name}"


def _items(raw: bytes, dtype: np.dtype[Any], what: str, param: Callable[[], str]) -> int:
    """How many `dtype` values `raw` holds, refused when its length is not a whole number of them."""
    if len(raw) % dtype.itemsize:
        raise WireError(
            f"{what} is {len(raw)} bytes, not a whole number of {dtype.itemsize}-byte {dtype.name} values.",
            param(),
        )
    return len(raw) // dtype.itemsize


def _count(shape: list[int], param: Callable[[], str]) -> int:
    if len(shape) > MAX_DIMS:
        raise WireError(
            f"The tensor's shape has {len(shape)} dimensions; at most {MAX_DIMS} are accepted.", param()
        )
    if any(d < 0 for d in shape):
        raise WireError(f"The tensor's shape {shape} has a negative dimension.", param())
    return math.prod(shape)  # Python integers: a declared 2**62 x 2**62 neither overflows nor allocates


# ---------------------------------------------------------------------------------------------- first pass
# Sizes only: byte lengths, shapes, counts against the data and the budget. Nothing is allocated, and a
# field's name is only spelled out for a refusal.
def _refuse_chunk(chunk: Any, j: int, param: str) -> None:
    """Why chunk `j` of a datum is refused: not encoded text, or not a whole number of token ids."""
    kind = chunk.WhichOneof("chunk")
    if kind != "encoded_text":
        raise WireError(f"Chunk {j} is {kind or 'empty'}: only encoded_text chunks are supported.", param)
    _items(chunk.encoded_text.tokens, _TOKEN, f"Chunk {j}'s tokens", lambda: param)


def _input_tokens_param(datum: int) -> str:
    return f"data[{datum}].model_input"


def _sizes(msg: Any, tokens: int, param: Callable[[], str]) -> tuple[np.dtype[Any], int, bytes | None]:
    """A tensor's dtype, dense size and dense bytes (None for a sparse one), after every check that needs
    no value: a known dtype, whole values, a shape agreeing with the bytes, CSR parts of matching lengths,
    one entry per input token."""
    dtype = _DTYPES.get(msg.dtype)
    if dtype is None:
        name = _DTYPE_NAMES.get(msg.dtype, str(msg.dtype))
        raise WireError(f"Unsupported tensor dtype {name}; use float32 or int64.", param())
    shape = list(msg.shape)
    sparse = msg.HasField("sparse_csr")
    if sparse and len(shape) != 2:
        raise WireError(
            f"A sparse (CSR) tensor needs a 2-D shape (rows, columns); it declares {shape}.", param()
        )
    raw = None if sparse else msg.dense
    held = None if raw is None else _items(raw, dtype, "dense", param)
    count = _count(shape, param) if shape or held is None else held  # dense with no shape: 1-D
    if held is not None and held != count:
        raise WireError(f"dense holds {held} values; the shape {shape} declares {count}.", param())
    if count != tokens:  # the losses are per token (`trainer.tinker_losses`)
        raise WireError(
            f"The tensor has {count} entries for {tokens} input tokens; give one per token.", param()
        )
    if sparse:
        csr = msg.sparse_csr
        rows = _items(csr.crow_indices, _INDEX, "sparse_csr.crow_indices", param)
        if rows != shape[0] + 1:
            need = shape[0] + 1
            raise WireError(
                f"sparse_csr.crow_indices has {rows} entries; a shape of {shape[0]} rows needs {need}.",
                param(),
            )
        nnz = _items(csr.col_indices, _INDEX, "sparse_csr.col_indices", param)
        values = _items(csr.values, dtype, "sparse_csr.values", param)
        if values != nnz:
            raise WireError(
                f"sparse_csr has {values} values for {nnz} column indexes; they must pair up.", param()
            )
    return dtype, count, raw


# ---------------------------------------------------------------------------------------------- second pass
# Values, once every size is known to be sound: each group of tensors read as one array (sparse ones
# expanded first), so the checks cost a few array operations however many tensors there are.
def _expand(msg: Any, dtype: np.dtype[Any], param: str) -> bytes:
    """The dense values of a CSR tensor whose sizes passed the first pass."""
    rows, cols = msg.shape
    csr = msg.sparse_csr
    crow = np.frombuffer(csr.crow_indices, dtype=_INDEX)
    col = np.frombuffer(csr.col_indices, dtype=_INDEX)
    steps = np.diff(crow)
    if crow[0] != 0 or crow[-1] != len(col) or (steps < 0).any():
        raise WireError(
            f"sparse_csr.crow_indices must rise from 0 to the number of values ({len(col)}) and never fall.",
            param,
        )
    if len(col) and (col.min() < 0 or col.max() >= cols):
        raise WireError(f"sparse_csr.col_indices must lie in 0..{cols - 1} (the shape's columns).", param)
    row_of = np.repeat(np.arange(rows, dtype=np.int64), steps)
    # within a row the columns rise strictly (torch's CSR invariant): no entry is given twice
    if len(col) > 1 and ((np.diff(col) <= 0) & (row_of[1:] == row_of[:-1])).any():
        raise WireError("sparse_csr.col_indices must rise strictly within each row.", param)
    dense = np.zeros(rows * cols, dtype=dtype)
    dense[row_of * cols + col] = np.frombuffer(csr.values, dtype=dtype)
    return dense.tobytes()


def _read(group: _Group) -> None:
    """The group's values as one array (sparse tensors expanded), and no NaN or infinity among floats."""
    parts = [
        p if isinstance(p, bytes) else _expand(p, group.dtype, _input_param(*group.where[k]))
        for k, p in enumerate(group.parts)
    ]
    group.values = np.frombuffer(b"".join(parts), dtype=group.dtype)
    if group.dtype.kind == "f":
        finite = np.isfinite(group.values)
        if not finite.all():
            raise WireError(
                "The tensor holds NaN or infinity; give finite numbers.", group.param(int(np.argmin(finite)))
            )


def _target_ids(group: _Group) -> None:
    """A group of `target_tokens` as int64 ids: whole (float ones) and non-negative."""
    values = group.values
    if group.dtype.kind == "f":
        whole = np.floor(values) == values
        if not whole.all():
            raise WireError("target_tokens must be whole token ids.", group.param(int(np.argmin(whole))))
    group.values = values.astype(np.int64)
    if len(values) and group.values.min() < 0:
        at = int(np.argmax(group.values < 0))
        raise WireError(f"target_tokens holds a negative token id ({group.values[at]}).", group.param(at))


def _config(msg: Any) -> dict[str, float | str]:
    config: dict[str, float | str] = {k: v for k, v in msg.loss_fn_config.items()}
    for key, value in msg.loss_fn_config_v2.items():  # the SDK writes both; v2 also carries text
        config[key] = value.text if value.WhichOneof("value") == "text" else value.number
    for key, value in config.items():
        if isinstance(value, float) and not math.isfinite(value):
            raise WireError(
                f"loss_fn_config '{key}' is {value}; give a finite number.", f"loss_fn_config.{key}"
            )
    return config


def _first_pass(msg: Any, max_numbers: int) -> tuple[list[bytes], list[int], dict[Any, _Group]]:
    """Each datum's token bytes, where each datum's tokens end, and the inputs grouped by role and dtype;
    everything refused that sizes alone can tell. The SDK's usual tensor (dense, one dimension at most,
    one entry per token) is accepted inline; any other goes through `_sizes`, which refuses or admits it:
    this loop is the decoder's cost for many small data, so it does no more than it must."""
    numbers = 0
    token_bytes: list[bytes] = []
    token_ends: list[int] = []
    groups: dict[Any, _Group] = {}
    for i, datum in enumerate(msg.data):
        chunks, inputs = datum.model_input, datum.loss_fn_inputs
        count = 0
        for j, chunk in enumerate(chunks):
            raw = chunk.encoded_text.tokens
            if len(raw) % _TOKEN.itemsize or chunk.WhichOneof("chunk") != "encoded_text":
                _refuse_chunk(chunk, j, _input_tokens_param(i))
            count += len(raw) // _TOKEN.itemsize
            token_bytes.append(raw)
        if not count:
            raise WireError("The datum has no input tokens.", _input_tokens_param(i))
        numbers += count
        if numbers > max_numbers:
            raise _over(max_numbers, _input_tokens_param(i))
        token_ends.append(token_ends[-1] + count if token_ends else count)
        names = sorted(inputs)  # in name order: the same refusal for the same body
        if TARGET_TOKENS not in names:
            raise WireError(f"data[{i}] has no loss_fn_input '{TARGET_TOKENS}'.", f"data[{i}].loss_fn_inputs")
        for name in names:
            tensor = inputs[name]
            code = tensor.dtype
            dtype = _DTYPES.get(code)
            shape = tensor.shape
            raw = tensor.dense
            # dense bytes of one value a token (count > 0) mean no sparse_csr: they share a oneof
            if (
                dtype is None
                or len(raw) != count * dtype.itemsize
                or len(shape) > 1
                or (shape and shape[0] != count)
            ):
                dtype, _, raw = _sizes(tensor, count, functools.partial(_input_param, i, name))
            numbers += count
            if numbers > max_numbers:
                raise _over(max_numbers, _input_param(i, name))
            key = (name == TARGET_TOKENS, code)
            group = groups.get(key) or groups.setdefault(key, _Group(dtype))
            group.where.append((i, name))
            group.parts.append(tensor if raw is None else raw)
            group.ends.append(group.ends[-1] + count if group.ends else count)
    return token_bytes, token_ends, groups


def _over(limit: int, param: str) -> WireError:
    return WireError(
        f"The request decodes to more than {limit} numbers (tokens and loss_fn_inputs, sparse tensors at "
        "their dense size); send its data in smaller forward_backward calls.",
        param,
    )


def decode_forward_backward(body: bytes, *, max_numbers: int) -> ForwardBackward:
    """A serialized `ForwardBackwardRequest`, checked whole before any tensor is expanded, or `WireError`.

    At least one datum, each with encoded_text input tokens (int32, non-negative) and `loss_fn_inputs` of
    one entry per input token, `target_tokens` among them (whole, non-negative ids); tensors are float32,
    int64 or int32, dense (bytes matching the shape when one is given) or CSR (2-D shape, `rows + 1` row
    pointers rising from 0 to the number of values, columns in range and rising within a row); floats are
    finite. At most `wire_fields.MAX_FIELDS` protocol buffer fields; the tokens and every input's dense size
    together at most `max_numbers`.

    Before parsing, the fields are counted on the raw bytes. Then two passes: the first reads sizes only
    (byte lengths, declared shapes, counts against the data and the budget), the second reads values, each
    group of tensors as one array. Nothing is expanded before its size is known to be sound, and a refusal
    costs at most the count, the parse and the first pass over a bounded number of fields."""
    check_fields(body)
    msg = ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as exc:  # protobuf raises its own DecodeError
        raise WireError(f"The body is not a ForwardBackwardRequest: {exc}") from None
    if not msg.data:
        raise WireError("forward_backward needs at least one datum.", "data")
    config = _config(msg)
    token_bytes, token_ends, groups = _first_pass(msg, max_numbers)
    for group in groups.values():
        _read(group)
    tokens = np.frombuffer(b"".join(token_bytes), dtype=_TOKEN)
    if tokens.min() < 0:
        at = int(np.argmax(tokens < 0))
        datum = bisect.bisect_right(token_ends, at)
        raise WireError(f"The input holds a negative token id ({tokens[at]}).", _input_tokens_param(datum))
    token_starts = [0, *token_ends[:-1]]
    top_inputs = np.maximum.reduceat(tokens, token_starts).tolist()
    top_targets = [0] * len(token_ends)
    for (is_target, _), group in groups.items():
        if is_target:
            _target_ids(group)
            tops = np.maximum.reduceat(group.values, group.starts()).tolist()
            for (i, _), top in zip(group.where, tops, strict=True):
                top_targets[i] = top

    # accepted: the numbers become lists (what the request's row stores and the training process reads)
    all_tokens = tokens.tolist()
    data: list[dict[str, Any]] = [
        {"tokens": all_tokens[start:end], "inputs": {}}
        for start, end in zip(token_starts, token_ends, strict=True)
    ]
    for group in groups.values():
        values = group.values.tolist()
        for (i, name), start, end in zip(group.where, group.starts(), group.ends, strict=True):
            data[i]["inputs"][name] = values[start:end]
    return ForwardBackward(
        model_id=msg.model_id,
        seq_id=msg.seq_id,
        loss_fn=msg.loss_fn,
        loss_fn_config=config,
        forward_only=msg.forward_only,
        data=data,
        tokens=token_ends[-1],
        top_ids=list(zip(top_inputs, top_targets, strict=True)),
        input_names=[tuple(datum.loss_fn_inputs) for datum in msg.data],
    )


def decode_to_json(body: bytes, *, max_numbers: int) -> tuple[ForwardBackward, str]:
    """`decode_forward_backward`, with the payload the training process reads already JSON, and the request
    without its `data` (which the JSON holds): made for a process of the gateway's CPU pool, so that what
    comes back is one string to store as it is, not a list of every number to rebuild on the gateway's
    event loop."""
    req = decode_forward_backward(body, max_numbers=max_numbers)
    payload = orjson.dumps(req.payload()).decode()
    req.data = []
    return req, payload


def vocabulary_size(model_dir: Path) -> int | None:
    """The embedding rows and logits the training process has for the model in `model_dir` (its
    `config.json`, read as the training defaults read it); None when it cannot be read."""
    return model_defaults(model_dir).vocab_size

"""The bound on a `forward_backward` body's protocol buffer fields (`MAX_FIELDS`), counted on its raw bytes
before it is parsed: tags and lengths only, one level of the schema at a time, so a body over it (a million
empty chunks, a shape of half a million dimensions) is refused in one pass over its bytes, before anything
is built. The checked decoder (`gateway.tinker.wire_decode`) counts first.
"""

from __future__ import annotations

from typing import Any

from gateway.tinker.wire import WireError

MAX_FIELDS = 8_192
"""Most protocol buffer fields one request may hold, at every depth (`_MESSAGES`): about 540 data of
supervised learning as the SDK encodes them (one chunk, `target_tokens` and `weights`: 15 fields each), 390
of reinforcement learning (with `logprobs` and `advantages`: 21); the SDK sends a larger batch in several
requests (`gateway.tinker.training.chunk_limits`). Parsing and the decoder's walk cost up to a microsecond
or so a field however small it is, so this bounds a request's CPU whatever its body holds; the count is
taken on the raw bytes, before parsing."""

_PACKED = "packed"
"""A repeated number field, counted one value a byte (its most) when packed."""
_MESSAGES: dict[int, Any] = {  # ForwardBackwardRequest
    3: {  # data: Datum
        1: {2: {}},  # model_input: Chunk (its image holds dimensions)
        2: {2: {4: _PACKED}},  # loss_fn_inputs entry -> Tensor (its shape)
        3: {},  # model_input_spans: ProvenanceSpan
        4: {},  # loss_fn_input_spans: ProvenanceSpan
    },
    7: {},  # loss_fn_config_v2 entry
}
"""The messages that hold messages, as field number -> the same for the message it holds: the fields of
these are counted one by one; any other message (encoded_text, sparse_csr, ...) counts as one field."""


def check_fields(body: bytes) -> None:
    """Refuse a body of more than `MAX_FIELDS` fields (or whose framing is broken) before it is parsed."""
    try:
        fields_left(body, MAX_FIELDS)
    except IndexError:
        raise WireError("The body is not a ForwardBackwardRequest: it ends inside a field.") from None


def fields_left(buf: bytes, limit: int) -> int:
    """Count the fields of `buf` against `limit` (how many are left), descending into the messages that
    hold messages; one loop and a stack, not a call a message, so each field costs a few bytecodes."""
    left = limit
    pos, end, schema = 0, len(buf), _MESSAGES
    outer: list[tuple[int, dict[int, Any]]] = []
    while True:
        if pos >= end:
            if pos != end:
                raise IndexError
            if not outer:
                return left
            end, schema = outer.pop()
            continue
        left -= 1
        if left < 0:
            raise _too_many_fields()
        key = buf[pos]  # varints inline where they are one byte (tags, short lengths): the common case
        if key < 0x80:
            pos += 1
        else:
            key, pos = _varint(buf, pos)
        kind = key & 7
        if kind == 2:  # length-delimited: a message, a string, bytes or packed numbers
            size = buf[pos]
            if size < 0x80:
                pos += 1
            elif buf[pos + 1] < 0x80:  # two bytes: lengths under 16 KiB
                size = (size & 0x7F) | buf[pos + 1] << 7
                pos += 2
            else:
                size, pos = _varint(buf, pos)
            if pos + size > end:
                raise IndexError
            inner = schema.get(key >> 3)
            if inner is None or not size:
                pos += size
            elif inner is _PACKED:
                left -= size - 1  # a value a byte at most, the first counted with the tag
                if left < 0:
                    raise _too_many_fields()
                pos += size
            else:  # walk the message's own fields, then go on after it
                outer.append((end, schema))
                end, schema = pos + size, inner
        elif kind == 0:
            _, pos = _varint(buf, pos)
        elif kind in (1, 5):
            pos += 8 if kind == 1 else 4
        else:
            raise WireError(f"The body is not a ForwardBackwardRequest: wire type {kind} at byte {pos}.")


def _too_many_fields() -> WireError:
    return WireError(
        f"The request holds more than {MAX_FIELDS} protocol buffer fields (data, their chunks and "
        "loss_fn_inputs, and what those hold); send its data in smaller forward_backward calls.",
        "data",
    )


def _varint(buf: bytes, pos: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it (IndexError past the end)."""
    byte = buf[pos]
    value, shift = 0, 0
    while byte >= 0x80:
        value |= (byte & 0x7F) << shift
        shift += 7
        if shift > 63:
            raise WireError(f"The body is not a ForwardBackwardRequest: a varint runs on at byte {pos}.")
        pos += 1
        byte = buf[pos]
    return value | byte << shift, pos + 1

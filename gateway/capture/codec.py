"""How a captured call is stored (migration 0021): only what cannot be derived, token ids and logprobs in
binary. `encode` gives a `CapturedRow`'s column values and its `stored_bytes`; `decode` gives the row back
exactly, from a record in either form:

- form 0 (migration 0018, rows written before 0021): every field as JSON, as the row holds it;
- form 1 (compact):
  - `response`: the answer without what the record's columns give back (`id`, `object`, `created`,
    `model`, `system_fingerprint`, `usage`: each left out only when it equals what they give, a bit of
    `derived` saying so). When nothing but `choices` is left, the column holds the choices alone (a JSON
    array) and each choice that is the usual one (index, an assistant message with text and no refusal, no
    logprobs, the record's finish reason) is its text alone;
  - `request`: the body without `model` when it is the record's model, without the settings equal to its
    episode's base (`encode`), and without a first message that repeats the answer of the turn it extends;
  - `segment_break`: without the turn id (`extends` or `previous_id`) that is the record's `previous_id`;
  - `prompt_ids`: the prompt's ids as little-endian unsigned integers of 16 bits (32 when one id needs it),
    after a byte that says which (`bytea`); `completion_ids`: that byte, then per choice its length (a
    varint) and its ids; `logprob_values`: per choice, its length then little-endian float32s (a logprob
    comes back within float32 precision, which is what the engines compute them in). A value that does not
    fit (an id that is not a non-negative integer under 2**32, a logprob that is not a number) keeps its
    JSON column.

`stored_bytes` is what the record keeps of the call: its JSON columns as written plus its binary ones.

Size: over 450 lines, and left whole: the encoder and the decoder of one format, which must agree field by
field, read best side by side.
"""

from __future__ import annotations

import sys
from array import array
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import orjson

FORM_JSON = 0
FORM_COMPACT = 1

JSON_COLUMNS = frozenset(
    (
        "request",
        "response",
        "metadata",
        "prompt_token_ids",
        "completion_token_ids",
        "logprobs",
        "segment_break",
    )
)
BINARY_COLUMNS = ("prompt_ids", "completion_ids", "logprob_values")

ABSENT = "~absent"
"""The key under which a request kept against its episode's base names the settings of the base it lacks (a
request that has this key itself is kept whole)."""
DERIVED_RESPONSE = ("id", "object", "created", "model", "system_fingerprint", "usage")
"""Fields of the answer that the record's columns give back: bit `i` of `derived` for the i-th."""
REQUEST_MODEL = 1 << 6
BREAK_EXTENDS = 1 << 7
BREAK_PREVIOUS = 1 << 8
REQUEST_BASED = 1 << 13
ANSWER_FIRST = 1 << 14
REQUEST_LIST = 1 << 15
"""The request is kept as a JSON array: its other keys, then its messages."""
BREAK_LIST = 1 << 16
"""The segment break is kept as a JSON array of the values of `BREAK_KEYS` (null where it has none)."""
BREAK_KEYS = ("reason", "at_token", "previous_tokens", "previous_id", "extends", "previous_base_model")
CREATED_SHIFT = 9
"""`created` is the record's `created_at` (whole seconds) plus bits 9-12 of `derived`, less 8: an engine
stamps its answer a second or so after the gateway took the request."""
CREATED_OFFSETS = range(-8, 8)


_SCALARS = (str, int, float, bool, type(None))


def _same(a: Any, b: Any) -> bool:
    """Equal as JSON (`1` and `1.0`, `true` and `1` differ)."""
    if type(a) is not type(b):
        return False
    if type(a) in _SCALARS:
        return bool(a == b)
    return bool(orjson.dumps(a, option=orjson.OPT_SORT_KEYS) == orjson.dumps(b, option=orjson.OPT_SORT_KEYS))


def response_fields(
    *,
    id: str,
    model: str,
    served_version: str,
    created_at: datetime,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """What a record's columns say of its answer's `DERIVED_RESPONSE` fields."""
    return {
        "id": id,
        "object": "chat.completion",
        "created": int(created_at.timestamp()),
        "model": model,
        "system_fingerprint": served_version,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def usual_choice(index: int, content: str, finish_reason: str | None) -> dict[str, Any]:
    """A choice as an answer of plain text gives it."""
    return {
        "index": index,
        "message": {"role": "assistant", "content": content, "refusal": None},
        "logprobs": None,
        "finish_reason": finish_reason,
    }


# ---- binary ----------------------------------------------------------------------------------------------
# Token ids as little-endian unsigned integers of one width (a first byte: 2 when every id fits 16 bits, else
# 4), logprobs as little-endian float32; a list of lists is each list's length (a varint) and then its values.
# `array` packs and unpacks them in C: the writer encodes on the gateway's event loop.
_LITTLE = sys.byteorder == "little"


def _count(n: int) -> bytes:
    """A length as an unsigned LEB128 varint."""
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def _read_count(data: bytes, i: int) -> tuple[int, int]:
    """The varint at `i`, and the offset after it."""
    n = shift = 0
    while True:
        byte = data[i]
        i += 1
        n |= (byte & 0x7F) << shift
        if byte < 0x80:
            return n, i
        shift += 7


def _bytes(values: array[Any]) -> bytes:
    if not _LITTLE:
        values.byteswap()
    return values.tobytes()


def _values(typecode: str, data: bytes | memoryview) -> list[Any]:
    values = array(typecode)
    values.frombytes(data)
    if not _LITTLE:
        values.byteswap()
    return values.tolist()


def _id_array(ids: Any, wide: bool) -> array[int] | None:
    """`ids` as an array of the width, or None when they are not all non-negative integers that fit."""
    try:
        return array("I" if wide else "H", ids)
    except (TypeError, OverflowError):
        return None


def _wide(lists: list[Any]) -> bool:
    try:
        return any(ids and max(ids) > 0xFFFF for ids in lists)
    except TypeError:
        return False


def pack_ids(ids: list[int]) -> bytes | None:
    """The ids packed, or None when they are not token ids (a list of non-negative integers under 2**32)."""
    if not isinstance(ids, list):
        return None
    wide = _wide([ids])
    packed = _id_array(ids, wide)
    return None if packed is None else bytes([4 if wide else 2]) + _bytes(packed)


def unpack_ids(data: bytes) -> list[int]:
    return _values("I" if data[0] == 4 else "H", memoryview(data)[1:]) if data else []


def pack_id_lists(lists: list[list[int]]) -> bytes | None:
    if not isinstance(lists, list) or not all(isinstance(ids, list) for ids in lists):
        return None
    wide = _wide(lists)
    out = bytearray([4 if wide else 2])
    for ids in lists:
        packed = _id_array(ids, wide)
        if packed is None:
            return None
        out += _count(len(ids)) + _bytes(packed)
    return bytes(out)


def unpack_id_lists(data: bytes) -> list[list[int]]:
    out: list[list[int]] = []
    view = memoryview(data)
    code, width = ("I", 4) if data and data[0] == 4 else ("H", 2)
    i = 1
    while i < len(data):
        n, i = _read_count(data, i)
        out.append(_values(code, view[i : i + n * width]))
        i += n * width
    return out


def pack_float_lists(lists: list[list[float]]) -> bytes | None:
    """Logprobs packed as float32, or None when they are not lists of finite numbers of float32's range."""
    if not isinstance(lists, list):
        return None
    out = bytearray()
    for values in lists:
        if not isinstance(values, list) or any(type(v) is bool for v in values):
            return None
        try:
            packed = array("f", values)
        except (TypeError, OverflowError):
            return None
        out += _count(len(values)) + _bytes(packed)
    return bytes(out)


def unpack_float_lists(data: bytes) -> list[list[float]]:
    out: list[list[float]] = []
    view = memoryview(data)
    i = 0
    while i < len(data):
        n, i = _read_count(data, i)
        out.append(_values("f", view[i : i + 4 * n]))
        i += 4 * n
    return out


# ---- a record -------------------------------------------------------------------------------------------
def settings_of(request: dict[str, Any]) -> dict[str, Any]:
    """A request's settings: all of it but its messages and model (an episode's base is its first call's)."""
    return {k: v for k, v in request.items() if k not in ("messages", "model")}


def answer_of(response: Any) -> str | None:
    """The text of choice 0's message, from an answer whole or as form 1 stores it (None: no text)."""
    choices = response if isinstance(response, list) else response.get("choices")
    first = choices[0] if isinstance(choices, list) and choices else None
    if isinstance(first, str):
        return first
    message = first.get("message") if isinstance(first, dict) else None
    content = message.get("content") if isinstance(message, dict) else None
    return content if isinstance(content, str) else None


def _is_answer(message: Any, answer: str) -> bool:
    """Whether `message` is `{"role": "assistant", "content": answer}`."""
    return (
        type(message) is dict
        and len(message) == 2
        and message.get("role") == "assistant"
        and type(message.get("content")) is str
        and message["content"] == answer
    )


def encode(
    row: Any, *, base: dict[str, Any] | None = None, previous_answer: str | None = None
) -> tuple[dict[str, Any], int]:
    """The column values of a `CapturedRow` in form 1 (JSON columns as text) and the bytes they store.

    `base`: the settings of its episode's base (`settings_of` its first call, kept once per episode in
    `capture_request_bases`): the request keeps only the settings that differ from it (and the names of
    those it lacks). `previous_answer`: the text the turn it extends (`previous_id`) answered: when its
    messages after that turn's begin with that answer, as an assistant message, that message is not kept."""
    values: dict[str, Any] = {}
    derived = 0
    request = row.request
    if "model" in request and _same(request["model"], row.model):
        request = {k: v for k, v in request.items() if k != "model"}
        derived |= REQUEST_MODEL
    if base is not None and ABSENT not in request:
        absent = [k for k in base if k not in request and k not in ("messages", "model")]
        request = {k: v for k, v in request.items() if k not in base or not _same(v, base[k])}
        if absent:
            request[ABSENT] = absent
        derived |= REQUEST_BASED
    messages = request.get("messages")
    if (
        previous_answer is not None
        and row.previous_id is not None
        and row.messages_prefix > 0
        and isinstance(messages, list)
        and messages
        and _is_answer(messages[0], previous_answer)
    ):
        request = {**request, "messages": messages[1:]}
        derived |= ANSWER_FIRST
    if isinstance(request.get("messages"), list):
        request = [{k: v for k, v in request.items() if k != "messages"}, *request["messages"]]
        derived |= REQUEST_LIST
    response: Any = dict(row.response)
    given = response_fields(
        id=row.id,
        model=row.model,
        served_version=row.served_version,
        created_at=row.created_at,
        prompt_tokens=row.prompt_tokens,
        completion_tokens=row.completion_tokens,
    )
    created = response.get("created")
    if type(created) is int and created - given["created"] in CREATED_OFFSETS:
        derived |= (created - given["created"] - CREATED_OFFSETS.start) << CREATED_SHIFT
        given["created"] = created
    for bit, name in enumerate(DERIVED_RESPONSE):
        if name in response and _same(response[name], given[name]):
            del response[name]
            derived |= 1 << bit
    choices = response.get("choices")
    if set(response) == {"choices"} and isinstance(choices, list):
        response = [_compact_choice(i, c, row.finish_reason) for i, c in enumerate(choices)]
    brk = row.segment_break
    if brk is not None and row.previous_id is not None:
        if brk.get("extends") == row.previous_id:
            brk = {k: v for k, v in brk.items() if k != "extends"}
            derived |= BREAK_EXTENDS
        elif brk.get("previous_id") == row.previous_id:
            brk = {k: v for k, v in brk.items() if k != "previous_id"}
            derived |= BREAK_PREVIOUS
    if brk is not None and set(brk) <= set(BREAK_KEYS) and None not in brk.values():
        brk = [brk.get(k) for k in BREAK_KEYS]
        while brk and brk[-1] is None:
            brk.pop()
        derived |= BREAK_LIST
    json_values = {
        "request": request,
        "response": response,
        "metadata": row.metadata,
        "segment_break": brk,
        "prompt_token_ids": None,
        "completion_token_ids": None,
        "logprobs": None,
    }
    binary: dict[str, bytes | None] = dict.fromkeys(BINARY_COLUMNS)
    if row.prompt_token_ids is not None:
        binary["prompt_ids"] = pack_ids(row.prompt_token_ids)
        if binary["prompt_ids"] is None:
            json_values["prompt_token_ids"] = row.prompt_token_ids
    if row.completion_token_ids is not None:
        binary["completion_ids"] = pack_id_lists(row.completion_token_ids)
        if binary["completion_ids"] is None:
            json_values["completion_token_ids"] = row.completion_token_ids
    if row.logprobs is not None:
        binary["logprob_values"] = pack_float_lists(row.logprobs)
        if binary["logprob_values"] is None:
            json_values["logprobs"] = row.logprobs
    size = 0
    for name, value in json_values.items():
        if value is not None:
            text = orjson.dumps(value)
            size += len(text)
            values[name] = text.decode()
        else:
            values[name] = None
    for name, data in binary.items():
        size += len(data or b"")
        values[name] = data
    values["form"] = FORM_COMPACT
    values["derived"] = derived
    return values, size


_USUAL_CHOICE = frozenset(("index", "message", "logprobs", "finish_reason"))
_USUAL_MESSAGE = frozenset(("role", "content", "refusal"))


def _compact_choice(index: int, choice: Any, finish_reason: str | None) -> Any:
    """The choice's text when it is `usual_choice(index, text, finish_reason)`, else the choice."""
    if type(choice) is dict and choice.keys() == _USUAL_CHOICE:
        message = choice["message"]
        if (
            type(message) is dict
            and message.keys() == _USUAL_MESSAGE
            and type(message["content"]) is str
            and message["role"] == "assistant"
            and message["refusal"] is None
            and choice["logprobs"] is None
            and type(choice["index"]) is int
            and choice["index"] == index
            and _same(choice["finish_reason"], finish_reason)
        ):
            return message["content"]
    return choice


def decode(record: Mapping[str, Any]) -> dict[str, Any]:
    """The fields of a `CapturedRow` from a record of either form."""
    fields = dict(record)
    if fields.get("form", FORM_JSON) == FORM_JSON:
        return fields
    derived = int(fields["derived"])
    request = fields["request"]
    if derived & REQUEST_LIST:
        request = {**request[0], "messages": request[1:]}
    else:
        request = dict(request)
    if derived & ANSWER_FIRST:
        previous = fields.get("previous_response")
        answer = answer_of(previous) if previous is not None else None
        if answer is not None:  # the turn it extends is gone: the message goes with it
            request["messages"] = [{"role": "assistant", "content": answer}, *request["messages"]]
    if derived & REQUEST_BASED:
        absent = request.pop(ABSENT, [])
        base = fields.get("request_base") or {}
        request = {**{k: v for k, v in base.items() if k not in absent}, **request}
    if derived & REQUEST_MODEL:
        request = {**request, "model": fields["model"]}
    stored = fields["response"]
    if isinstance(stored, list):
        stored = {
            "choices": [
                usual_choice(i, c, fields["finish_reason"]) if isinstance(c, str) else c
                for i, c in enumerate(stored)
            ]
        }
    given = response_fields(
        id=fields["id"],
        model=fields["model"],
        served_version=fields["served_version"],
        created_at=fields["created_at"],
        prompt_tokens=fields["prompt_tokens"],
        completion_tokens=fields["completion_tokens"],
    )
    given["created"] += (derived >> CREATED_SHIFT & 0xF) + CREATED_OFFSETS.start
    response = {name: given[name] for bit, name in enumerate(DERIVED_RESPONSE) if derived & (1 << bit)}
    response.update(stored)
    brk = fields["segment_break"]
    if brk is not None and derived & BREAK_LIST:
        brk = {k: v for k, v in zip(BREAK_KEYS, brk, strict=False) if v is not None}
    if brk is not None and derived & BREAK_EXTENDS:
        brk = {**brk, "extends": fields["previous_id"]}
    elif brk is not None and derived & BREAK_PREVIOUS:
        brk = {**brk, "previous_id": fields["previous_id"]}
    fields.update(request=request, response=response, segment_break=brk)
    if fields["prompt_ids"] is not None:
        fields["prompt_token_ids"] = unpack_ids(fields["prompt_ids"])
    if fields["completion_ids"] is not None:
        fields["completion_token_ids"] = unpack_id_lists(fields["completion_ids"])
    if fields["logprob_values"] is not None:
        fields["logprobs"] = unpack_float_lists(fields["logprob_values"])
    return fields

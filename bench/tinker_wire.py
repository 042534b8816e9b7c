"""Tinker wire: the CPU a malformed `forward_backward` costs before its 400, whatever its declared shape.

Each case is one body the decoder (`gateway.tinker.wire_decode.decode_forward_backward`) refuses: hostile
sparse shapes that would expand to millions or 2**124 numbers from a few dozen bytes, a bad column index, and
the worst places for a bad value: NaN at the end of a body near the size cap (2 MiB), or in the last of the
most data one request may carry; then bodies over the bound on protocol buffer fields (many tiny data, a
million empty chunks, a shape of half a million dimensions), refused before they are parsed. Two
well-formed bodies are decoded too, for reference (an accepted request pays for its numbers becoming
lists), and bodies refused at their first byte show what a body of each size costs the gateway before the
decoder reads it (receiving it, the request around it).

Measured twice: the decoder alone in this process (thread CPU time of one call, median and largest of
many), and through a running gateway (`python -m tunegate gateway`, pinned to a core): the CPU time of the
gateway process and its pool processes (from /proc; bodies over 4 KiB are decoded in the pool) over many
requests of the case on one kept-alive connection, divided by their number, so it includes the HTTP,
authentication and error envelope around the decoder. Every answer is checked to be the 400 naming the
expected field.
"""

from __future__ import annotations

import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from bench.common import Options, cores, fmt, tree_cpu_seconds
from bench.stack import make_tenant, rig
from gateway.tinker import wire, wire_decode, wire_fields

BODY_CAP = 2 * 1024 * 1024
FLOAT32, INT64 = 1, 2
BUDGET = BODY_CAP // 2  # the gateway's default bound on the numbers of one request


def _request(data: list[tuple[np.ndarray[Any, Any], dict[str, Any]]]) -> bytes:
    """A `ForwardBackwardRequest` of `(tokens, {name: tensor message})` data."""
    msg = wire.ForwardBackwardRequest(model_id="bench:train:0", seq_id=1, loss_fn="cross_entropy")
    for tokens, inputs in data:
        datum = msg.data.add()
        datum.model_input.add().encoded_text.tokens = tokens.astype(np.int32).tobytes()
        for name, tensor in inputs.items():
            datum.loss_fn_inputs[name].CopyFrom(tensor)
    return bytes(msg.SerializeToString())


def _dense(values: np.ndarray[Any, Any], dtype: int) -> Any:
    tensor = wire.ForwardBackwardRequest().data.add().loss_fn_inputs["x"]
    tensor.dtype = dtype
    tensor.dense = values.astype(np.float32 if dtype == FLOAT32 else np.int64).tobytes()
    return tensor


def _csr(shape: list[int], crow: list[int], col: list[int], values: list[float], dtype: int = FLOAT32) -> Any:
    tensor = wire.ForwardBackwardRequest().data.add().loss_fn_inputs["x"]
    tensor.dtype = dtype
    tensor.shape.extend(shape)
    tensor.sparse_csr.crow_indices = np.asarray(crow, dtype=np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.asarray(col, dtype=np.int64).tobytes()
    tensor.sparse_csr.values = np.asarray(
        values, dtype=np.float32 if dtype == FLOAT32 else np.int64
    ).tobytes()
    return tensor


def _datum(n: int, nan: bool = False) -> tuple[np.ndarray[Any, Any], dict[str, Any]]:
    """`n` tokens with targets and weights; the last weight NaN when `nan`."""
    tokens = np.arange(1, n + 1) % 1000 + 1
    weights = np.ones(n, dtype=np.float32)
    if nan:
        weights[-1] = np.nan
    return tokens, {"target_tokens": _dense(tokens, INT64), "weights": _dense(weights, FLOAT32)}


def _many(count: int, tokens: int, nan_last: bool) -> bytes:
    return _request([_datum(tokens, nan_last and i == count - 1) for i in range(count)])


def _hostile(side: int) -> bytes:
    return _request([(np.ones(1), {"target_tokens": _csr([side, side], [0, 0], [], [], INT64)})])


def _empty_chunks(count: int) -> bytes:
    """One datum of `count` empty model_input chunks (two bytes each): the most messages a body can hold."""
    inner = b"\x0a\x00" * count
    size = bytearray()
    n = len(inner)
    while n >= 0x80:
        size.append(n & 0x7F | 0x80)
        n >>= 7
    size.append(n)
    return b"\x1a" + bytes(size) + inner


def _wide_shape(dims: int) -> bytes:
    tensor = _dense(np.ones(1), INT64)
    tensor.shape.extend([1] * dims)
    return _request([(np.ones(1), {"target_tokens": tensor})])


TENSOR, BOUND, ACCEPTED, FLOOR = "tensor", "bound", "accepted", "floor"
"""What a case shows: a malformed tensor (any declared shape, indexes, values); a body over the bound on
fields (the most messages a request may hold, whatever they declare); a well-formed reference; what a body
of its size costs the gateway before the decoder reads it."""


def cases() -> dict[str, tuple[bytes, str | None, str]]:
    """name -> (body, the field its 400 names or None, what it shows)."""
    big = (BODY_CAP - 1024) // 16  # one datum filling the body cap: 4 + 8 + 4 bytes a token
    weights = "data[0].loss_fn_inputs.weights"
    most = (wire_fields.MAX_FIELDS - 3) // 13  # the most data of 13 fields (as here) one request may hold
    last = f"data[{most - 1}].loss_fn_inputs.weights"
    bad_column = {"target_tokens": _dense(np.ones(4), INT64), "weights": _csr([1, 4], [0, 1], [9], [1.0])}
    return {
        "sparse 3000 x 3000 declared": (_hostile(3000), "data[0].loss_fn_inputs.target_tokens", TENSOR),
        "sparse 2**62 x 2**62 declared": (_hostile(2**62), "data[0].loss_fn_inputs.target_tokens", TENSOR),
        "sparse column out of range": (_request([(np.ones(4), bad_column)]), weights, TENSOR),
        f"NaN last, 1 datum of {big:,} tokens": (_request([_datum(big, nan=True)]), weights, TENSOR),
        f"NaN last, {most} data of 1 token": (_many(most, 1, True), last, TENSOR),
        f"NaN last, {most} data of 150 tokens": (_many(most, 150, True), last, TENSOR),
        f"{32_000:,} data of 1 token": (_many(32_000, 1, False), "data", BOUND),
        f"{1_000_000:,} empty chunks": (_empty_chunks(1_000_000), "data", BOUND),
        f"a shape of {500_000:,} dimensions": (_wide_shape(500_000), "data", BOUND),
        f"well-formed: 1 datum of {big:,} tokens": (_request([_datum(big)]), None, ACCEPTED),
        f"well-formed: {most} data of 150 tokens": (_many(most, 150, False), None, ACCEPTED),
    }


def floors() -> dict[str, tuple[bytes, str | None, str]]:
    """Bodies refused at their first byte (wire type 3, which the decoder does not take), by size."""
    return {
        f"refused at its first byte, {size:,} bytes": (b"\x0b" + bytes(size - 1), None, FLOOR)
        for size in (3, 1024 * 1024, BODY_CAP - 1024)
    }


def _decode(body: bytes) -> str | None:
    """The field the decoder names in its refusal, None when it accepts the body."""
    try:
        wire_decode.decode_forward_backward(body, max_numbers=BUDGET)
    except wire.WireError as exc:
        return exc.param
    return None


def _thread_cpu(fn: Callable[[], object], rounds: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(rounds):
        t0 = time.thread_time()
        fn()
        times.append((time.thread_time() - t0) * 1000)
    return times


def in_process(rounds: int) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name, (body, param, kind) in cases().items():
        got = _decode(body)
        assert got == param, (name, got, param)
        times = _thread_cpu(lambda body=body: _decode(body), rounds)  # type: ignore[misc]
        out[name] = {"bytes": len(body), "param": param, "kind": kind, "median_ms": statistics.median(times),
                     "max_ms": max(times)}  # fmt: skip
    return out


def through_gateway(opts: Options, requests: int) -> dict[str, Any]:
    server_core, _ = cores()
    out: dict[str, Any] = {}
    refused = {**floors(), **{n: c for n, c in cases().items() if c[2] != ACCEPTED}}
    with rig(opts.workdir / "tinker_wire", server_core, None) as r:
        _, key = make_tenant(r.url, r.settings)
        headers = {"X-API-Key": "tml-" + key, "Content-Type": "application/x-protobuf"}
        with httpx.Client(base_url=f"{r.url}/api/v1", headers=headers, timeout=60, trust_env=False) as http:
            for name, (body, param, kind) in refused.items():
                answer = http.post("/forward_backward", content=body)  # warm-up, and the check
                error = answer.json()["error"]
                assert answer.status_code == 400 and error["param"] == param, (name, answer.text[:300])
                before = tree_cpu_seconds(r.gateway.pid)
                for _ in range(requests):
                    http.post("/forward_backward", content=body)
                spent = tree_cpu_seconds(r.gateway.pid) - before
                out[name] = {"bytes": len(body), "param": param, "kind": kind,
                             "cpu_ms_per_request": spent * 1000 / requests}  # fmt: skip
    return out


def _worst(rows: dict[str, Any], kind: str, key: str) -> float:
    return max((row[key] for row in rows.values() if row["kind"] == kind), default=math.nan)


def run(opts: Options) -> dict[str, Any]:
    rounds, requests = (5, 20) if opts.quick else (51, 200)
    load_before = os.getloadavg()[0]
    decoder = in_process(rounds)
    gateway = through_gateway(opts, requests)
    return {
        "rounds": rounds,
        "requests": requests,
        "load_average": [load_before, os.getloadavg()[0]],
        "max_fields": wire_fields.MAX_FIELDS,
        "decoder": decoder,
        "gateway": gateway,
        "worst_ms": {
            kind: {
                "decoder": _worst(decoder, kind, "max_ms"),
                "gateway": _worst(gateway, kind, "cpu_ms_per_request"),
            }
            for kind in (TENSOR, BOUND)
        },
    }


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        "Gateway CPU to refuse a malformed `forward_backward` with a 400 naming the field: the decoder alone "
        f"(thread CPU, median and largest of {report['rounds']}) and the gateway with its pool processes per "
        f"request (their CPU over {report['requests']} requests of the case, HTTP and authentication "
        "included). Load "
        f"average {report['load_average'][0]:.1f} before, {report['load_average'][1]:.1f} after.",
        "",
        "| body | bytes | field named | decoder median / max (ms) | gateway per request (ms) |",
        "|---|---|---|---|---|",
    ]
    decoder, gateway = report["decoder"], report["gateway"]
    for name in [*[n for n in gateway if n not in decoder], *decoder]:
        row = decoder.get(name) or gateway[name]
        decoded = f"{fmt(row['median_ms'])} / {fmt(row['max_ms'])}" if name in decoder else "-"
        through = fmt(gateway[name]["cpu_ms_per_request"]) if name in gateway else "-"
        field = (
            f"`{row['param']}`" if row["param"] else ("(accepted)" if row["kind"] == ACCEPTED else "(body)")
        )
        lines.append(f"| {name} | {row['bytes']:,} | {field} | {decoded} | {through} |")
    tensor, bound = report["worst_ms"][TENSOR], report["worst_ms"][BOUND]
    lines += [
        "",
        f"Malformed tensors, whatever their declared shape: at most {fmt(tensor['decoder'])} ms in the "
        f"decoder, {fmt(tensor['gateway'])} ms a request in the gateway (under 10 ms: "
        f"{tensor['gateway'] < 10}). Bodies over the bound on fields ({report['max_fields']:,}), refused "
        f"before they are parsed: at most {fmt(bound['decoder'])} ms in the decoder, "
        f"{fmt(bound['gateway'])} ms a request in the gateway.",
    ]
    return lines


if __name__ == "__main__":
    print("\n".join(markdown(run(Options(quick="--quick" in sys.argv)))))

"""Tinker's binary wire format: `forward_backward` requests arrive, and its results and samples leave, as
protocol buffers (`application/x-protobuf`) of the schema `tinker_public.proto`.

The schema is the file descriptor the official SDK ships (Apache-2.0), kept here base64-encoded and
loaded into a pool of this module's own, so a process that also imports the SDK keeps two independent
copies. This module holds the messages and the answers the SDK decodes (`encode_forward_output`,
`encode_samples`); a request is bounded on its raw bytes by `gateway.tinker.wire_fields`, then decoded
and checked by `gateway.tinker.wire_decode`, each refusal a `WireError` naming the field.
"""

from __future__ import annotations

import base64
from typing import Any

import numpy as np
from google.protobuf import descriptor_pool, message_factory

_SCHEMA = base64.b64decode(
    "ChN0aW5rZXJfcHVibGljLnByb3RvEg10aW5rZXJfcHVibGljIpwDCg5TYW1wbGVSZXNwb25zZRIxCglzZXF1ZW5jZXMYASAD"
    "KAsyHi50aW5rZXJfcHVibGljLlNhbXBsZWRTZXF1ZW5jZRIcCg9wcm9tcHRfbG9ncHJvYnMYAiABKAxIAIgBARI+ChR0b3Br"
    "X3Byb21wdF9sb2dwcm9icxgDIAEoCzIbLnRpbmtlcl9wdWJsaWMuVG9wa0xvZ3Byb2JzSAGIAQESHwoXcHJvbXB0X2NhY2hl"
    "X2hpdF90b2tlbnMYBCABKAUSOgoWdGFyZ2V0X3Byb21wdF9sb2dwcm9icxgFIAEoCzIVLnRpbmtlcl9wdWJsaWMuVGVuc29y"
    "SAKIAQESPgoRcHJvbXB0X2FsdF90b2tlbnMYBiABKAsyHi50aW5rZXJfcHVibGljLlByb21wdEFsdFRva2Vuc0gDiAEBQhIK"
    "EF9wcm9tcHRfbG9ncHJvYnNCFwoVX3RvcGtfcHJvbXB0X2xvZ3Byb2JzQhkKF190YXJnZXRfcHJvbXB0X2xvZ3Byb2JzQhQK"
    "El9wcm9tcHRfYWx0X3Rva2VucyJhCg9Qcm9tcHRBbHRUb2tlbnMSJQoGdG9rZW5zGAEgASgLMhUudGlua2VyX3B1YmxpYy5U"
    "ZW5zb3ISJwoIbG9ncHJvYnMYAiABKAsyFS50aW5rZXJfcHVibGljLlRlbnNvciLQAQoPU2FtcGxlZFNlcXVlbmNlEi4KC3N0"
    "b3BfcmVhc29uGAEgASgOMhkudGlua2VyX3B1YmxpYy5TdG9wUmVhc29uEg4KBnRva2VucxgCIAEoDBIVCghsb2dwcm9icxgD"
    "IAEoDEgAiAEBEj8KFXRvcGtfc2FtcGxlZF9sb2dwcm9icxgEIAEoCzIbLnRpbmtlcl9wdWJsaWMuVG9wa0xvZ3Byb2JzSAGI"
    "AQFCCwoJX2xvZ3Byb2JzQhgKFl90b3BrX3NhbXBsZWRfbG9ncHJvYnMiTgoMVG9wa0xvZ3Byb2JzEhEKCXRva2VuX2lkcxgB"
    "IAEoDBIQCghsb2dwcm9icxgCIAEoDBIJCgFrGAMgASgNEg4KBmxlbmd0aBgEIAEoDSJGCglTcGFyc2VDc3ISDgoGdmFsdWVz"
    "GAEgASgMEhQKDGNyb3dfaW5kaWNlcxgCIAEoDBITCgtjb2xfaW5kaWNlcxgDIAEoDCKJAQoGVGVuc29yEg8KBWRlbnNlGAEg"
    "ASgMSAASLgoKc3BhcnNlX2NzchgCIAEoCzIYLnRpbmtlcl9wdWJsaWMuU3BhcnNlQ3NySAASIwoFZHR5cGUYAyABKA4yFC50"
    "aW5rZXJfcHVibGljLkRUeXBlEg0KBXNoYXBlGAQgAygDQgoKCGVuY29kaW5nImsKDUJhdGNoZWRUZW5zb3ISDAoEZGF0YRgB"
    "IAEoDBIPCgdvZmZzZXRzGAIgASgMEiMKBWR0eXBlGAMgASgOMhQudGlua2VyX3B1YmxpYy5EVHlwZRIWCg50cmFpbGluZ19z"
    "aGFwZRgEIAMoAyK4AQoLQXJyYXlSZWNvcmQSEAoIdHlwZV90YWcYASABKAkSNgoGZmllbGRzGAIgAygLMiYudGlua2VyX3B1"
    "YmxpYy5BcnJheVJlY29yZC5GaWVsZHNFbnRyeRISCgpudW1fZGF0dW1zGAMgASgDGksKC0ZpZWxkc0VudHJ5EgsKA2tleRgB"
    "IAEoCRIrCgV2YWx1ZRgCIAEoCzIcLnRpbmtlcl9wdWJsaWMuQmF0Y2hlZFRlbnNvcjoCOAEi3QEKFUZvcndhcmRCYWNrd2Fy"
    "ZE91dHB1dBIbChNsb3NzX2ZuX291dHB1dF90eXBlGAEgASgJEjMKD2xvc3NfZm5fb3V0cHV0cxgCIAMoCzIaLnRpbmtlcl9w"
    "dWJsaWMuQXJyYXlSZWNvcmQSQgoHbWV0cmljcxgDIAMoCzIxLnRpbmtlcl9wdWJsaWMuRm9yd2FyZEJhY2t3YXJkT3V0cHV0"
    "Lk1ldHJpY3NFbnRyeRouCgxNZXRyaWNzRW50cnkSCwoDa2V5GAEgASgJEg0KBXZhbHVlGAIgASgBOgI4ASK4AwoWRm9yd2Fy"
    "ZEJhY2t3YXJkUmVxdWVzdBIQCghtb2RlbF9pZBgBIAEoCRIOCgZzZXFfaWQYAiABKAUSIgoEZGF0YRgDIAMoCzIULnRpbmtl"
    "cl9wdWJsaWMuRGF0dW0SDwoHbG9zc19mbhgEIAEoCRJPCg5sb3NzX2ZuX2NvbmZpZxgFIAMoCzI3LnRpbmtlcl9wdWJsaWMu"
    "Rm9yd2FyZEJhY2t3YXJkUmVxdWVzdC5Mb3NzRm5Db25maWdFbnRyeRIUCgxmb3J3YXJkX29ubHkYBiABKAgSVAoRbG9zc19m"
    "bl9jb25maWdfdjIYByADKAsyOS50aW5rZXJfcHVibGljLkZvcndhcmRCYWNrd2FyZFJlcXVlc3QuTG9zc0ZuQ29uZmlnVjJF"
    "bnRyeRozChFMb3NzRm5Db25maWdFbnRyeRILCgNrZXkYASABKAkSDQoFdmFsdWUYAiABKAE6AjgBGlUKE0xvc3NGbkNvbmZp"
    "Z1YyRW50cnkSCwoDa2V5GAEgASgJEi0KBXZhbHVlGAIgASgLMh4udGlua2VyX3B1YmxpYy5Mb3NzQ29uZmlnVmFsdWU6AjgB"
    "IjwKD0xvc3NDb25maWdWYWx1ZRIQCgZudW1iZXIYASABKAFIABIOCgR0ZXh0GAIgASgJSABCBwoFdmFsdWUitAIKBURhdHVt"
    "EikKC21vZGVsX2lucHV0GAEgAygLMhQudGlua2VyX3B1YmxpYy5DaHVuaxI+Cg5sb3NzX2ZuX2lucHV0cxgCIAMoCzImLnRp"
    "bmtlcl9wdWJsaWMuRGF0dW0uTG9zc0ZuSW5wdXRzRW50cnkSOAoRbW9kZWxfaW5wdXRfc3BhbnMYAyADKAsyHS50aW5rZXJf"
    "cHVibGljLlByb3ZlbmFuY2VTcGFuEjoKE2xvc3NfZm5faW5wdXRfc3BhbnMYBCADKAsyHS50aW5rZXJfcHVibGljLlByb3Zl"
    "bmFuY2VTcGFuGkoKEUxvc3NGbklucHV0c0VudHJ5EgsKA2tleRgBIAEoCRIkCgV2YWx1ZRgCIAEoCzIVLnRpbmtlcl9wdWJs"
    "aWMuVGVuc29yOgI4ASKWAQoOUHJvdmVuYW5jZVNwYW4SPAoNcHJvbXB0X3Rva2VucxgBIAEoCzIjLnRpbmtlcl9wdWJsaWMu"
    "UHJvbXB0UHJvdmVuYW5jZVNwYW5IABI+Cg5zYW1wbGVkX3Rva2VucxgCIAEoCzIkLnRpbmtlcl9wdWJsaWMuU2FtcGxlZFBy"
    "b3ZlbmFuY2VTcGFuSABCBgoEc3BhbiJLChRQcm9tcHRQcm92ZW5hbmNlU3BhbhITCgtzZXF1ZW5jZV9pZBgBIAEoCRIOCgZv"
    "ZmZzZXQYAiABKAMSDgoGbGVuZ3RoGAMgASgDIkwKFVNhbXBsZWRQcm92ZW5hbmNlU3BhbhITCgtzZXF1ZW5jZV9pZBgBIAEo"
    "CRIOCgZvZmZzZXQYAiABKAMSDgoGbGVuZ3RoGAMgASgDIp8BCgVDaHVuaxI3CgxlbmNvZGVkX3RleHQYASABKAsyHy50aW5r"
    "ZXJfcHVibGljLkVuY29kZWRUZXh0Q2h1bmtIABIqCgVpbWFnZRgCIAEoCzIZLnRpbmtlcl9wdWJsaWMuSW1hZ2VDaHVua0gA"
    "EigKBGRtZWwYAyABKAsyGC50aW5rZXJfcHVibGljLkRtZWxDaHVua0gAQgcKBWNodW5rIiIKEEVuY29kZWRUZXh0Q2h1bmsS"
    "DgoGdG9rZW5zGAEgASgMIrYBCgpJbWFnZUNodW5rEgwKBGRhdGEYASABKAwSDgoGZm9ybWF0GAIgASgJEhwKD2V4cGVjdGVk"
    "X3Rva2VucxgDIAEoBUgAiAEBEkAKE292ZXJyaWRlX2RpbWVuc2lvbnMYBCABKAsyHi50aW5rZXJfcHVibGljLkltYWdlRGlt"
    "ZW5zaW9uc0gBiAEBQhIKEF9leHBlY3RlZF90b2tlbnNCFgoUX292ZXJyaWRlX2RpbWVuc2lvbnMiMAoPSW1hZ2VEaW1lbnNp"
    "b25zEg0KBXdpZHRoGAEgASgNEg4KBmhlaWdodBgCIAEoDSIZCglEbWVsQ2h1bmsSDAoEZG1lbBgBIAEoDCKlAgoOU2FtcGxp"
    "bmdQYXJhbXMSFwoKbWF4X3Rva2VucxgBIAEoBUgBiAEBEhEKBHNlZWQYAiABKARIAogBARIYCgt0ZW1wZXJhdHVyZRgDIAEo"
    "AkgDiAEBEhIKBXRvcF9rGAQgASgFSASIAQESEgoFdG9wX3AYBSABKAJIBYgBARIvCglzdG9wX3N0cnMYBiABKAsyGi50aW5r"
    "ZXJfcHVibGljLlN0b3BTdHJpbmdzSAASMAoLc3RvcF90b2tlbnMYByABKAsyGS50aW5rZXJfcHVibGljLlN0b3BUb2tlbnNI"
    "AEIGCgRzdG9wQg0KC19tYXhfdG9rZW5zQgcKBV9zZWVkQg4KDF90ZW1wZXJhdHVyZUIICgZfdG9wX2tCCAoGX3RvcF9wIh0K"
    "C1N0b3BTdHJpbmdzEg4KBnZhbHVlcxgBIAMoCSIcCgpTdG9wVG9rZW5zEg4KBnZhbHVlcxgBIAMoBSo6CgpTdG9wUmVhc29u"
    "EhQKEFNUT1BfUkVBU09OX1NUT1AQABIWChJTVE9QX1JFQVNPTl9MRU5HVEgQASpnCgVEVHlwZRIVChFEVFlQRV9VTlNQRUNJ"
    "RklFRBAAEhEKDURUWVBFX0ZMT0FUMzIQARIPCgtEVFlQRV9JTlQ2NBACEg8KC0RUWVBFX0lOVDMyEAMSEgoORFRZUEVfQkZM"
    "T0FUMTYQBGIGcHJvdG8z"
)

_pool = descriptor_pool.DescriptorPool()
_pool.AddSerializedFile(_SCHEMA)


def _message(name: str) -> Any:
    return message_factory.GetMessageClass(_pool.FindMessageTypeByName(f"tinker_public.{name}"))


ForwardBackwardRequest = _message("ForwardBackwardRequest")
ForwardBackwardOutput = _message("ForwardBackwardOutput")
SampleResponse = _message("SampleResponse")

_FLOAT32 = 1  # DTYPE_FLOAT32
STOP_REASON = {"stop": 0, "length": 1}


class WireError(ValueError):
    """A request body that is not a valid `ForwardBackwardRequest`; `param` names the field at fault
    (`data[3].loss_fn_inputs.weights`, `data[0].model_input`), None for the body as a whole."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def encode_forward_output(outputs: list[dict[str, list[float]]], metrics: dict[str, float]) -> bytes:
    """A `ForwardBackwardOutput`: one batched record of each datum's per-token float fields."""
    msg = ForwardBackwardOutput()
    msg.loss_fn_output_type = "ArrayRecord"
    for key, value in metrics.items():
        msg.metrics[key] = float(value)
    record = msg.loss_fn_outputs.add()
    record.type_tag = "ArrayRecord"
    record.num_datums = len(outputs)
    names = list(outputs[0]) if outputs else []
    for name in names:
        arrays = [np.asarray(out[name], dtype=np.float32) for out in outputs]
        offsets = np.cumsum([0] + [a.nbytes for a in arrays]).astype(np.int64)
        field = record.fields[name]
        field.data = b"".join(a.tobytes() for a in arrays)
        field.offsets = offsets.tobytes()
        field.dtype = _FLOAT32
    return bytes(msg.SerializeToString())


def encode_samples(sequences: list[dict[str, Any]], prompt_logprobs: list[float] | None = None) -> bytes:
    """A `SampleResponse`: each sequence's `tokens`, `logprobs` and `stop_reason` (`stop` or `length`)."""
    msg = SampleResponse()
    for seq in sequences:
        out = msg.sequences.add()
        out.stop_reason = STOP_REASON[seq["stop_reason"]]
        out.tokens = np.asarray(seq["tokens"], dtype=np.int32).tobytes()
        if seq.get("logprobs") is not None:
            out.logprobs = np.asarray(seq["logprobs"], dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return bytes(msg.SerializeToString())

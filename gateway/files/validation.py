"""Content checks of uploads, run in a worker thread on the temporary file.

A `fine-tune` file must be UTF-8 JSONL: one JSON object per line, each line within a byte cap and held to
the gateway's JSON rules (`gateway.wire`: no NaN or Infinity, no NUL or unpaired surrogates, 64-bit
integers, bounded nesting). The error names the first bad line. Rows are checked against a method's schema
later, when a job uses the file.
"""

from __future__ import annotations

import codecs
import json
from collections.abc import Iterator
from pathlib import Path

from gateway import wire
from gateway.errors import InvalidRequest

_CHUNK = 1024 * 1024


def iter_lines(path: Path, *, max_line_bytes: int) -> Iterator[tuple[int, bytes]]:
    """`(line_number, raw_line)` for each non-empty line, refusing a line longer than the cap.

    Reads in chunks, so a huge single line is refused after `max_line_bytes`, not held whole.
    """
    lineno = 0
    buf = bytearray()
    with open(path, "rb") as f:
        while True:
            chunk = f.read(_CHUNK)
            if not chunk:
                break
            start = 0
            while True:
                nl = chunk.find(b"\n", start)
                if nl == -1:
                    buf += chunk[start:]
                    if len(buf) > max_line_bytes:
                        raise InvalidRequest(
                            f"Line {lineno + 1} is longer than {max_line_bytes} bytes.",
                            param="file",
                            code="invalid_file_format",
                        )
                    break
                buf += chunk[start:nl]
                lineno += 1
                if len(buf) > max_line_bytes:
                    raise InvalidRequest(
                        f"Line {lineno} is longer than {max_line_bytes} bytes.",
                        param="file",
                        code="invalid_file_format",
                    )
                if buf.strip():
                    yield lineno, bytes(buf)
                buf = bytearray()
                start = nl + 1
    if buf.strip():
        yield lineno + 1, bytes(buf)


def check_jsonl(path: Path, *, max_line_bytes: int, max_depth: int = wire.DEFAULT_MAX_DEPTH) -> int:
    """Check a JSONL upload; returns the number of rows. Raises 400 naming the first bad line."""
    decoder_factory = codecs.getincrementaldecoder("utf-8")
    rows = 0
    for lineno, raw in iter_lines(path, max_line_bytes=max_line_bytes):
        try:
            text = decoder_factory().decode(raw, final=True)
        except UnicodeDecodeError as exc:
            raise InvalidRequest(
                f"Line {lineno} is not valid UTF-8 (byte {exc.start}).",
                param="file",
                code="invalid_file_format",
            ) from exc
        try:
            value = wire.loads(text, max_depth=max_depth)
        except json.JSONDecodeError as exc:
            raise InvalidRequest(
                f"Line {lineno} is not valid JSON: {exc.msg} (column {exc.colno}).",
                param="file",
                code="invalid_file_format",
            ) from exc
        except InvalidRequest as exc:
            raise InvalidRequest(
                f"Line {lineno}: {exc.message}", param="file", code="invalid_file_format"
            ) from None
        if not isinstance(value, dict):
            raise InvalidRequest(
                f"Line {lineno} must be a JSON object, not {type(value).__name__}.",
                param="file",
                code="invalid_file_format",
            )
        rows += 1
    if rows == 0:
        raise InvalidRequest(
            "The file is empty: it must hold at least one JSON line.", param="file", code="empty_file"
        )
    return rows


def read_rows(path: Path, *, max_line_bytes: int) -> Iterator[tuple[int, dict]]:
    """`(line_number, row)` of a JSONL file that `check_jsonl` accepted."""
    for lineno, raw in iter_lines(path, max_line_bytes=max_line_bytes):
        yield lineno, json.loads(raw)

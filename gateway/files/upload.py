"""Streaming multipart uploads: the file part goes straight to a temporary blob, never whole in memory.

The request body is parsed as it arrives; file bytes are counted as they are written, and an upload over the
cap is refused with 413 (the rest of the body is drained, not stored, so the client reads a clean answer).
"""

from __future__ import annotations

import hashlib
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

import anyio
from python_multipart.exceptions import ParseError
from python_multipart.multipart import MultipartParser, parse_options_header

from gateway.errors import InvalidRequest, PayloadTooLarge

MAX_FIELD_BYTES = 64 * 1024
_FLUSH_BYTES = 1024 * 1024


@dataclass
class ReceivedUpload:
    """What a multipart upload carried: small text fields, and the file written to `temp_path`."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    temp_path: Path | None = None
    size: int = 0
    sha256: str = ""


class _Parser:
    def __init__(self, temp_path: Path, max_bytes: int) -> None:
        self.result = ReceivedUpload()
        self._temp_path = temp_path
        self._max = max_bytes
        self._headers: dict[bytes, bytes] = {}
        self._header_field = b""
        self._header_value = b""
        self._name: str | None = None
        self._is_file = False
        self._field_buf = bytearray()
        self._file: BinaryIO | None = None
        self._pending = bytearray()
        self._hash = hashlib.sha256()
        self.too_large = False

    # python-multipart callbacks -------------------------------------------------------------
    def on_part_begin(self) -> None:
        self._headers = {}
        self._field_buf = bytearray()

    def on_header_field(self, data: bytes, start: int, end: int) -> None:
        self._header_field += data[start:end]

    def on_header_value(self, data: bytes, start: int, end: int) -> None:
        self._header_value += data[start:end]

    def on_header_end(self) -> None:
        self._headers[self._header_field.lower()] = self._header_value
        self._header_field = b""
        self._header_value = b""

    def on_headers_finished(self) -> None:
        _, options = parse_options_header(self._headers.get(b"content-disposition", b""))
        self._name = options.get(b"name", b"").decode("latin-1")
        filename = options.get(b"filename")
        self._is_file = filename is not None and self._name == "file"
        if self._is_file:
            assert filename is not None
            if self.result.temp_path is not None:
                raise InvalidRequest("Only one file may be uploaded per request.", param="file")
            self.result.filename = filename.decode("utf-8", "replace")
            self.result.temp_path = self._temp_path
            self._file = open(self._temp_path, "wb")  # noqa: SIM115 - closed in finish()/abort()

    def on_part_data(self, data: bytes, start: int, end: int) -> None:
        chunk = data[start:end]
        if self._is_file:
            self.result.size += len(chunk)
            if self.result.size > self._max:
                self.too_large = True
                return
            self._hash.update(chunk)
            self._pending += chunk
        else:
            self._field_buf += chunk
            if len(self._field_buf) > MAX_FIELD_BYTES:
                raise InvalidRequest(f"Form field '{self._name}' is too long.", param=self._name)

    def on_part_end(self) -> None:
        if not self._is_file and self._name:
            try:
                self.result.fields[self._name] = self._field_buf.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise InvalidRequest(f"Form field '{self._name}' is not UTF-8.", param=self._name) from exc
        self._is_file = False

    # driving ----------------------------------------------------------------------------------
    async def flush(self, force: bool = False) -> None:
        if self._file is not None and self._pending and (force or len(self._pending) >= _FLUSH_BYTES):
            data, self._pending = bytes(self._pending), bytearray()
            await anyio.to_thread.run_sync(self._file.write, data)

    def finish(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self.result.sha256 = self._hash.hexdigest()

    def abort(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        self._temp_path.unlink(missing_ok=True)


async def receive_upload(
    content_type: str | None, body: AsyncIterator[bytes], *, temp_path: Path, max_bytes: int
) -> ReceivedUpload:
    """Parse a multipart body, writing its `file` part to `temp_path`.

    Raises 400 for a body that is not multipart (or not well-formed) or has no file, 413 once the file
    passes `max_bytes`.
    On any error the temporary file is removed.
    """
    ctype, params = parse_options_header(content_type or "")
    boundary = params.get(b"boundary")
    if ctype != b"multipart/form-data" or not boundary:
        raise InvalidRequest("Uploads must be multipart/form-data with a 'file' part.", param="file")
    state = _Parser(temp_path, max_bytes)
    callbacks = {
        "on_part_begin": state.on_part_begin,
        "on_part_data": state.on_part_data,
        "on_part_end": state.on_part_end,
        "on_header_field": state.on_header_field,
        "on_header_value": state.on_header_value,
        "on_header_end": state.on_header_end,
        "on_headers_finished": state.on_headers_finished,
    }
    parser = MultipartParser(boundary, callbacks)  # type: ignore[arg-type]
    try:
        async for chunk in body:
            if state.too_large:
                continue  # drain the rest so the client reads our 413, store nothing more
            parser.write(chunk)
            await state.flush()
        if state.too_large:
            raise PayloadTooLarge(
                f"File is too large: the limit is {max_bytes} bytes.", param="file", code="file_too_large"
            )
        parser.finalize()
        await state.flush(force=True)
        state.finish()
    except ParseError as exc:
        state.abort()
        raise InvalidRequest(
            f"The upload is not a well-formed multipart/form-data body ({exc}).", param="file"
        ) from None
    except BaseException:
        state.abort()
        raise
    if state.result.temp_path is None:
        raise InvalidRequest("Missing the 'file' part of the upload.", param="file")
    return state.result

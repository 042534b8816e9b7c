"""The channel to a sandboxed environment process (:class:`envsdk.sandbox.Sandbox`): one JSON request per
line on its stdin, one JSON answer per line on its stdout, and the tail of its stderr kept for errors.

Lines are encoded with orjson, falling back on the standard library for what orjson refuses (and decoded the
same way round); an answer line longer than ``MAX_LINE`` is cut there (the caller sees a garbled answer).
Reading happens in the calling thread, under the call's deadline; stderr is read by a thread of its own,
which keeps the last ``STDERR_KEEP`` bytes and logs every line at debug level. When the process dies,
:meth:`Channel.died` says why from its exit status and its stderr (out of memory, out of CPU time, a crash).
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from typing import Any

import orjson

from envsdk.errors import SandboxError

logger = logging.getLogger(__name__)

MAX_LINE = 64 * 1024 * 1024
STDERR_KEEP = 16 * 1024
EOF = object()
"""What :meth:`Channel.read_line` returns once the process closed its stdout."""
_STDLIB_ENCODE = json.JSONEncoder(separators=(",", ":")).encode
_ORJSON_OPTIONS = orjson.OPT_NON_STR_KEYS | orjson.OPT_APPEND_NEWLINE


def encode_line(message: Any) -> bytes:
    """One request line. orjson on the host (the batch's encoding is most of a reward call's cost here);
    what it refuses (integers beyond 64 bits, ...) goes through the standard library's encoder."""
    try:
        return orjson.dumps(message, option=_ORJSON_OPTIONS)
    except TypeError:
        return _STDLIB_ENCODE(message).encode() + b"\n"


def decode_line(line: bytes) -> Any:
    """One answer line (the child writes it with the standard library; orjson reads it faster and the
    standard library takes what orjson is stricter about, such as escaped lone surrogates)."""
    try:
        return orjson.loads(line)
    except orjson.JSONDecodeError:
        return json.loads(line)


class Channel:
    """The channel to the started process ``proc`` (see the module); ``name`` names it in the logs."""

    def __init__(self, proc: subprocess.Popen[bytes], name: str) -> None:
        self.proc = proc
        self.name = name
        self._buffer = bytearray()
        self._stderr: collections.deque[bytes] = collections.deque()
        self._stderr_size = 0
        threading.Thread(target=self._read_stderr, daemon=True).start()

    def write(self, message: Any) -> None:
        """Send one request line; raises ``OSError`` (``BrokenPipeError``) when the process is gone."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(encode_line(message))
        self.proc.stdin.flush()

    def read_line(self, deadline: float) -> bytes | object | None:
        """The channel's next line, read in the calling thread: ``None`` when ``deadline`` passes first,
        ``EOF`` when the process closed it, at most ``MAX_LINE`` bytes of a longer line."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        buffer = self._buffer
        start = 0
        while True:
            end = buffer.find(b"\n", start)
            if end >= 0:
                line = bytes(buffer[: end + 1])
                del buffer[: end + 1]
                return line
            if len(buffer) >= MAX_LINE:
                line = bytes(buffer[:MAX_LINE])
                del buffer[:MAX_LINE]
                return line
            start = len(buffer)
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                ready, _, _ = select.select([fd], [], [], remaining)
                if not ready:
                    return None
                chunk = os.read(fd, 1 << 20)
            except (OSError, ValueError):
                return EOF
            if not chunk:
                return EOF
            buffer += chunk

    def _read_stderr(self) -> None:
        stderr = self.proc.stderr
        assert stderr is not None
        try:
            for line in iter(lambda: stderr.readline(8192), b""):
                logger.debug("sandbox[%s] %s", self.name, line.rstrip().decode(errors="replace"))
                self._stderr.append(line)
                self._stderr_size += len(line)
                while self._stderr_size > STDERR_KEEP and len(self._stderr) > 1:
                    self._stderr_size -= len(self._stderr.popleft())
        except (OSError, ValueError):
            pass

    def stderr_tail(self, limit: int = 2000) -> str:
        """The last ``limit`` characters the process wrote to stderr (user prints and tracebacks)."""
        return b"".join(self._stderr).decode(errors="replace")[-limit:]

    def died(self) -> SandboxError:
        """The error that says how the process ended (it did, or is about to: its channel broke)."""
        try:
            rc = self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            rc = None
        time.sleep(0.05)  # let the stderr reader catch the last lines
        tail = self.stderr_tail()
        sig = -rc if rc is not None and rc < 0 else (rc - 128 if rc is not None and rc > 128 else None)
        if "MemoryError" in tail or "Cannot allocate memory" in tail:
            code, what = "memory", "ran out of its memory limit"
        elif sig == signal.SIGXCPU or (sig == signal.SIGKILL and "CPU" in tail):
            code, what = "cpu_limit", "used up its CPU-time limit"
        else:
            code, what = "crashed", f"exited (status {rc})"
        return SandboxError(code, f"environment process {what}; stderr: {tail.strip()[-1000:] or '(empty)'}")

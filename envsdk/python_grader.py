"""OpenAI ``python`` graders, run in the sandbox: ``def grade(sample: dict, item: dict) -> float``.

The grader's ``source`` is untrusted code. It is never imported by the caller: :class:`PythonGrader` writes
it as a tiny environment package (``user_grader.py`` plus a :class:`~envsdk.env.SingleTurnEnv` that calls
``user_grader.grade(sample, item)``) into a temporary directory and runs that package in a
:class:`~envsdk.sandbox.Sandbox`. One sandbox process serves every call of one grader; it is started on
first use and again after a crash or a timeout. :class:`PythonGraders` keeps one per distinct source, so a
training job pays the start-up once.

Failures are data: each call returns ``(reward, error)``; a ``grade`` that raises, returns something that
is not a number, times out or kills its process gives ``(None, "...")``.
"""

from __future__ import annotations

import ast
import hashlib
import logging
import math
import shutil
import threading
from typing import TYPE_CHECKING, Any

from envsdk.errors import SandboxError

if TYPE_CHECKING:
    from envsdk.manifest import Maxima

logger = logging.getLogger(__name__)

GRADER_MODULE = "user_grader"
DEFAULT_TIMEOUT_S = 10.0
"""Wall-clock seconds one ``grade`` batch may take."""
DEFAULT_MEMORY_MB = 512
"""Address-space limit of a python grader's process."""

_HOST_MODULE = '''"""Adapter between the sandbox's reward call and the user's grade(sample, item)."""

import math

import user_grader
from envsdk import SingleTurnEnv


class PythonGraderEnv(SingleTurnEnv):
    def reward(self, task, completion):
        value = float(user_grader.grade(task.get("sample") or {}, task.get("item") or {}))
        if not math.isfinite(value):
            raise ValueError(f"grade() returned {value}")
        return value
'''

_MANIFEST = """name = "python-grader"
version = "0"
entrypoint = "python_grader_env:PythonGraderEnv"

[limits]
timeout_s = {timeout_s}
startup_timeout_s = 30
memory_mb = {memory_mb}
cpu_s = 600
"""


def oversize(source: str, max_bytes: int | None) -> int | None:
    """The size of ``source`` in UTF-8 bytes when it is over ``max_bytes``; else None (also for no cap)."""
    if max_bytes is None or len(source) <= max_bytes // 4:  # a character is 1 to 4 bytes
        return None
    size = len(source.encode("utf-8", "surrogatepass"))
    return size if size > max_bytes else None


def source_problem(source: Any, *, max_bytes: int | None = None, parse: bool = True) -> str | None:
    """Why ``source`` cannot be a python grader (None when it can): it must be a non-empty string of at
    most ``max_bytes`` UTF-8 bytes (None: any size) that parses and defines a top-level ``grade`` function.

    The size is checked before anything is parsed. ``parse=False`` checks the string and its size only:
    ``ast.parse`` holds the interpreter's lock for its whole run (about a second a megabyte), so a shared
    process parses large sources elsewhere (the gateway: in its CPU pool) and skips it here.
    """
    if not isinstance(source, str) or not source.strip():
        return "source must be Python code defining grade(sample, item)"
    size = oversize(source, max_bytes)
    if size is not None:
        return f"source is {size} bytes; python graders are limited to {max_bytes} bytes"
    if not parse:
        return None
    try:
        tree = ast.parse(source)
    except SyntaxError as exc:
        return f"source is not valid Python: line {exc.lineno}: {exc.msg}"
    except (RecursionError, MemoryError, ValueError) as exc:  # nesting the parser gives up on, NUL bytes
        return f"source is not valid Python: {type(exc).__name__}"
    if not any(
        isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and node.name == "grade"
        for node in tree.body
    ):
        return "source must define a top-level function grade(sample, item)"
    return None


def source_problems(sources: list[Any], max_bytes: int | None = None) -> list[str | None]:
    """``source_problem`` of each source, parsed (a picklable batch for a process pool)."""
    return [source_problem(source, max_bytes=max_bytes) for source in sources]


def check_source(source: Any, *, max_bytes: int | None = None, parse: bool = True) -> None:
    """Raise ``ValueError`` with ``source_problem``'s reason unless ``source`` can be a python grader."""
    problem = source_problem(source, max_bytes=max_bytes, parse=parse)
    if problem is not None:
        raise ValueError(problem)


class PythonGrader:
    """One python grader's source in its own sandboxed process (thread-safe; calls are serialised)."""

    def __init__(
        self,
        source: str,
        *,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        memory_mb: int = DEFAULT_MEMORY_MB,
        allow_unsandboxed: bool = False,
        maxima: Maxima | None = None,
    ) -> None:
        from envsdk.sandbox import owned_tempdir

        # Not parsed here: the sandbox's import of the module reports a source that is not Python (as
        # the runtime error of each call), and every caller validated the grader before grading with it.
        check_source(source, parse=False)
        self.source = source
        self.allow_unsandboxed = allow_unsandboxed
        self.maxima = maxima
        self._dir = owned_tempdir("grader")
        self._dir.chmod(0o755)  # the sandbox's own uid reads the package
        (self._dir / f"{GRADER_MODULE}.py").write_text(source, encoding="utf-8")
        (self._dir / "python_grader_env.py").write_text(_HOST_MODULE, encoding="utf-8")
        (self._dir / "environment.toml").write_text(
            _MANIFEST.format(timeout_s=float(timeout_s), memory_mb=int(memory_mb)), encoding="utf-8"
        )
        for path in self._dir.iterdir():
            path.chmod(0o644)
        self._sandbox: Any = None
        self._lock = threading.Lock()

    def _ensure_started(self) -> Any:
        from envsdk.sandbox import Sandbox

        if self._sandbox is None:
            self._sandbox = Sandbox(self._dir, maxima=self.maxima, allow_unsandboxed=self.allow_unsandboxed)
        if not self._sandbox.running:
            self._sandbox.start()
        return self._sandbox

    def grade_batch(
        self, pairs: list[tuple[dict[str, Any], dict[str, Any]]]
    ) -> list[tuple[float | None, str | None]]:
        """Score ``[(sample, item), ...]`` in one sandbox call: ``(reward, None)`` or ``(None, error)``."""
        if not pairs:
            return []
        items = [{"task": {"sample": sample, "item": item}, "completion": ""} for sample, item in pairs]
        with self._lock:
            try:
                sandbox = self._ensure_started()
                results = sandbox.reward_batch(items)
            except SandboxError as exc:
                logger.warning("python grader sandbox failed: %s", exc)
                if self._sandbox is not None:
                    self._sandbox.close()
                return [(None, f"{exc.code}: {exc.message}")] * len(pairs)
        out: list[tuple[float | None, str | None]] = []
        for result in results:
            reward = result.get("reward")
            if result.get("error") or not isinstance(reward, int | float) or not math.isfinite(reward):
                out.append((None, str(result.get("error") or f"grade() returned {reward!r}")))
            else:
                out.append((float(reward), None))
        return out

    def grade(self, sample: dict[str, Any], item: dict[str, Any]) -> tuple[float | None, str | None]:
        """Score one sample against one row."""
        return self.grade_batch([(sample, item)])[0]

    def close(self) -> None:
        """Stop the process and delete the package directory."""
        with self._lock:
            if self._sandbox is not None:
                self._sandbox.close()
                self._sandbox = None
            shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> PythonGrader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PythonGraders:
    """A cache of :class:`PythonGrader` by source, shared by all the graders of a job (or a request);
    ``maxima`` (the operator's) cap each grader's sandbox."""

    def __init__(
        self,
        *,
        allow_unsandboxed: bool = False,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        maxima: Maxima | None = None,
    ) -> None:
        self.allow_unsandboxed = allow_unsandboxed
        self.timeout_s = timeout_s
        self.maxima = maxima
        self._graders: dict[str, PythonGrader] = {}
        self._lock = threading.Lock()

    def get(self, source: str) -> PythonGrader:
        key = hashlib.sha256(source.encode()).hexdigest()
        with self._lock:
            if key not in self._graders:
                self._graders[key] = PythonGrader(
                    source,
                    timeout_s=self.timeout_s,
                    allow_unsandboxed=self.allow_unsandboxed,
                    maxima=self.maxima,
                )
            return self._graders[key]

    def close(self) -> None:
        with self._lock:
            graders, self._graders = list(self._graders.values()), {}
        for grader in graders:
            grader.close()

    def __enter__(self) -> PythonGraders:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

"""The embedded engine's options, in one object.

``EngineOptions`` is what ``inference.server.create_app`` and each ``inference.engine.ModelEngine`` take,
what ``python -m inference``'s flags fill in (``inference.__main__``), and what ``tunegate`` builds from its
``engine_*`` settings (``tunegate.vllm_process.embedded_options``). The defaults are the engine's own.

``FLAGS`` is the one mapping between the options and those flags, one flag a field: ``add_flags`` gives a
parser them, ``EngineOptions.from_flags`` reads them back, and ``EngineOptions.to_flags`` writes the
command line of a process that is to run with these options (``tunegate.role_processes.EngineProcess``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Self

if TYPE_CHECKING:
    import argparse


@dataclass(frozen=True)
class EngineOptions:
    """How each base model of an engine is served (the same for every model of one server)."""

    max_loras: int = 8
    """Adapters resident at once per base model (least recently used ones are evicted over it), and the
    most distinct adapters in one batch (vLLM's ``--max-loras``)."""
    max_batch_size: int = 16
    """Rows (requests times their ``n``) in one batched generation."""
    device: str = "auto"
    """``auto`` (CUDA where torch sees it, else the CPU), ``cpu``, ``cuda``, ``cuda:1``..."""
    batch_window_s: float = 0.005
    """How long the scheduler waits for more requests to join a batch."""
    max_concurrent_batches: int = 4
    """Batches in flight at once per base model, interleaved step by step under the model lock."""
    default_max_tokens: int = 1024
    """``max_tokens`` of a request that names none (cut to what the context leaves)."""
    max_model_len: int | None = None
    """Most tokens of prompt and completion in one request where that is less than the model's own context
    (vLLM's ``--max-model-len``); ``None``: each model's own context."""

    def __post_init__(self) -> None:
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError("max_model_len must be at least 1")

    @classmethod
    def from_flags(cls, args: argparse.Namespace) -> Self:
        """The options a parser given ``add_flags`` read from the command line."""
        return cls(**{flag.field: getattr(args, flag.field) for flag in FLAGS})

    def to_flags(self) -> list[str]:
        """``python -m inference``'s flags for these options (an unset one is left out: its default is
        unset too)."""
        argv: list[str] = []
        for flag in FLAGS:
            value = getattr(self, flag.field)
            if value is not None:
                argv += [flag.name, str(value)]
        return argv


@dataclass(frozen=True)
class Flag:
    """One flag of ``python -m inference``: the ``EngineOptions`` field it sets."""

    field: str
    """The field, whose name with dashes is the flag's (``max_loras``: ``--max-loras``)."""
    parse: type[Any]
    """What the flag's text is parsed as."""
    help: str
    """The flag's help line."""

    @property
    def name(self) -> str:
        """The flag as written on the command line."""
        return "--" + self.field.replace("_", "-")


FLAGS = (
    Flag("max_loras", int, "resident adapters per base model (and distinct ones in a batch)"),
    Flag("max_batch_size", int, "rows in one batched generation"),
    Flag("device", str, "auto, cpu, cuda, cuda:1..."),
    Flag("batch_window_s", float, "how long a batch waits for more requests to join it"),
    Flag("max_concurrent_batches", int, "batches in flight at once per base model"),
    Flag("default_max_tokens", int, "max_tokens of a request that names none"),
    Flag(
        "max_model_len",
        int,
        "most tokens of prompt and completion in one request (default: each model's own context)",
    ),
)
"""Every ``EngineOptions`` field's flag (``tests/inference/test_launch.py`` checks that none is missing)."""


def add_flags(parser: argparse.ArgumentParser) -> None:
    """Give ``parser`` a flag for every option, each defaulting to the engine's own default."""
    defaults = EngineOptions()
    for flag in FLAGS:
        parser.add_argument(flag.name, type=flag.parse, default=getattr(defaults, flag.field), help=flag.help)

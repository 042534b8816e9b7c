"""LoRA adapters on one base model: PEFT loading and unloading, and the LRU bookkeeping.

:class:`LoraHost` owns the model and turns it into a ``PeftModel`` on the first load; every adapter lives
under an internal key (``a1``, ``a2``...) because adapter names such as ``ft:base:org::job`` are not valid
PyTorch module names. Unloading calls ``PeftModel.delete_adapter`` so the adapter's tensors are really
freed, not merely forgotten.

:class:`AdapterRegistry` remembers every adapter the engine was asked to serve (name -> path), which of them
are resident, their least-recently-used order, and which are pinned by running batches and so cannot be
evicted. An adapter evicted under the ``max_loras`` cap stays known: the next request for it reloads it.
"""

from __future__ import annotations

import gc
import itertools
import json
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from inference.errors import BadRequestError

logger = logging.getLogger(__name__)

BASE_ADAPTER = "__base__"
"""PEFT's name for "no adapter" in a mixed-adapter batch."""


@dataclass
class Adapter:
    """One adapter the engine knows."""

    name: str
    """The public model name requests use."""
    path: str
    """Local directory holding ``adapter_config.json`` and the weights."""
    key: str
    """Internal PEFT adapter name."""
    resident: bool = False
    """Loaded into the model right now."""
    pins: int = 0
    """Running batches that use it; a pinned adapter is never evicted or deleted."""
    doomed: bool = False
    """Unloaded by name while pinned: delete the weights when the last pin goes."""
    registered_at: float = field(default_factory=time.time)
    """When `/v1/load_lora_adapter` accepted it (unix seconds); listed in `/v1/models` as `loaded_at`."""


def read_adapter_config(path: str) -> dict[str, Any]:
    """The adapter's ``adapter_config.json``, or a 400 naming ``lora_path``."""
    cfg = Path(path) / "adapter_config.json"
    if not cfg.is_file():
        raise BadRequestError(f"No adapter_config.json found in '{path}'.", param="lora_path")
    try:
        data = json.loads(cfg.read_text())
    except (OSError, ValueError) as exc:
        msg = f"Unreadable adapter_config.json in '{path}': {exc}"
        raise BadRequestError(msg, param="lora_path") from exc
    if not isinstance(data, dict):
        raise BadRequestError(f"adapter_config.json in '{path}' is not an object.", param="lora_path")
    peft_type = data.get("peft_type", "LORA")
    if str(peft_type).upper() != "LORA":
        raise BadRequestError(f"Only LoRA adapters are supported, got {peft_type}.", param="lora_path")
    return data


class AdapterRegistry:
    """Names, paths, residency, LRU order and pins of one base model's adapters (not thread-safe)."""

    def __init__(self, max_loras: int) -> None:
        self.max_loras = max_loras
        self.known: dict[str, Adapter] = {}
        self._lru: OrderedDict[str, None] = OrderedDict()
        self._keys = itertools.count(1)

    def add(self, name: str, path: str) -> Adapter:
        adapter = Adapter(name=name, path=path, key=f"a{next(self._keys)}")
        self.known[name] = adapter
        return adapter

    def get(self, name: str) -> Adapter | None:
        return self.known.get(name)

    def resident(self) -> list[Adapter]:
        """Resident adapters, least recently used first."""
        return [self.known[n] for n in self._lru]

    def mark_resident(self, adapter: Adapter) -> None:
        adapter.resident = True
        self._lru[adapter.name] = None
        self._lru.move_to_end(adapter.name)

    def mark_evicted(self, adapter: Adapter) -> None:
        adapter.resident = False
        self._lru.pop(adapter.name, None)

    def touch(self, name: str) -> None:
        if name in self._lru:
            self._lru.move_to_end(name)

    def forget(self, name: str) -> Adapter | None:
        self._lru.pop(name, None)
        return self.known.pop(name, None)

    def victims(self, incoming: int) -> list[Adapter]:
        """Unpinned resident adapters to evict, oldest first, so ``incoming`` more fit under the cap."""
        excess = len(self._lru) + incoming - self.max_loras
        out: list[Adapter] = []
        for adapter in self.resident():
            if excess <= 0:
                break
            if adapter.pins == 0:
                out.append(adapter)
                excess -= 1
        return out


class LoraHost:
    """A base model plus the LoRA adapters loaded into it through PEFT (callers serialise access)."""

    def __init__(self, base: Any) -> None:
        self.base = base
        self.peft: Any = None
        self.keys: set[str] = set()

    @property
    def model(self) -> Any:
        """What to call for a forward pass."""
        return self.peft if self.peft is not None and self.keys else self.base

    def load(self, key: str, path: str) -> None:
        from peft import PeftModel

        if self.peft is None:
            self.peft = PeftModel.from_pretrained(self.base, path, adapter_name=key, is_trainable=False)
        else:
            self.peft.load_adapter(path, adapter_name=key, is_trainable=False)
        self.peft.eval()
        self.keys.add(key)
        if len(self.keys) == 1:
            self.peft.set_adapter(key)
        logger.info("loaded LoRA adapter %s from %s", key, path)

    def delete(self, key: str) -> None:
        if self.peft is None or key not in self.keys:
            return
        self.keys.discard(key)
        self.peft.delete_adapter(key)
        gc.collect()
        logger.info("deleted LoRA adapter %s", key)

    def parameter_count(self) -> int:
        """Elements in all parameters of the model, adapters included."""
        return sum(p.numel() for p in self.base.parameters())

"""Training on more than one device. The worker starts the trainer under ``accelerate launch`` (torchrun
underneath), which starts one process per device and tells each its ``RANK`` and ``WORLD_SIZE``; TRL and
Transformers then train data-parallel (DDP) or sharded (FSDP) as the launcher configured them.

This module only reads where a process stands and lets the ranks agree on stopping: every rank gets the
stop signal, but not in the same step, and a rank that stops alone leaves the others waiting in their next
collective. Only rank 0 writes events (``trainer.__main__``).
"""

from __future__ import annotations

import os


def rank() -> int:
    """This process's rank (0 when the trainer runs alone)."""
    return int(os.environ.get("RANK", "0"))


def world_size() -> int:
    """Processes training this job together (1 when the trainer runs alone)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def is_main() -> bool:
    """Whether this process reports: rank 0, or the only one."""
    return rank() == 0


def anyone(flag: bool) -> bool:
    """Whether ``flag`` is set in any rank (a collective: every rank must call it at the same point)."""
    if world_size() == 1:
        return flag
    import torch
    from accelerate import PartialState
    from accelerate.utils import reduce

    mine = torch.tensor([1.0 if flag else 0.0], device=PartialState().device)
    return bool(reduce(mine, reduction="sum").item() > 0)

"""What every process a worker starts for its work gets, whatever the work: an environment of its own
(`trainer_env`: what Python, PyTorch, CUDA and Hugging Face read, none of the worker's secrets) and death
with the worker (`die_with_parent`: no orphan trains on after its worker died). Used by a job's trainer and
generation server (`gateway.worker.job`) and by a Tinker model's training process (`gateway.tinker.holder`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
from pathlib import Path

from trainer.contract import INFERENCE_KEY_ENV

_PR_SET_PDEATHSIG = 1

TRAINER_ENV_PASSED = ("PATH", "LANG", "LC_ALL", "TZ", "TMPDIR", "PYTHONPATH", "LD_LIBRARY_PATH")
"""Host variables the trainer gets as they are (with those of `TRAINER_ENV_PREFIXES`)."""
TRAINER_ENV_PREFIXES = (
    "CUDA_",
    "NVIDIA_",
    "HF_",
    "TRANSFORMERS_",
    "TORCH",
    "PYTORCH_",
    "VLLM_",
    "NCCL_",
    "OMP_",
    "MKL_",
    "PIP_",  # pip's configuration, for a trainer that builds its environment package's venv
)


def trainer_env(workdir: Path, inference_key: str | None = None) -> dict[str, str]:
    """The trainer's whole environment: what Python, PyTorch, CUDA and Hugging Face read, and nothing of the
    worker's settings. The trainer reads its spec; the database URL, the admin key and the Stripe key stay in
    the worker. `inference_key`, the job's own key for its model graders, is the one secret it gets here; an
    environment job's trainer also gets its own Redis user for the env servers' pool (`redis_acl`)."""
    env = {
        name: value
        for name, value in os.environ.items()
        if name in TRAINER_ENV_PASSED or name.startswith(TRAINER_ENV_PREFIXES)
    }
    env.setdefault("PATH", "/usr/bin:/bin")
    env.update(PYTHONUNBUFFERED="1", HOME=str(workdir))
    if inference_key is not None:
        env[INFERENCE_KEY_ENV] = inference_key
    return env


def die_with_parent(cpus: set[int] | None = None) -> None:
    """In a child of the worker (a trainer, a generation server): get SIGKILL when the worker dies, so no
    orphan trains on; a session of its own; confined to `cpus` when given."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    os.setsid()
    if cpus:
        with contextlib.suppress(OSError):
            os.sched_setaffinity(0, cpus)

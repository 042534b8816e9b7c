"""The devices a worker trains on, which of them each job holds, and how its trainer is launched on them.

A worker owns devices, not a count: GPUs (by index) or, on a machine without them, CPU processes. A job
asks for `gpus` of them (its hyperparameter; auto by the base model's size) and is claimed only when that
many are free (`DevicePool`). Its trainer sees only its own: `CUDA_VISIBLE_DEVICES` for GPUs, the CPU
cores of its devices (`sched_setaffinity`) for CPU processes.

One device runs `python -m trainer run` as it always did. More run it under `accelerate launch` (torchrun
underneath, one process per device), with the strategy chosen by the model's size: DDP (every device holds
the whole model and a share of each batch) for models up to `DDP_MAX_PARAMETERS`, FSDP (parameters, gradients
and optimiser state sharded across devices) above, since such a model does not fit one device. TRL and
Transformers do the rest; nothing here makes a process group.

A reinforcement job with vLLM in server mode also gets `vllm_server_gpus` devices of its own for
generation: the worker starts `trl vllm-serve` on them (`GenerationServer`) and the trainer on the rest.
"""

from __future__ import annotations

import asyncio
import os
import socket
import sys
from dataclasses import dataclass, field
from typing import Literal

from gateway.settings import Settings
from inference.vllm import gpus_listed

DDP_MAX_PARAMETERS = 8e9
"""Largest model trained data-parallel (DDP); larger ones are sharded with FSDP (docs/training.md)."""

Kind = Literal["cuda", "cpu"]


@dataclass(frozen=True, order=True)
class Device:
    """One device of a worker: a GPU by its index, or a CPU process slot with its share of the cores."""

    kind: Kind
    index: int
    cores: tuple[int, ...] = field(default=(), compare=False)
    """A CPU device's cores: the machine's cores split evenly among the worker's CPU devices."""

    def __str__(self) -> str:
        return f"{self.kind}:{self.index}"


def parse_devices(text: str, *, cpu_slots: int, gpus: int | None = None) -> list[Device]:
    """The devices a `devices` setting names: `auto` (every GPU `nvidia-smi` lists, else `cpu_slots` CPU
    processes), `cpu:N` (N CPU processes) or GPU indices `0,1,3`. `gpus`: the GPU count, for tests."""
    text = text.strip().lower()
    if text == "auto":
        found = gpus_listed() if gpus is None else gpus
        if found:
            return [Device("cuda", i) for i in range(found)]
        return cpu_devices(max(1, cpu_slots))
    if text.startswith("cpu:"):
        count = int(text[4:])
        if count < 1:
            raise ValueError("devices: cpu:N needs N >= 1")
        return cpu_devices(count)
    indices = sorted({int(part) for part in text.split(",") if part.strip()})
    if not indices or indices[0] < 0:
        raise ValueError(f"devices: {text!r} is not auto, cpu:N or a list of GPU indices")
    return [Device("cuda", i) for i in indices]


def cpu_devices(count: int, cores: int | None = None) -> list[Device]:
    """`count` CPU devices sharing the machine's `cores` evenly (each at least one; more devices than
    cores share them round robin)."""
    cores = cores or os.cpu_count() or 1
    share = max(1, cores // count)
    return [
        Device("cpu", i, tuple(sorted({(i * share + k) % cores for k in range(share)}))) for i in range(count)
    ]


@dataclass
class DevicePool:
    """The free devices of one worker; jobs take some and give them back."""

    devices: list[Device]
    free: list[Device] = field(init=False)
    lock: asyncio.Lock = field(init=False, repr=False)
    """Held while claiming work for the free devices, so that what is free cannot change meanwhile."""
    _changed: asyncio.Condition = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.free = sorted(self.devices)
        self.lock = asyncio.Lock()
        self._changed = asyncio.Condition()

    @property
    def size(self) -> int:
        return len(self.devices)

    async def wait_for_free(self, count: int = 1) -> int:
        """Wait until at least `count` devices are free; returns how many are."""
        async with self._changed:
            await self._changed.wait_for(lambda: len(self.free) >= count)
            return len(self.free)

    def take(self, count: int) -> list[Device]:
        """`count` free devices, lowest first (ValueError when fewer are free: never overcommitted)."""
        if count > len(self.free):
            raise ValueError(f"{count} devices asked, {len(self.free)} free")
        taken, self.free = self.free[:count], self.free[count:]
        return taken

    async def give_back(self, devices: list[Device]) -> None:
        async with self._changed:
            self.free = sorted({*self.free, *devices})  # a device compares by kind and index
            self._changed.notify_all()


def strategy(devices: int, parameters: int) -> Literal["single", "ddp", "fsdp"]:
    """How a job on `devices` devices trains a model of `parameters` parameters."""
    if devices <= 1:
        return "single"
    return "ddp" if parameters <= DDP_MAX_PARAMETERS else "fsdp"


@dataclass(frozen=True)
class Launch:
    """How to start one job's trainer on its devices."""

    argv: list[str]
    env: dict[str, str]
    """Added to the trainer's environment."""
    cpus: set[int] | None
    """CPU cores the trainer is confined to (CPU devices), or None."""


def confine(devices: list[Device]) -> tuple[dict[str, str], set[int] | None]:
    """What keeps a process to `devices`: the environment it gets (`CUDA_VISIBLE_DEVICES`; for CPU devices
    also the threads of each process: one per core of its device, or fewer where the host's own
    `OMP_NUM_THREADS` says so, as on a machine whose cores other work shares) and, for CPU devices, the cores
    it is pinned to."""
    if devices[0].kind == "cuda":
        return {"CUDA_VISIBLE_DEVICES": ",".join(str(d.index) for d in devices)}, None
    cpus = {core for d in devices for core in d.cores} or None
    threads = min(len(d.cores) or 1 for d in devices)
    host = os.environ.get("OMP_NUM_THREADS", "")
    if host.isdigit() and int(host) > 0:
        threads = min(threads, int(host))
    return {"CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": str(threads)}, cpus


def launch(devices: list[Device], spec: str, *, parameters: int, port: int) -> Launch:
    """The command, environment and CPU confinement of a trainer on `devices` (`spec`: its SPEC.json)."""
    on_gpu = devices[0].kind == "cuda"
    env, cpus = confine(devices)
    how = strategy(len(devices), parameters)
    trainer = ["-m", "trainer", "run", spec]
    if how == "single":
        return Launch([sys.executable, *trainer], env, cpus)
    argv = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        str(len(devices)),
        "--num_machines",
        "1",
        "--main_process_port",
        str(port),
        "--mixed_precision",
        "bf16" if on_gpu else "no",
        "--dynamo_backend",
        "no",
    ]
    if how == "fsdp" and on_gpu:
        argv += [
            "--use_fsdp",
            "--fsdp_sharding_strategy",
            "FULL_SHARD",
            "--fsdp_auto_wrap_policy",
            "TRANSFORMER_BASED_WRAP",
            "--fsdp_use_orig_params",
            "true",
            "--fsdp_cpu_ram_efficient_loading",
            "true",
            "--fsdp_sync_module_states",
            "true",
        ]
    else:
        # torchrun with one process per device; without CUDA the processes talk over gloo.
        argv += ["--multi_gpu"]
    return Launch([*argv, *trainer], env, cpus)


def vllm_serve(devices: list[Device], base_model: str, port: int) -> Launch:
    """`trl vllm-serve` for a reinforcement job's generation devices (vLLM's tensor parallelism over them)."""
    argv = [
        sys.executable,
        "-m",
        "trl.scripts.vllm_serve",
        "--model",
        base_model,
        "--tensor_parallel_size",
        str(len(devices)),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
    ]
    return Launch(argv, {"CUDA_VISIBLE_DEVICES": ",".join(str(d.index) for d in devices)}, None)


def free_port() -> int:
    """A TCP port free on this machine now (for the ranks' rendezvous, or a generation server)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def generation_devices(settings: Settings, method: str) -> int:
    """Devices a job of `method` takes beyond its `gpus` for vLLM in server mode (reinforcement only)."""
    return settings.vllm_server_gpus if method == "reinforcement" and settings.use_vllm else 0

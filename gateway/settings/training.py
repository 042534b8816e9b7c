"""Settings of the worker: the devices it trains on, how many jobs and eval runs it runs at once, its
heartbeats and re-queues, and how reinforcement jobs generate."""

from __future__ import annotations

from pydantic import BaseModel, Field


class TrainingSettings(BaseModel):
    """Training and the worker: the devices and slots a worker owns, vLLM for reinforcement jobs, the
    heartbeat, stale and re-queue times of its leases, how a trainer is stopped, and the worker's metrics."""

    devices: str = "auto"
    """The devices a worker owns: `auto` (every GPU `nvidia-smi` lists, else `training_slots` CPU processes),
    GPU indices (`0,1,2,3`) or `cpu:N`. A job takes `gpus` of them (its hyperparameter) while it trains."""
    training_slots: int = 1
    """With `devices` auto on a machine without GPUs: the CPU processes (devices) one worker trains on."""
    eval_run_slots: int = Field(default=2, ge=1)
    """Eval runs one worker executes at once, besides its training slots."""
    use_vllm: bool = False
    """Reinforcement jobs on GPUs generate with vLLM (the `vllm` extra, `pip install 'tunegate[vllm]'`, in the
    trainer's environment) instead of Transformers; see docs/training.md for CPUs."""
    vllm_server_gpus: int = Field(default=0, ge=0)
    """With `use_vllm`: 0 runs vLLM inside the trainer, on its devices (colocate); N > 0 gives each
    reinforcement job N more devices on which the worker runs `trl vllm-serve` for its generation (server)."""
    collective_timeout_s: float = Field(default=1800.0, gt=0)
    """A job on several devices fails when one rank waits this long on the others (a lost rank never hangs
    a job)."""
    heartbeat_interval_s: float = 1.0
    """How often a worker proves it is alive and checks for cancel/pause of its jobs."""
    stale_after_s: float = 30.0
    """A running job whose heartbeat is older than this is taken from its (dead) worker and re-queued."""
    max_attempts: int = 3
    """Times a job may be started (first run plus re-queues after lost workers) before it fails."""
    requeue_interval_s: int = 10
    """How often the worker looks for queued jobs that missed the queue (e.g. Redis was down at create)."""
    stop_grace_s: float = 60.0
    """How long a trainer gets to checkpoint and exit after SIGTERM before it is killed."""
    budget_check_interval_s: float = 5.0
    """How often a worker compares a running job's organisation (month-to-date spend plus the run's cost so
    far) against its monthly budget; over it, the job is paused (resumable once the budget is raised)."""
    worker_metrics_port: int | None = None
    """Port of a worker's Prometheus `/metrics` (its trainers' environment wait per step and retries);
    unset: none."""

"""Settings of environments and sandboxes: the gateway's sandbox slots, the ceilings of every sandbox, the
checks of an environment package, the venvs of its requirements, and the env servers of the deployment."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, Field

from envsdk.manifest import Maxima


class SandboxSettings(BaseModel):
    """Environments and sandboxes: how many sandboxed calls the gateway runs at once, the operator's ceilings
    on any sandbox (`sandbox_max_*`), the size checks of environment packages, their requirements' venvs
    and the pool of env servers that run environment jobs' rollouts."""

    sandbox_slots: int = Field(default=16, ge=1)
    """Sandboxed calls one gateway process runs at once (`environments/run`, `graders/run`, environment
    upload checks), on threads of their own: never the thread pool that uploads and other requests use.
    A call that finds them all taken waits up to `sandbox_wait_s`."""
    sandbox_slots_per_organization: int = Field(default=4, ge=1)
    """Sandboxed calls and CPU-heavy checks one organisation may have running at once on one gateway
    process; one more is refused at once with 429 `concurrency_limit_exceeded` (retry when one finishes)."""
    sandbox_wait_s: float = Field(default=30.0, gt=0)
    """Longest time a sandboxed call waits for one of the gateway's `sandbox_slots`; then 503
    `sandbox_busy` with `retry-after`."""
    cpu_processes: int = Field(default=2, ge=1)
    """Processes of the gateway's pool for CPU-heavy checks that would hold the interpreter's lock (parsing
    a large python grader source, scoring `string_check` and `text_similarity` graders), so the event loop
    never waits on them; started on first use."""
    allow_unsandboxed_environments: bool = False
    """Development only: run environment packages and python graders without a sandbox on a machine where
    neither bubblewrap nor unshare works. Never on a shared deployment."""
    sandbox_max_timeout_s: float = Field(default=60.0, gt=0)
    """Longest wall-clock time of one call into a sandbox (an environment package's `timeout_s` and a python
    grader's are capped by it; so is every sandbox the gateway, a worker or a trainer runs)."""
    sandbox_max_startup_timeout_s: float = Field(default=30.0, gt=0)
    """Longest time a sandbox may take to start and import its entrypoint; the upload check of an
    environment package waits no longer, whatever the package declares."""
    sandbox_max_memory_mb: int = Field(default=2048, ge=64)
    """Most address space (RLIMIT_AS) of a sandboxed process, in MiB."""
    sandbox_max_cpu_s: int = Field(default=600, ge=1)
    """Most CPU seconds (RLIMIT_CPU) of a sandboxed process over its life."""
    sandbox_max_nproc: int = Field(default=64, ge=1)
    """Most processes and threads (RLIMIT_NPROC) of one sandbox's uid."""
    sandbox_max_nofile: int = Field(default=1024, ge=16)
    """Most open files (RLIMIT_NOFILE) of a sandboxed process."""
    sandbox_max_fsize_mb: int = Field(default=256, ge=1)
    """Largest file (RLIMIT_FSIZE) a sandboxed process may write, in MiB."""
    sandbox_max_disk_mb: int = Field(default=512, ge=1)
    """Most bytes a sandbox may write in all, in MiB: its scratch (`/scratch`, `/tmp`, `HOME`) is a tmpfs of
    at most this size (memory of the host, apart from `sandbox_max_memory_mb`), gone when it ends."""
    max_environment_bytes: int = 64 * 1024 * 1024
    """Largest environment package archive."""
    environment_max_entries: int = 2000
    """Most files and folders an environment package archive may hold."""
    environment_max_unpacked_bytes: int = 100 * 1024 * 1024
    """Most bytes an environment package may expand to."""
    environment_max_ratio: float = 200.0
    """Largest expansion (unpacked bytes / archive bytes) of an environment package: compression bombs."""
    env_venv_dir: Path | None = None
    """Where the venvs of environment packages' `requirements` are built and cached, one per distinct set,
    shared by every package and organisation with that set (`envsdk.venvs`); unset: `<data_dir>/venvs`."""
    env_venv_build_timeout_s: float = Field(default=600.0, gt=0)
    """Longest time one venv build (pip, outside the sandbox) may take; past it the upload or job fails."""
    env_venv_max_bytes: int = Field(default=2 * 1024**3, ge=1024 * 1024)
    """Largest venv of one requirement set, in bytes; a bigger one is refused and removed."""
    env_pool: str = "default"
    """Pool of env servers (`tunegate env-server`) that serve this deployment's environment jobs. A worker
    gives its trainers this name and a Redis user of their own for it; with a server of the pool registered,
    a job's rollouts and rewards run there, else in the trainer's own sandbox. Env servers name the same
    pool."""
    env_server_capacity: int = Field(default=4, ge=1)
    """Sandboxes an env server runs at once per package (calls it serves at a time)."""

    def sandbox_maxima(self) -> Maxima:
        """The operator's ceilings on every sandbox's limits (`sandbox_max_*`), for `envsdk`."""
        return Maxima(
            timeout_s=self.sandbox_max_timeout_s,
            startup_timeout_s=self.sandbox_max_startup_timeout_s,
            memory_mb=self.sandbox_max_memory_mb,
            cpu_s=self.sandbox_max_cpu_s,
            nproc=self.sandbox_max_nproc,
            nofile=self.sandbox_max_nofile,
            fsize_mb=self.sandbox_max_fsize_mb,
            disk_mb=self.sandbox_max_disk_mb,
        )

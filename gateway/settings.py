"""The one settings object. Every value comes from a `TUNEGATE_*` environment variable or its default.

Nothing else in the project reads the environment: processes build a `Settings` once and pass it down.
"""

from __future__ import annotations

import json
from functools import cached_property
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field, SecretStr, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from envsdk.manifest import Maxima
from envsdk.venvs import VenvBuilder


class BaseModelConfig(BaseModel):
    """One base model that jobs may fine-tune and clients may chat with."""

    path: Path | None = None
    """Local HF-format directory. Empty for `tiny-chat` means `<data_dir>/models/tiny-chat` (made offline)."""
    tokenizer: str | None = None
    """What Tinker clients load this model's tokenizer from (`get_info`'s `tokenizer_id`, the SDK's
    `get_tokenizer()`): a hub id such as `Qwen/Qwen3-8B` for a hub model served to other machines. Empty:
    the model's local directory, which loads on this machine only."""
    upstreams: list[str] = Field(default_factory=list)
    """Base URLs (without `/v1`) of the inference engines that serve this model."""
    owned_by: str = "tunegate"
    """What `/v1/models` reports as the owner."""
    context_length: int | None = Field(default=None, ge=1)
    """Most tokens of one request to the model: `max_tokens` / `max_completion_tokens` above it, and a prompt
    that cannot fit it by its length alone, are refused with 400. Unset: the `max_position_embeddings` of
    the model's `config.json` where the gateway can read it, held to `engine_max_model_len`; else
    `engine_max_model_len`, else 1048576."""


LORA_RANKS = (8, 16, 32, 64, 128, 256, 320, 512)
"""The values vLLM accepts for `--max-lora-rank` (`engine_max_lora_rank`)."""

BASE_MODELS_FILE = "base_models.json"
"""Base models registered in the data dir by `tunegate models add`: `{"name": {"path": "/folder"}}`."""


def _default_base_models() -> dict[str, BaseModelConfig]:
    return {"tiny-chat": BaseModelConfig()}


class ModelPrice(BaseModel):
    """Prices of one base model (and of every adapter on it), in USD."""

    input_per_million: float = 0.20
    """Per million prompt tokens."""
    output_per_million: float = 0.60
    """Per million completion tokens."""
    training_per_million: float = 3.00
    """Per million trained tokens."""
    training_per_hour: float = 0.0
    """Per hour of the core training loop (reinforcement fine-tuning is usually billed this way)."""


class Settings(BaseSettings):
    """Settings of every tunegate process (gateway, worker, engine, CLI)."""

    model_config = SettingsConfigDict(env_prefix="TUNEGATE_", env_nested_delimiter="__", extra="ignore")

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".tunegate")
    """Where blobs, job work dirs, the tiny model and the embedded databases live."""
    database_url: str | None = None
    """PostgreSQL DSN. Unset: `tunegate up` starts an embedded PostgreSQL under the data dir."""
    redis_url: str | None = None
    """Redis URL. Unset: `tunegate up` starts an embedded Redis under the data dir."""
    admin_key: SecretStr | None = None
    """Bearer token of the admin API. Unset: generated once and stored in `<data_dir>/admin_key`."""

    host: str = "127.0.0.1"
    """Address the gateway binds to."""
    port: int = 8000
    """Port the gateway listens on."""
    engine_port: int = 8100
    """Port of the inference engine that `tunegate up` starts (vLLM serves one base model a process: the
    next base models get the ports after it)."""
    engine: Literal["auto", "vllm", "embedded"] = "auto"
    """The engine `tunegate up` serves base models with: `auto` (vLLM where it is installed and can run, else
    the embedded engine, saying why), `vllm` (installed by `scripts/install`, or `scripts/install-vllm`
    alone; it fails to start without it), or `embedded` (`python -m inference`)."""
    engine_max_loras: int = Field(default=8, ge=1)
    """Distinct adapters one engine batches together (vLLM's `--max-loras`); the embedded engine also keeps
    this many resident per base model."""
    engine_max_cpu_loras: int | None = Field(default=None, ge=1)
    """vLLM: adapters kept in host memory (`--max-cpu-loras`, at least `engine_max_loras`); unset: twice
    `engine_max_loras`. The embedded engine has no such second tier."""
    engine_max_lora_rank: int = 64
    """vLLM reserves memory for adapters up to this rank and refuses a higher one (`--max-lora-rank`: 8, 16,
    32, 64, 128, 256, 320 or 512). The gateway refuses an adapter of higher rank itself, on either engine
    (the embedded engine would load any rank)."""
    engine_max_model_len: int | None = Field(default=None, ge=1)
    """Most tokens of prompt and completion in one request (vLLM's and the embedded engine's
    `--max-model-len`), where the model's own context is longer; the gateway holds requests to it too.
    Unset: the model's own context."""
    engine_kv_cache_gib: float | None = Field(default=None, gt=0)
    """vLLM's KV cache, in GiB (`--kv-cache-memory-bytes`); unset: 1 GiB on CPUs (unsized, vLLM takes a
    share of the machine's free memory), vLLM's own share of GPU memory on GPUs."""
    engine_vllm_venv: Path | None = None
    """The virtual environment that holds vLLM; unset: `.venv-vllm` beside the project (where
    `scripts/install-vllm` puts it), else the one this process runs in."""

    base_models: dict[str, BaseModelConfig] = Field(default_factory=_default_base_models)
    """Base-model registry (JSON): `{"tiny-chat": {"path": "/models/tiny", "upstreams": ["http://h:8100"]}}`;
    an entry may also set `owned_by`, `context_length` (most tokens a request may ask the model for) and
    `tokenizer` (where Tinker clients load its tokenizer from: a hub id; else its folder)."""

    max_upload_bytes: int = 512 * 1024 * 1024
    """Largest file accepted by `POST /v1/files` (OpenAI's limit: 512 MB)."""
    max_jsonl_line_bytes: int = 8 * 1024 * 1024
    """Largest single line of a `fine-tune` JSONL upload."""
    max_environment_bytes: int = 64 * 1024 * 1024
    """Largest environment package archive."""
    max_json_depth: int = Field(default=64, ge=2)
    """Deepest nesting of arrays and objects in a request body or a JSONL line; deeper JSON is refused."""
    max_request_body_bytes: int = Field(default=2 * 1024 * 1024, ge=1024)
    """Largest body of any request but a file upload (`POST /v1/files` has `max_upload_bytes`): completions,
    graders, evals, jobs. A declared `Content-Length` over it is refused with 413 before the body is read, a
    streamed body as soon as it passes it. JSON is parsed on the event loop (2 MiB of escaped text: about
    10 ms), so this also bounds how long one request can hold everyone else's."""
    grader_max_source_bytes: int = Field(default=256 * 1024, ge=1)
    """Largest `source` of a python grader, in UTF-8 bytes (OpenAI's limit); checked before it is parsed."""
    grader_max_text_chars: int = Field(default=32 * 1024, ge=1)
    """Longest text a grader reads on the gateway or a worker: the `model_sample` of `graders/run`, and each
    `input` and `reference` of a `string_check` or `text_similarity` grader once its templates are filled in
    (fuzzy matching and ROUGE-L grow with the square of the length). Longer: a 400 naming the field in
    `graders/run`, an error of the item (score 0) in an eval run."""
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
    environment_max_entries: int = 2000
    """Most files and folders an environment package archive may hold."""
    environment_max_unpacked_bytes: int = 100 * 1024 * 1024
    """Most bytes an environment package may expand to."""
    environment_max_ratio: float = 200.0
    """Largest expansion (unpacked bytes / archive bytes) of an environment package: compression bombs."""
    allow_unsandboxed_environments: bool = False
    """Development only: run environment packages and python graders without a sandbox on a machine where
    neither bubblewrap nor unshare works. Never on a shared deployment."""
    env_pool: str = "default"
    """Pool of env servers (`tunegate env-server`) that serve this deployment's environment jobs. A worker
    gives its trainers this name and a Redis user of their own for it; with a server of the pool registered,
    a job's rollouts and rewards run there, else in the trainer's own sandbox. Env servers name the same
    pool."""
    worker_metrics_port: int | None = None
    """Port of a worker's Prometheus `/metrics` (its trainers' environment wait per step and retries);
    unset: none."""
    env_server_capacity: int = Field(default=4, ge=1)
    """Sandboxes an env server runs at once per package (calls it serves at a time)."""
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
    env_venv_dir: Path | None = None
    """Where the venvs of environment packages' `requirements` are built and cached, one per distinct set,
    shared by every package and organisation with that set (`envsdk.venvs`); unset: `<data_dir>/venvs`."""
    env_venv_build_timeout_s: float = Field(default=600.0, gt=0)
    """Longest time one venv build (pip, outside the sandbox) may take; past it the upload or job fails."""
    env_venv_max_bytes: int = Field(default=2 * 1024**3, ge=1024 * 1024)
    """Largest venv of one requirement set, in bytes; a bigger one is refused and removed."""

    db_pool_min: int = 1
    """Smallest size of the PostgreSQL connection pool."""
    db_pool_max: int = 10
    """Largest size of the PostgreSQL connection pool."""
    auth_cache_ttl_s: float = 10.0
    """How long a gateway trusts a cached API-key lookup (revocations on the same gateway apply at once)."""
    queue_name: str = "tunegate:jobs"
    """Name of the arq queue that carries fine-tuning jobs."""
    requeue_interval_s: int = 10
    """How often the worker looks for queued jobs that missed the queue (e.g. Redis was down at create)."""
    log_level: str = "info"
    """Log level of every process."""

    training_slots: int = 1
    """With `devices` auto on a machine without GPUs: the CPU processes (devices) one worker trains on."""
    devices: str = "auto"
    """The devices a worker owns: `auto` (every GPU `nvidia-smi` lists, else `training_slots` CPU processes),
    GPU indices (`0,1,2,3`) or `cpu:N`. A job takes `gpus` of them (its hyperparameter) while it trains."""
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
    tinker_idle_timeout_s: float = Field(default=300.0, gt=0)
    """A Tinker training model with no request for this long is saved and let go by its worker, freeing
    the training slot; its next request loads it again (`gateway.tinker.holder`)."""
    tinker_request_retention_s: float = Field(default=86_400.0, gt=0)
    """How long an answered Tinker request (a future and its result) is kept for `retrieve_future`; a worker's
    cron deletes older ones (their data is dropped as soon as they are answered)."""
    tinker_ephemeral_ttl_s: float = Field(default=86_400.0, ge=3600)
    """How long a sampler checkpoint saved for a sampling client at once
    (`save_weights_and_get_sampling_client`) lives; then a worker's cron deletes it, its served model and its
    files. Named checkpoints live for the `ttl_seconds` they were saved with, or for good."""
    tinker_budget_pause_s: int = Field(default=600, ge=0)
    """How long the Tinker SDK holds a training loop whose organisation's monthly budget is spent (retrying,
    so that raising the budget lets it go on) before it raises `BillingError`."""
    tinker_max_hold_s: float = Field(default=600.0, gt=0)
    """How long a worker keeps a Tinker training model on its training slot while other work (a queued job,
    another model) waits for one and the fair order puts it first: past it, the model is saved (adapter,
    optimizer and the gradients of a step not taken yet) once the request in hand is answered and lets the
    slot go; its next request waits its turn and loads that state. Counted from when the model was taken,
    busy or idle, optimizer steps included."""
    tinker_yield_idle_s: float = Field(default=60.0, gt=0)
    """A Tinker training model with no request for this long lets its slot go as soon as other work waits
    for one, as at `tinker_max_hold_s` (with nothing waiting, `tinker_idle_timeout_s` applies)."""
    tinker_max_numbers: int | None = Field(default=None, ge=1)
    """Most numbers one `forward_backward` request may decode to: its input tokens and every entry of its
    `loss_fn_inputs`, a sparse tensor counted at its dense size, checked on the declared sizes before
    anything is expanded; more is a 400. Unset: half of `max_request_body_bytes` (twice what a body of that
    size carries as dense 4-byte values)."""
    worker_alive_after_s: float = Field(default=10.0, gt=0)
    """A worker that has not stamped its presence in Redis for this long counts as gone (`/readyz`,
    `tunegate_workers_alive`); workers stamp every `heartbeat_interval_s`."""
    ready_min_workers: int = Field(default=1, ge=0)
    """Workers that must be alive for `/readyz` to answer 200 (0: readiness leaves workers out, e.g. a
    gateway deployed apart from any worker)."""
    max_attempts: int = 3
    """Times a job may be started (first run plus re-queues after lost workers) before it fails."""
    stop_grace_s: float = 60.0
    """How long a trainer gets to checkpoint and exit after SIGTERM before it is killed."""
    budget_check_interval_s: float = 5.0
    """How often a worker compares a running job's organisation (month-to-date spend plus the run's cost so
    far) against its monthly budget; over it, the job is paused (resumable once the budget is raised)."""
    gateway_url: str | None = None
    """Internal URL (without `/v1`) at which workers, trainers and the gateway itself reach a gateway, e.g.
    `http://tunegate-gateway:8000`: every model call a tenant causes besides its own chats goes through its
    chat route (eval runs and training jobs with a key minted for the work, `graders/run` and
    `environments/run` with the caller's key), so it is scoped, limited and metered like any client's.
    Unset: `http://<host>:<port>` (`127.0.0.1` when `host` binds every address)."""
    eval_run_slots: int = Field(default=2, ge=1)
    """Eval runs one worker executes at once, besides its training slots."""

    usage_buffer_rows: int = 100_000
    """Completion usage rows a gateway holds before a flush; when full, new rows are dropped (and counted)."""
    usage_flush_rows: int = 32
    """A flush starts as soon as this many usage rows are waiting. Small batches keep each write's burst of
    database work short (with one client, 500-row batches made the gateway's p99 1-2 ms worse than 32)."""
    usage_flush_interval_s: float = 1.0
    """Longest time a usage row waits in the gateway before it is written."""
    prices: dict[str, ModelPrice] = Field(default_factory=dict)
    """Price table per base model (JSON): `{"tiny-chat": {"input_per_million": 0.2, ...}}`; the key `*`
    prices every base model not named (unset: `ModelPrice`'s defaults)."""
    limits_cache_ttl_s: float = 10.0
    """How long a gateway trusts its cached rate limits and budgets (its own admin changes apply at once)."""
    rate_limit_lease_s: float = Field(default=0.25, ge=0)
    """Seconds of its own recent traffic a gateway may take from a large rate-limit bucket, or hold of a
    monthly budget, in advance, to admit the requests that follow without a Redis round trip (never more
    than the bucket or the budget grants, so limits and budgets hold across gateways; small buckets and
    budgets near their end are counted request by request). 0: ask Redis every time."""
    budget_default_max_tokens: int = 256
    """Completion tokens assumed for a budget reservation when a request names no `max_tokens`."""
    default_requests_per_minute: int = Field(default=10_000, ge=0)
    """Requests per minute of an API key with no request limit of its own (0: unlimited)."""
    default_tokens_per_minute: int = Field(default=10_000_000, ge=0)
    """Tokens (prompt estimate plus max tokens) per minute of an API key with no token limit of its own
    (0: unlimited)."""
    stripe_api_key: SecretStr | None = None
    """Stripe secret key. Unset: usage is aggregated into the outbox but nothing is sent."""
    stripe_api_base: str | None = None
    """Stripe API base URL (unset: Stripe's own); a local stand-in in tests."""
    stripe_max_retries: int = 3
    """Network retries of the Stripe SDK per meter event (429 and 5xx, with backoff)."""
    stripe_meter_input_tokens: str = "tunegate_input_tokens"
    """Stripe meter event name for prompt tokens."""
    stripe_meter_output_tokens: str = "tunegate_output_tokens"
    """Stripe meter event name for completion tokens."""
    stripe_meter_training_tokens: str = "tunegate_training_tokens"
    """Stripe meter event name for trained tokens."""
    stripe_meter_training_seconds: str = "tunegate_training_seconds"
    """Stripe meter event name for seconds of the core training loop."""
    billing_window_s: int = 3600
    """Width of the usage windows aggregated into one meter event per organisation and meter."""
    billing_interval_s: int = 60
    """How often the worker aggregates unbilled usage and sends pending meter events."""

    base_url: str | None = None
    """Gateway URL the `tunegate` client commands talk to (`jobs follow`, `quickstart`), e.g.
    `http://gw:8000/v1`. Unset: `http://<host>:<port>/v1`."""
    api_key: SecretStr | None = None
    """API key (`sk-tg-...`) the `tunegate` client commands use. Unset: `--api-key` must name one."""

    @field_validator("engine_max_lora_rank")
    @classmethod
    def _lora_rank_vllm_accepts(cls, value: int) -> int:
        if value not in LORA_RANKS:
            raise ValueError(f"must be one of {', '.join(map(str, LORA_RANKS))} (the ranks vLLM accepts)")
        return value

    @model_validator(mode="after")
    def _registered_base_models(self) -> Settings:
        """Add the base models registered in the data dir (`tunegate models add`: a folder, and the hub id it
        came from, as its `tokenizer`) to those configured."""
        try:
            registered = json.loads((self.data_dir / BASE_MODELS_FILE).read_text())
        except (OSError, ValueError):
            return self
        if isinstance(registered, dict):
            for name, entry in registered.items():
                if name not in self.base_models and isinstance(entry, dict) and entry.get("path"):
                    tokenizer = entry.get("tokenizer")
                    self.base_models[name] = BaseModelConfig(path=Path(entry["path"]), tokenizer=tokenizer)
        return self

    @cached_property
    def blob_dir(self) -> Path:
        """Root of the local blob store."""
        return self.data_dir / "blobs"

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

    def venv_builder(self) -> VenvBuilder:
        """The builder of environment packages' venvs (`env_venv_*`), for `envsdk`."""
        return VenvBuilder(
            root=self.env_venv_dir or self.data_dir / "venvs",
            timeout_s=self.env_venv_build_timeout_s,
            max_bytes=self.env_venv_max_bytes,
        )

    def internal_gateway_url(self) -> str:
        """Where workers reach a gateway: `gateway_url`, else this process's own host and port."""
        if self.gateway_url:
            return self.gateway_url.rstrip("/").removesuffix("/v1")
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

    def base_model_path(self, model_id: str) -> Path:
        """Local directory of a configured base model."""
        entry = self.base_models[model_id]
        if entry.path is not None:
            return entry.path
        return self.data_dir / "models" / model_id

    def tokenizer_of(self, model_id: str) -> str:
        """Where clients load a base model's tokenizer from: its `tokenizer`, else its directory."""
        return self.base_models[model_id].tokenizer or str(self.base_model_path(model_id))

    def price_of(self, base_model: str) -> ModelPrice:
        """Prices of `base_model` (those of `*`, or the defaults, when it has none of its own)."""
        return self.prices.get(base_model) or self.prices.get("*") or ModelPrice()

    def admin_key_value(self) -> str | None:
        """The admin key, from the settings or from the data dir where `tunegate up` stored it."""
        if self.admin_key is not None:
            return self.admin_key.get_secret_value()
        stored = self.data_dir / "admin_key"
        if stored.exists():
            return stored.read_text().strip()
        return None


def settings_env(settings: Settings) -> dict[str, str]:
    """`TUNEGATE_*` variables that recreate these settings in a child process (every field, so a child
    never falls back to a default its parent overrode)."""
    env: dict[str, str] = {}
    for name in Settings.model_fields:
        value = getattr(settings, name)
        if value is None:
            continue
        if isinstance(value, SecretStr):
            text = value.get_secret_value()
        elif isinstance(value, dict | list):
            text = json.dumps(
                {k: v.model_dump(mode="json") if isinstance(v, BaseModel) else v for k, v in value.items()}
                if isinstance(value, dict)
                else value
            )
        else:
            text = str(value)
        env[f"TUNEGATE_{name.upper()}"] = text
    return env

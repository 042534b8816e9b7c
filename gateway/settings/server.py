"""Settings of the gateway's HTTP server: where it listens, the admin key, readiness, and how workers and
the `tunegate` client commands reach it."""

from __future__ import annotations

from pydantic import BaseModel, Field, SecretStr


class ServerSettings(BaseModel):
    """The gateway's HTTP server and its callers: bind address, admin key and key cache, the readiness of
    `/readyz`, the internal URL workers use, and the URL and key of the `tunegate` client commands."""

    host: str = "127.0.0.1"
    """Address the gateway binds to."""
    port: int = 8000
    """Port the gateway listens on."""
    admin_key: SecretStr | None = None
    """Bearer token of the admin API. Unset: generated once and stored in `<data_dir>/admin_key`."""
    auth_cache_ttl_s: float = 10.0
    """How long a gateway trusts a cached API-key lookup (revocations on the same gateway apply at once)."""
    gateway_url: str | None = None
    """Internal URL (without `/v1`) at which workers, trainers and the gateway itself reach a gateway, e.g.
    `http://tunegate-gateway:8000`: every model call a tenant causes besides its own chats goes through its
    chat route (eval runs and training jobs with a key minted for the work, `graders/run` and
    `environments/run` with the caller's key), so it is scoped, limited and metered like any client's.
    Unset: `http://<host>:<port>` (`127.0.0.1` when `host` binds every address)."""
    worker_alive_after_s: float = Field(default=10.0, gt=0)
    """A worker that has not stamped its presence in Redis for this long counts as gone (`/readyz`,
    `tunegate_workers_alive`); workers stamp every `heartbeat_interval_s`."""
    ready_min_workers: int = Field(default=1, ge=0)
    """Workers that must be alive for `/readyz` to answer 200 (0: readiness leaves workers out, e.g. a
    gateway deployed apart from any worker)."""
    base_url: str | None = None
    """Gateway URL the `tunegate` client commands talk to (`jobs follow`, `quickstart`), e.g.
    `http://gw:8000/v1`. Unset: `http://<host>:<port>/v1`."""
    api_key: SecretStr | None = None
    """API key (`sk-tg-...`) the `tunegate` client commands use. Unset: `--api-key` must name one."""

    def internal_gateway_url(self) -> str:
        """Where workers reach a gateway: `gateway_url`, else this process's own host and port."""
        if self.gateway_url:
            return self.gateway_url.rstrip("/").removesuffix("/v1")
        host = "127.0.0.1" if self.host in ("", "0.0.0.0", "::") else self.host
        return f"http://{'[' + host + ']' if ':' in host else host}:{self.port}"

"""Serving state made once in the lifespan: the pooled HTTP client, the engines of every base model, adapter
loads (single-flight), the model cache, usage metering and the rate-limit/budget guard.

Routing: each base model has one or more engine base URLs. A request for an adapter goes to an engine that
already holds it (least in-flight among those); otherwise, and for base-model requests, to the engine with
the fewest requests in flight, ties broken round robin. An engine that refused a connection is tried last
for a few seconds.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import time
from dataclasses import dataclass, field

import httpx

from gateway.errors import APIError, ServiceUnavailable
from gateway.limits.guard import Guard
from gateway.settings import Settings
from gateway.usage.buffer import UsageBuffer

logger = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 2.0
DOWN_FOR_S = 5.0


def make_client() -> httpx.AsyncClient:
    """The one pooled client to the engines: HTTP/1.1 keep-alive, generous limits, a short connect timeout.

    No read timeout of note: generations may be long, and streams end when the engine ends them.
    `trust_env=False`: engines live on the private network, never behind an environment proxy.
    """
    return httpx.AsyncClient(
        timeout=httpx.Timeout(connect=CONNECT_TIMEOUT_S, read=600.0, write=60.0, pool=10.0),
        limits=httpx.Limits(max_connections=2000, max_keepalive_connections=500, keepalive_expiry=60.0),
        trust_env=False,
    )


@dataclass(eq=False)
class Upstream:
    """One engine base URL (without `/v1`)."""

    url: str
    in_flight: int = 0
    loaded: set[str] = field(default_factory=set)
    """Adapters this gateway knows the engine holds (loaded by it, or found loaded already)."""
    down_until: float = 0.0

    def mark_down(self) -> None:
        self.down_until = time.monotonic() + DOWN_FOR_S


class UpstreamPool:
    """The engines serving one base model."""

    def __init__(self, base_model: str, urls: list[str]) -> None:
        self.base_model = base_model
        self.upstreams = [Upstream(u.rstrip("/")) for u in urls]
        self._turn = itertools.count()

    def candidates(self, adapter: str | None) -> list[Upstream]:
        """Engines in the order to try them for a request (for `adapter`, or the base model when None)."""
        n = len(self.upstreams)
        if n == 0:
            return []
        start = next(self._turn) % n
        rotated = self.upstreams[start:] + self.upstreams[:start]
        now = time.monotonic()
        return sorted(
            rotated,
            key=lambda u: (u.down_until > now, adapter is not None and adapter not in u.loaded, u.in_flight),
        )


@dataclass(frozen=True, slots=True)
class Target:
    """What a requested model id is served as."""

    model_id: str
    """The id the client asked for (and sees in answers)."""
    base_model: str
    """The base model whose engines serve it."""
    adapter_path: str | None = None
    """The LoRA adapter directory, or None for a base model."""

    @property
    def engine_model(self) -> str:
        """The name the engine knows: the base model's, or the adapter's (the model id itself)."""
        return self.base_model if self.adapter_path is None else self.model_id


class ModelCache:
    """Model lookups of the last few seconds, by (organisation, model id); no DB round trip on a hit."""

    def __init__(self, ttl_s: float = 10.0, negative_ttl_s: float = 1.0, max_entries: int = 100_000) -> None:
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self.max_entries = max_entries
        self._entries: dict[tuple[str, str], tuple[float, Target | None]] = {}

    def get(self, org_id: str, model_id: str) -> tuple[bool, Target | None]:
        """(hit, target): a hit may be a remembered miss (target None)."""
        hit = self._entries.get((org_id, model_id))
        if hit is None or hit[0] <= time.monotonic():
            return False, None
        return True, hit[1]

    def put(self, org_id: str, model_id: str, target: Target | None) -> None:
        if len(self._entries) >= self.max_entries:
            self._entries.clear()
        ttl = self.ttl_s if target is not None else self.negative_ttl_s
        self._entries[(org_id, model_id)] = (time.monotonic() + ttl, target)

    def invalidate(self, model_id: str) -> None:
        """Forget `model_id` for every organisation (and its checkpoints, whose ids extend it)."""
        for key in [k for k in self._entries if k[1] == model_id or k[1].startswith(model_id + ":")]:
            self._entries.pop(key, None)


class AdapterLoadFailed(APIError):
    status = 500
    type = "server_error"
    default_code = "adapter_load_failed"


class ServingState:
    """Everything serving shares across requests; made in the lifespan, closed with `aclose()`."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient | None = None) -> None:
        self.settings = settings
        self.client = client if client is not None else make_client()
        self.pools = {name: UpstreamPool(name, cfg.upstreams) for name, cfg in settings.base_models.items()}
        self.models = ModelCache(ttl_s=max(settings.auth_cache_ttl_s, 1.0))
        self.usage = UsageBuffer(
            max_rows=settings.usage_buffer_rows,
            flush_rows=settings.usage_flush_rows,
            flush_interval_s=settings.usage_flush_interval_s,
        )
        """Completion metering: written in batches once `usage.start(pool)` ran (the gateway's lifespan)."""
        self.guard: Guard | None = None
        """Rate limits and budgets; None (nothing enforced) until the lifespan makes one."""
        self.load_count = 0
        """Adapter loads actually sent to engines (single-flight makes concurrent misses one load)."""
        self._loads: dict[tuple[str, str], asyncio.Task[None]] = {}

    async def aclose(self) -> None:
        await self.usage.aclose()
        await self.client.aclose()

    def pool_for(self, base_model: str) -> UpstreamPool:
        pool = self.pools.get(base_model)
        if pool is None or not pool.upstreams:
            raise ServiceUnavailable(f"No inference engine is configured for model '{base_model}'.")
        return pool

    async def ensure_loaded(self, upstream: Upstream, target: Target) -> None:
        """Make sure `upstream` holds the adapter of `target`: one load per (engine, adapter) at a time.

        Raises `httpx.TransportError` when the engine cannot be reached, `AdapterLoadFailed` when it refuses.
        """
        if target.adapter_path is None or target.model_id in upstream.loaded:
            return
        key = (upstream.url, target.model_id)
        task = self._loads.get(key)
        if task is None:
            task = asyncio.create_task(self._load(upstream, target))
            self._loads[key] = task
            task.add_done_callback(lambda _t: self._loads.pop(key, None))
        # Shielded: a waiter that goes away must not cancel the load the others wait for.
        await asyncio.shield(task)

    async def _load(self, upstream: Upstream, target: Target) -> None:
        assert target.adapter_path is not None
        self.load_count += 1
        t0 = time.perf_counter()
        resp = await self.client.post(
            f"{upstream.url}/v1/load_lora_adapter",
            json={
                "lora_name": target.model_id,
                "lora_path": target.adapter_path,
                "base_model_name": target.base_model,
            },
        )
        if resp.status_code == 200 or (resp.status_code == 400 and "already" in resp.text.lower()):
            upstream.loaded.add(target.model_id)
            logger.info(
                "adapter %s on %s ready in %.2fs", target.model_id, upstream.url, time.perf_counter() - t0
            )
            return
        logger.warning("engine %s refused adapter %s: %s", upstream.url, target.model_id, resp.text[:300])
        raise AdapterLoadFailed(f"The inference engine could not load model '{target.model_id}'.")

    async def unload(self, upstream: Upstream, model_id: str) -> None:
        """Unload `model_id` from one engine (unknown there counts as done)."""
        upstream.loaded.discard(model_id)
        resp = await self.client.post(f"{upstream.url}/v1/unload_lora_adapter", json={"lora_name": model_id})
        if resp.status_code not in (200, 404):
            logger.warning("engine %s could not unload %s: %s", upstream.url, model_id, resp.text[:300])

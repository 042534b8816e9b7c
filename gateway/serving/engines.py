"""The inference engines of every base model: which engine serves a request, and adapters on engines.

Routing: each base model has one or more engine base URLs. A request for an adapter goes to an engine that
already holds it (least in-flight among those); otherwise, and for base-model requests, to the engine with
the fewest requests in flight, ties broken round robin. An engine that refused a connection is tried last
for a few seconds. What this gateway knows of each engine (requests in flight, adapter versions loaded and
running) and the order to try them in is `gateway.serving.upstreams`.

Adapters go onto engines through vLLM's runtime LoRA endpoints (`AdapterLoader`, one httpx client), named by
their version ids (`gateway.serving.versions`), never by the names users call. The
gateway's `Engines` remembers which engine holds which adapter and makes concurrent loads of one adapter on
one engine a single load; the worker, which serves nothing, uses an `AdapterLoader` on its own. An adapter
whose rank is above `engine_max_lora_rank` is refused before any engine is asked, where the gateway can read
its `adapter_config.json`; an engine's refusal is mapped in `gateway.serving.engine_errors`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import Counter, Histogram
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from gateway.errors import APIError, ServiceUnavailable
from gateway.serving.engine_client import make_client
from gateway.serving.engine_errors import AdapterRankTooLarge, adapter_load_error
from gateway.serving.model_limits import ModelLimits, read_limits
from gateway.serving.upstreams import Residency, Upstream, UpstreamPool
from gateway.serving.versions import adapter_version, path_version
from gateway.settings import Settings
from gateway.singleflight import SingleFlight

logger = logging.getLogger(__name__)

HELD_TIMEOUT_S = 2.0
"""How long the models API waits for an engine to say which adapters it holds."""
DRAIN_TIMEOUT_S = 60.0
"""How long an unload waits for the requests this gateway has running on the version (then unloads anyway)."""


@dataclass(frozen=True, slots=True)
class Target:
    """What a requested model id is served as."""

    model_id: str
    """The id the client asked for (and sees in answers)."""
    base_model: str
    """The base model whose engines serve it."""
    adapter_path: str | None = None
    """The LoRA adapter directory, or None for a base model."""
    version: str | None = None
    """The adapter's version id (`gateway.serving.versions`), or None for a base model."""

    @property
    def engine_model(self) -> str:
        """The name the engine knows: the base model's, or the adapter's version id (never a name users call,
        which may come to mean other weights)."""
        if self.adapter_path is None:
            return self.base_model
        return self.version if self.version is not None else self.model_id

    @property
    def served_version(self) -> str:
        """What answers say served them (`X-Tunegate-Model-Version`, `system_fingerprint`): the adapter's
        version, or the base model's name."""
        return self.engine_model


def adapter_rank(path: str) -> int | None:
    """The largest LoRA rank of the adapter in `path`: its `adapter_config.json`'s `r` and any per-module
    `rank_pattern` value (vLLM holds adapters to the largest); None when the file cannot be read here (the
    engines may see files the gateway does not, and judge for themselves)."""
    try:
        config = json.loads((Path(path) / "adapter_config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    pattern = config.get("rank_pattern")
    ranks = [config.get("r"), *(pattern.values() if isinstance(pattern, dict) else ())]
    ints = [r for r in ranks if type(r) is int]
    return max(ints) if ints else None


class AdapterLoader:
    """Loads and unloads LoRA adapters on engines, by URL, over one pooled httpx client."""

    def __init__(self, settings: Settings, client: httpx.AsyncClient | None = None) -> None:
        self.urls = {
            name: [u.rstrip("/") for u in cfg.upstreams] for name, cfg in settings.base_models.items()
        }
        """Engine base URLs (without `/v1`) of each base model."""
        self.client = client if client is not None else make_client()
        self.max_lora_rank = settings.engine_max_lora_rank
        """Adapters of a higher rank are refused before an engine is asked (the engines'
        `--max-lora-rank`)."""
        self.load_count = 0
        """Adapter loads actually sent to engines."""

    async def load(self, url: str, target: Target) -> None:
        """Load `target`'s adapter on the engine at `url` ("already loaded" counts as done).

        Raises `AdapterRankTooLarge` before asking the engine when the adapter's rank is above
        `max_lora_rank`, `httpx.HTTPError` when the engine cannot be reached, and the engine's refusal as
        `engine_errors.adapter_load_error` maps it.
        """
        assert target.adapter_path is not None
        rank = await asyncio.to_thread(adapter_rank, target.adapter_path)
        if rank is not None and rank > self.max_lora_rank:
            raise AdapterRankTooLarge(target.model_id, rank, self.max_lora_rank)
        self.load_count += 1
        t0 = time.perf_counter()
        body = {
            "lora_name": target.engine_model,
            "lora_path": target.adapter_path,
            "base_model_name": target.base_model,
        }
        try:
            resp = await self.client.post(f"{url}/v1/load_lora_adapter", json=body)
        except (httpx.ReadError, httpx.RemoteProtocolError):
            # A kept-alive connection the engine closed as it was reused: a load may be asked again.
            resp = await self.client.post(f"{url}/v1/load_lora_adapter", json=body)
        if resp.status_code == 200 or (resp.status_code == 400 and "already" in resp.text.lower()):
            logger.info(
                "adapter %s (%s) on %s ready in %.2fs",
                target.model_id,
                target.engine_model,
                url,
                time.perf_counter() - t0,
            )
            return
        raise adapter_load_error(
            resp.status_code, resp.content, model=target.model_id, url=url, path=target.adapter_path
        )

    async def unload(self, url: str, version: str) -> None:
        """Unload adapter version `version` from the engine at `url` (unknown there counts as done)."""
        resp = await self.client.post(f"{url}/v1/unload_lora_adapter", json={"lora_name": version})
        if resp.status_code not in (200, 404):
            logger.warning("engine %s could not unload %s: %s", url, version, resp.text[:300])

    async def load_everywhere(
        self, model_id: str, base_model: str, path: str, version: str | None = None
    ) -> dict[str, str | None]:
        """Load adapter `model_id` (directory `path`) onto every engine of `base_model`, as `version`
        (computed from the files when not given).

        Returns `{engine url: None if loaded, else the reason}`; never raises for an engine that is down or
        refuses (requests load lazily on a miss anyway).
        """
        if version is None:
            try:
                version = await asyncio.to_thread(adapter_version, path)
            except OSError:
                version = path_version(path)
        target = Target(model_id=model_id, base_model=base_model, adapter_path=path, version=version)
        return await _everywhere(self.urls.get(base_model, []), lambda url: self.load(url, target), model_id)

    async def unload_everywhere(self, model_id: str, base_model: str | None = None) -> dict[str, str | None]:
        """Unload adapter version `model_id` from every engine (of `base_model`, or of every base model)."""
        urls = (
            self.urls[base_model] if base_model in self.urls else [u for us in self.urls.values() for u in us]
        )
        return await _everywhere(urls, lambda url: self.unload(url, model_id), model_id)

    async def aclose(self) -> None:
        await self.client.aclose()

    async def __aenter__(self) -> AdapterLoader:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.aclose()


async def _everywhere(
    urls: list[str], action: Callable[[str], Awaitable[None]], model_id: str
) -> dict[str, str | None]:
    """`action` on every engine at once: `{url: None if done, else the reason}`."""
    out: dict[str, str | None] = {}

    async def one(url: str) -> None:
        try:
            await action(url)
            out[url] = None
        except (httpx.HTTPError, APIError) as exc:
            out[url] = str(exc) or type(exc).__name__
            logger.warning("adapter %s on %s: %s", model_id, url, out[url])

    await asyncio.gather(*(one(u) for u in urls))
    return out


class Engines:
    """The gateway's engines: one `UpstreamPool` per base model, the adapters each holds, the models' limits.
    Made in the lifespan, closed with `aclose()`."""

    def __init__(self, settings: Settings, loader: AdapterLoader | None = None) -> None:
        self.settings = settings
        self.loader = loader if loader is not None else AdapterLoader(settings)
        self.pools = {name: UpstreamPool(name, urls) for name, urls in self.loader.urls.items()}
        self._loads: SingleFlight[tuple[str, str], None] = SingleFlight()
        self._limits = {name: read_limits(settings, name) for name in settings.base_models}
        """Read once, here, off the request path (a tokenizer's vocabulary may be megabytes)."""
        self.metrics = AdapterMetrics()
        self.drain_timeout_s = DRAIN_TIMEOUT_S
        self._unloads: set[asyncio.Task[None]] = set()
        """Unloads waiting for requests to end (`unload_everywhere`)."""

    @property
    def load_count(self) -> int:
        """Adapter loads actually sent to engines (single-flight makes concurrent misses one load)."""
        return self.loader.load_count

    def limits(self, base_model: str) -> ModelLimits:
        """What requests to `base_model` are held to (`read_limits`)."""
        known = self._limits.get(base_model)
        if known is None:
            known = self._limits[base_model] = read_limits(self.settings, base_model)
        return known

    def pool_for(self, base_model: str) -> UpstreamPool:
        pool = self.pools.get(base_model)
        if pool is None or not pool.upstreams:
            raise ServiceUnavailable(f"No inference engine is configured for model '{base_model}'.")
        return pool

    async def ensure_loaded(self, upstream: Upstream, target: Target) -> None:
        """Make sure `upstream` holds the adapter of `target`: one load per (engine, adapter) at a time.

        Raises `httpx.TransportError` when the engine cannot be reached, the error of `AdapterLoader.load`
        when the adapter cannot be served.
        """
        version = target.engine_model
        if target.adapter_path is None or version in upstream.loaded:
            return
        metrics = self.metrics

        async def load() -> None:
            reload = version in upstream.load_s
            t0 = time.perf_counter()
            try:
                await self.loader.load(upstream.url, target)
            except BaseException:
                metrics.load_failures.labels(target.base_model).inc()
                raise
            took = time.perf_counter() - t0
            upstream.loaded.add(version)
            upstream.load_s[version] = took
            metrics.loads.labels(target.base_model).inc()
            metrics.load_seconds.labels(target.base_model).observe(took)
            if reload:
                metrics.evictions.labels(target.base_model).inc()

        await self._loads.run((upstream.url, version), load)

    async def held(self, base_model: str) -> list[set[str] | None]:
        """The models each engine of `base_model` says it serves (its `/v1/models`: the base model and the
        adapter versions it holds), None for an engine that does not answer within `HELD_TIMEOUT_S`."""
        pool = self.pools.get(base_model)

        async def one(up: Upstream) -> set[str] | None:
            try:
                resp = await self.loader.client.get(f"{up.url}/v1/models", timeout=HELD_TIMEOUT_S)
                resp.raise_for_status()
                return {m["id"] for m in resp.json()["data"] if isinstance(m.get("id"), str)}
            except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
                return None

        return list(await asyncio.gather(*(one(up) for up in pool.upstreams))) if pool is not None else []

    def residency(
        self, version: str, base_model: str, held: list[set[str] | None] | None = None
    ) -> list[Residency]:
        """`version` on each engine of `base_model`: loaded as the engine says in `held` (`Engines.held`),
        else as this gateway knows it; when it last started a request there and its load time, as this
        gateway saw them."""
        pool = self.pools.get(base_model)
        out = []
        for i, up in enumerate(pool.upstreams if pool is not None else []):
            used = up.last_used.get(version)
            says = held[i] if held is not None and i < len(held) else None
            out.append(
                Residency(
                    engine=i,
                    loaded=version in says if says is not None else version in up.loaded,
                    last_used=int(used) if used is not None else None,
                    load_s=up.load_s.get(version),
                )
            )
        return out

    async def unload_everywhere(self, version: str, base_model: str | None = None) -> None:
        """Unload adapter version `version` from every engine (of `base_model`, or of all) once the requests
        this gateway has running on it end (at most `drain_timeout_s`): at once when none runs, else in a
        task of its own, so the caller does not wait for them."""
        ups = [
            up
            for name, pool in self.pools.items()
            if base_model is None or base_model not in self.pools or name == base_model
            for up in pool.upstreams
        ]
        if not any(up.running.get(version) for up in ups):
            await self._unload(version, base_model, ups)
            return

        async def drain_then_unload() -> None:
            try:
                async with asyncio.timeout(self.drain_timeout_s):
                    await asyncio.gather(*(up.drained(version) for up in ups))
            except TimeoutError:
                logger.warning(
                    "adapter %s still had requests running after %.0fs; unloading anyway",
                    version,
                    self.drain_timeout_s,
                )
            await self._unload(version, base_model, ups)

        task = asyncio.create_task(drain_then_unload())
        self._unloads.add(task)
        task.add_done_callback(self._unloads.discard)

    async def _unload(self, version: str, base_model: str | None, ups: list[Upstream]) -> None:
        for up in ups:
            up.forget(version)
        done = await self.loader.unload_everywhere(version, base_model)
        labels = {base_model} if base_model is not None else set(self.pools)
        for name in labels:
            self.metrics.unloads.labels(name).inc()
        if any(reason is not None for reason in done.values()):
            logger.warning("adapter %s not unloaded everywhere: %s", version, done)

    async def aclose(self) -> None:
        for task in list(self._unloads):
            task.cancel()
        await asyncio.gather(*self._unloads, return_exceptions=True)
        await self.loader.aclose()
        for pool in self.pools.values():
            for up in pool.upstreams:
                await up.http.aclose()


class AdapterMetrics(Collector):
    """Adapters on the engines, on `/metrics`, labelled by base model only (bounded cardinality): hits (a
    request found its version loaded on the engine it went to), misses, loads, failed loads, evictions seen
    (a load of a version the gateway had loaded there before: the engine lost it), unloads, and the loads'
    latency. Registered with the app's registry in the lifespan."""

    def __init__(self) -> None:
        def counter(name: str, doc: str) -> Counter:
            return Counter(f"tunegate_adapter_{name}", doc, ["base_model"], registry=None)

        self.hits = counter("hits", "Requests that found their adapter version loaded on their engine")
        self.misses = counter("misses", "Requests whose adapter version had to be loaded on their engine")
        self.loads = counter("loads", "Adapter versions loaded on engines")
        self.load_failures = counter("load_failures", "Adapter loads that failed")
        self.evictions = counter("evictions", "Reloads of versions loaded before: the engine had lost them")
        self.unloads = counter("unloads", "Adapter versions the gateway unloaded from the engines")
        self.load_seconds = Histogram(
            "tunegate_adapter_load_seconds",
            "Time an adapter load on an engine took",
            ["base_model"],
            registry=None,
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
        )
        self._hits: dict[str, Any] = {}
        self._misses: dict[str, Any] = {}
        """Children kept per base model: `labels()` costs more than the update, on the request path."""

    def hit(self, base_model: str) -> None:
        child = self._hits.get(base_model)
        if child is None:
            child = self._hits[base_model] = self.hits.labels(base_model)
        child.inc()

    def miss(self, base_model: str) -> None:
        child = self._misses.get(base_model)
        if child is None:
            child = self._misses[base_model] = self.misses.labels(base_model)
        child.inc()

    def collect(self) -> Iterator[Metric]:
        for metric in (
            self.hits,
            self.misses,
            self.loads,
            self.load_failures,
            self.evictions,
            self.unloads,
            self.load_seconds,
        ):
            yield from metric.collect()

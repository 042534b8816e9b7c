"""The engines of one base model as this gateway sees them (`gateway.serving.engines` routes over them).

An `Upstream` is one engine base URL with its keep-alive connections and what this gateway knows of it:
requests in flight (in all, and per adapter version, so an unload can wait for a version's last request),
the adapter versions it holds, when each last started a request and how long its latest load took; an
engine that refused a connection is marked down for `DOWN_FOR_S`. An `UpstreamPool` holds a base model's
engines and says in which order to try them; `Residency` is what the models API shows of one adapter
version on one engine.
"""

from __future__ import annotations

import asyncio
import itertools
import time
from dataclasses import dataclass, field

from gateway.serving.engine_client import EngineClient

DOWN_FOR_S = 5.0
"""How long an engine that refused a connection is tried last."""


@dataclass(eq=False)
class Upstream:
    """One engine base URL (without `/v1`)."""

    url: str
    in_flight: int = 0
    loaded: set[str] = field(default_factory=set)
    """Adapter versions this gateway knows the engine holds (loaded by it, or found loaded already)."""
    down_until: float = 0.0
    running: dict[str, int] = field(default_factory=dict)
    """Requests of this gateway in flight on the engine, per adapter version."""
    last_used: dict[str, float] = field(default_factory=dict)
    """Unix time a request last started on each adapter version here."""
    load_s: dict[str, float] = field(default_factory=dict)
    """Seconds the latest load of each adapter version here took (kept until the gateway unloads it: a
    load of a version found here is a reload, the engine having lost it)."""
    _drained: dict[str, asyncio.Event] = field(default_factory=dict, repr=False)
    http: EngineClient = field(init=False, repr=False)
    """The keep-alive connections proxied requests use."""

    def __post_init__(self) -> None:
        self.http = EngineClient(self.url)

    def mark_down(self) -> None:
        self.down_until = time.monotonic() + DOWN_FOR_S

    def acquire(self, version: str | None) -> None:
        """One more request in flight here (on adapter `version`, or the base model when None)."""
        self.in_flight += 1
        if version is not None:
            self.running[version] = self.running.get(version, 0) + 1
            self.last_used[version] = time.time()

    def release(self, version: str | None) -> None:
        """That request ended; an unload waiting for the version's last request is let go."""
        self.in_flight -= 1
        if version is not None:
            left = self.running.get(version, 1) - 1
            if left > 0:
                self.running[version] = left
                return
            self.running.pop(version, None)
            event = self._drained.pop(version, None)
            if event is not None:
                event.set()

    async def drained(self, version: str) -> None:
        """Wait until no request of this gateway runs on `version` here."""
        if self.running.get(version):
            await self._drained.setdefault(version, asyncio.Event()).wait()

    def forget(self, version: str) -> None:
        """The gateway unloads `version` here."""
        self.loaded.discard(version)
        self.last_used.pop(version, None)
        self.load_s.pop(version, None)


@dataclass(frozen=True, slots=True)
class Residency:
    """What this gateway knows of one adapter version on one engine of its base model."""

    engine: int
    """The engine's index among its base model's engines (their URLs are not shown to tenants)."""
    loaded: bool
    last_used: int | None
    """Unix time a request last started on it here."""
    load_s: float | None
    """Seconds its latest load here took."""


class UpstreamPool:
    """The engines serving one base model."""

    def __init__(self, base_model: str, urls: list[str]) -> None:
        self.base_model = base_model
        self.upstreams = [Upstream(u) for u in urls]
        self._turn = itertools.count()

    def candidates(self, adapter: str | None) -> list[Upstream]:
        """Engines in the order to try them for a request (for adapter version `adapter`, or the base model
        when None)."""
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

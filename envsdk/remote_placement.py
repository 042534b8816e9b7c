"""Where a client of the env servers (:mod:`envsdk.remote`) sends a request: the pool's registrations as it
last read them, and the choice among them.

A request goes to the registered, not draining server with the least of the client's own work in flight for
its capacity, ties broken by the load the server last reported (a report is up to a heartbeat old, so it
only breaks ties). With no server registered, a request waits up to ``NO_SERVER_WAIT_S`` for one, reading
the registrations again every ``WATCH_S``, then raises :class:`ServersLost`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from collections.abc import Callable

import redis

from envsdk.errors import SandboxError
from envsdk.remote_wire import Registration, live_servers

logger = logging.getLogger(__name__)

WATCH_S = 0.5
"""How often pending requests are checked against the registrations and their deadlines, and the
registrations read again while a request waits for a server."""
NO_SERVER_WAIT_S = 30.0
"""How long a request waits for a server to register when none is."""


class ServersLost(SandboxError):
    """A request was lost on ``MAX_ATTEMPTS`` servers, or no server is left."""

    def __init__(self, message: str) -> None:
        super().__init__("servers_lost", message)


class Placement:
    """The registrations of pool ``pool`` as organisation ``org``'s client sees them (see the module)."""

    def __init__(self, client: redis.Redis, pool: str, org: str) -> None:
        self.redis = client
        self.pool = pool
        self.org = org
        self._servers: dict[str, Registration] = {}
        self._refreshed_at = 0.0
        self._lock = threading.Lock()

    @property
    def servers(self) -> dict[str, Registration]:
        """The registrations last read, by server id (replaced whole when read again: safe to keep)."""
        with self._lock:
            return self._servers

    def ready(self) -> list[str]:
        """The ids of the registered servers that take new work (not draining)."""
        return [s for s, r in self.servers.items() if not r.draining]

    def slots(self) -> int:
        """The capacity of the servers that take new work (at least 1)."""
        return sum(r.capacity for r in self.servers.values() if not r.draining) or 1

    def refresh(self, max_age_s: float = 0.0) -> None:
        """Read the registrations again (unless read less than ``max_age_s`` ago)."""
        if max_age_s and time.monotonic() - self._refreshed_at < max_age_s:
            return
        self._refreshed_at = time.monotonic()
        try:
            servers = live_servers(self.redis, self.pool, self.org)
        except redis.RedisError as exc:
            logger.warning("env pool %s: cannot read registrations: %s", self.pool, exc)
            return
        with self._lock:
            self._servers = servers

    def pick(
        self, load: Callable[[], Counter[str]], exclude: str | None = None, wait_s: float = NO_SERVER_WAIT_S
    ) -> str:
        """The registered, not draining server with the least of this client's work in flight (``load()``:
        its requests pending by server) for its capacity, then the least load it reported (a report is up
        to a heartbeat old, so it only breaks ties: this client's own requests of a moment ago are in it);
        another than ``exclude`` where there is one; waits up to ``wait_s`` for one to register."""
        deadline = time.monotonic() + wait_s
        while True:
            mine = load()
            with self._lock:
                candidates = [r for r in self._servers.values() if not r.draining and r.id != exclude]
                if not candidates and exclude is not None:
                    candidates = [r for r in self._servers.values() if not r.draining]
            if candidates:
                best = min(candidates, key=lambda r: (mine[r.id] / r.capacity, r.inflight / r.capacity, r.id))
                return best.id
            if time.monotonic() > deadline:
                raise ServersLost(f"no env server is registered in pool {self.pool!r}")
            time.sleep(WATCH_S)
            self.refresh()

"""The requests a client of the env servers (:mod:`envsdk.remote`) has in flight, and the thread that sees
them answered or sends them again.

* Every request has an idempotency key and a deadline, and a future its caller waits on. A reader thread
  collects the replies from the client's reply stream and resolves the futures.
* Every ``WATCH_S`` the reader checks that each request's server is still registered and its deadline not
  passed, and sends the request again to another server otherwise (a result already written counts
  instead). An episode call whose server died fails with :class:`Lost`: its caller has another server
  rebuild the episode first. A request lost ``MAX_ATTEMPTS`` times fails with
  :class:`~envsdk.remote_placement.ServersLost`.
* A server that died while serving the package is counted against the package, across the organisation's
  jobs (:func:`envsdk.remote_wire.record_crash`); at ``CRASH_LIMIT`` within the window the pool refuses the
  package, and everything pending fails with ``package_refused``.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import redis

from envsdk.errors import SandboxError
from envsdk.remote_placement import NO_SERVER_WAIT_S, WATCH_S, Placement, ServersLost
from envsdk.remote_wire import (
    CRASH_LIMIT,
    decode,
    encode,
    get_bytes,
    now,
    read_streams,
    record_crash,
    refused_message,
    requests_key,
    result_key,
)

logger = logging.getLogger(__name__)

MAX_ATTEMPTS = 3
"""Times one request may be lost (its server died, or it passed its deadline) before :class:`ServersLost`."""
EPISODE_CALLS = ("step", "close_episode", "call_tool")
"""Calls in an episode, which its server holds: not sent elsewhere as they are (:class:`Lost`)."""


class Lost(Exception):
    """An episode call's server is gone (the caller replays the episode elsewhere)."""


@dataclass
class Pending:
    """One request sent and not answered yet."""

    request: dict[str, Any]
    server: str
    """Where it was sent last."""
    future: Future[Any]
    attempts: int = 1


class InFlight:
    """The pending requests of one client, its reader thread and the watch (see the module). ``package`` and
    ``name``: the package's hash and its manifest's name, whose crashes the client counts."""

    def __init__(
        self,
        client: redis.Redis,
        placement: Placement,
        *,
        replies: str,
        package: str,
        name: str,
    ) -> None:
        self.redis = client
        self.placement = placement
        self.pool = placement.pool
        self.org = placement.org
        self.replies = replies
        self.package = package
        self.name = name
        self.retries = 0
        """Requests sent again (their server died or their deadline passed)."""
        self.served: Counter[str] = Counter()
        """Results by server id."""
        self.refused: str | None = None
        """Why the pool refuses the package (it took down ``CRASH_LIMIT`` servers), once it does."""
        self._pending: dict[str, Pending] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None

    @property
    def running(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def start(self) -> None:
        """Start the reader thread, unless it runs."""
        if not self.running:
            self._stop.clear()
            self._reader = threading.Thread(target=self._read, name="env-replies", daemon=True)
            self._reader.start()

    def stop(self) -> None:
        """Stop the reader thread and delete the reply stream."""
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
        try:
            self.redis.delete(self.replies)
        except redis.RedisError:
            pass

    def add(self, key: str, request: dict[str, Any], server: str, future: Future[Any]) -> None:
        """Await ``request`` (sent to ``server`` next) under ``key``."""
        with self._lock:
            self._pending[key] = Pending(request, server, future)

    def get(self, key: str) -> Pending | None:
        with self._lock:
            return self._pending.get(key)

    def load(self) -> Counter[str]:
        """The requests pending, by the server they were sent to."""
        with self._lock:
            return Counter(p.server for p in self._pending.values())

    def pick(self, exclude: str | None = None, wait_s: float = NO_SERVER_WAIT_S) -> str:
        """:meth:`Placement.pick` by this client's load."""
        return self.placement.pick(self.load, exclude, wait_s)

    def send(self, request: dict[str, Any], server: str, pipe: Any = None) -> None:
        """Add ``request`` to ``server``'s request stream (in ``pipe`` when given), its deadline from now."""
        request["deadline"] = now() + float(request["allowed_s"])
        (pipe or self.redis).xadd(requests_key(self.pool, self.org, server), {"data": encode(request)})

    # -- the reader thread -------------------------------------------------------------------------
    def _read(self) -> None:
        last_id = "0"
        next_watch = time.monotonic() + WATCH_S
        while not self._stop.is_set():
            try:
                answer = read_streams(self.redis, {self.replies: last_id}, block=int(WATCH_S * 1000))
            except redis.RedisError as exc:
                logger.warning("env pool %s: reading replies failed: %s", self.pool, exc)
                time.sleep(WATCH_S)
                continue
            for _, entries in answer:
                for entry_id, fields in entries:
                    last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    try:
                        self._resolve(fields[b"key"].decode(), decode(fields[b"data"]))
                    except (KeyError, ValueError, UnicodeDecodeError) as exc:  # its request times out
                        logger.warning("env pool %s: malformed reply %s: %s", self.pool, last_id, exc)
            if time.monotonic() >= next_watch:
                next_watch = time.monotonic() + WATCH_S
                try:
                    self._watch()
                except redis.RedisError as exc:
                    logger.warning("env pool %s: watch failed: %s", self.pool, exc)
                except Exception:  # the watch must go on, or a lost request would be waited for forever
                    logger.exception("env pool %s: watch failed", self.pool)

    def _count_crash(self, server: str) -> bool:
        """Count ``server``'s death against the package; at ``CRASH_LIMIT``, fail everything pending with
        ``package_refused`` (True)."""
        crashes = record_crash(self.redis, self.pool, self.org, self.package, server)
        if crashes < CRASH_LIMIT:
            return False
        self.refused = refused_message(self.name, self.package, crashes)
        logger.error("env pool %s: %s", self.pool, self.refused)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.future.set_exception(SandboxError("package_refused", self.refused))
        return True

    def _resolve(self, key: str, answer: dict[str, Any]) -> None:
        with self._lock:
            pending = self._pending.pop(key, None)
        if pending is None:  # answered already: the same result again, from a request sent twice
            return
        self.served[str(answer.get("server"))] += 1
        pending.future.set_result(answer)

    def _watch(self) -> None:
        """Send again each request whose server is gone or whose deadline passed."""
        with self._lock:
            if not self._pending:
                return
        self.placement.refresh()
        servers = self.placement.servers
        with self._lock:
            lost = [
                (key, p)
                for key, p in self._pending.items()
                if p.server not in servers or p.request["deadline"] < now()
            ]
        for key, pending in lost:
            stored = get_bytes(self.redis, result_key(self.pool, self.org, key))
            if stored is not None:
                self._resolve(key, decode(stored))
                continue
            if pending.server not in servers and self._count_crash(pending.server):
                return
            with self._lock:
                if self._pending.get(key) is not pending:
                    continue
                if pending.request["method"] in EPISODE_CALLS:
                    del self._pending[key]  # the episode is replayed by its caller
                    pending.future.set_exception(Lost(key))
                    continue
                if pending.attempts >= MAX_ATTEMPTS:
                    del self._pending[key]
                    pending.future.set_exception(
                        ServersLost(
                            f"package {self.name}: a {pending.request['method']} request was lost "
                            f"on {pending.attempts} env servers (each died or missed its deadline)"
                        )
                    )
                    continue
            try:
                server = self.pick(exclude=pending.server, wait_s=0)
            except ServersLost as exc:  # none registered now: try again at the next watch, for a while
                if pending.request["deadline"] + NO_SERVER_WAIT_S < now():
                    with self._lock:
                        self._pending.pop(key, None)
                    pending.future.set_exception(exc)
                continue
            self.retries += 1
            logger.warning(
                "request %s: env server %s is gone or late; sending it to %s", key, pending.server, server
            )
            pending.server, pending.attempts = server, pending.attempts + 1
            self.send(pending.request, server)

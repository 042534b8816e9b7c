"""The client side of env servers (:mod:`envsdk.server`): :class:`RemoteSandbox` has the calls of
:class:`envsdk.sandbox.Sandbox` that a trainer makes, and serves them on the pool's registered servers.

* ``reward_batch`` is cut into chunks, one per free sandbox of the pool, spread by load and scored at once;
  ``group_reward``'s groups likewise (:meth:`RemoteSandbox.submit` and :meth:`RemoteSandbox.gather` let a
  caller send work and collect it later).
* ``reset`` places an episode on the least loaded server; its ``step`` and ``close_episode`` calls go to the
  same server.
* Every request has an idempotency key and a deadline. A reader thread collects the replies; every
  ``WATCH_S`` it checks that each request's server is still registered and its deadline not passed, and
  sends the request again to another server otherwise (a result already written counts instead). An
  episode whose server died goes on on another one from its last completed turn: that server rebuilds it
  from the episode's state in Redis (``resume``: the task and the completed turns its servers recorded), then
  serves the turn in progress. A request lost ``MAX_ATTEMPTS`` times raises :class:`ServersLost`.
* A server that died while serving the package is counted against the package, across the organisation's
  jobs (:func:`envsdk.remote_wire.record_crash`); at ``CRASH_LIMIT`` within the window the pool refuses the
  package: what is pending fails, and so does every later job's :meth:`RemoteSandbox.start`, with
  ``package_refused`` naming it.
* Every key it uses is in its organisation's namespace (:func:`envsdk.remote_wire.org_key`): the Redis user
  the worker gives a job's trainer reaches nothing else, and servers take the organisation from there.

Errors the sandbox raised on the server come back as the same :class:`~envsdk.errors.SandboxError`.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import math
import tempfile
import threading
import time
import uuid
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from envsdk.errors import SandboxError
from envsdk.manifest import Maxima, load_manifest
from envsdk.remote_wire import (
    CRASH_LIMIT,
    DEFAULT_POOL,
    PACKAGE_TTL_S,
    Registration,
    check_org,
    crash_count,
    decode,
    encode,
    get_bytes,
    live_servers,
    now,
    package_key,
    read_streams,
    record_crash,
    refused_message,
    replies_key,
    requests_key,
    result_key,
)

logger = logging.getLogger(__name__)

WATCH_S = 0.5
"""How often pending requests are checked against the registrations and their deadlines."""
MAX_ATTEMPTS = 3
"""Times one request may be lost (its server died, or it passed its deadline) before :class:`ServersLost`."""
NO_SERVER_WAIT_S = 30.0
"""How long a request waits for a server to register when none is."""
QUEUE_MARGIN_S = 10.0
"""Added to a call's own time limits for its deadline (queueing, a cold sandbox start)."""


class ServersLost(SandboxError):
    """A request was lost on ``MAX_ATTEMPTS`` servers, or no server is left."""

    def __init__(self, message: str) -> None:
        super().__init__("servers_lost", message)


class _Lost(Exception):
    """An episode call's server is gone (the caller replays the episode elsewhere)."""


@dataclass
class _Pending:
    request: dict[str, Any]
    server: str
    future: Future[Any]
    attempts: int = 1


@dataclass
class _Prepared:
    key: str
    future: Future[Any]


@dataclass
class _Episode:
    server: str
    turns: int = 0
    """Completed turns (their messages are in Redis, recorded by the servers that served them)."""


class RemoteSandbox:
    """The job's package served by the pool's env servers, for organisation ``org`` (the namespace its Redis
    user reaches; servers serve an organisation while it has a grant); see the module."""

    def __init__(
        self,
        redis_url: str,
        package_dir: Path,
        *,
        org: str,
        pool: str = DEFAULT_POOL,
        config: dict[str, Any] | None = None,
        maxima: Maxima | None = None,
        job_id: str = "",
    ) -> None:
        from envsdk.archive import pack

        self.redis = redis.Redis.from_url(redis_url)
        self.pool = pool
        self.org = check_org(org)
        self.package_dir = Path(package_dir)
        self.manifest = load_manifest(self.package_dir)
        self.config = {**self.manifest.config, **(config or {})}
        self.limits = self.manifest.limits.capped(maxima or Maxima())
        with tempfile.TemporaryDirectory() as tmp:
            archive, _ = pack(self.package_dir, Path(tmp) / "package.tar.gz")
            self._archive = archive.read_bytes()
        self.package = hashlib.sha256(self._archive).hexdigest()
        self.job_id = job_id
        self.client_id = f"{job_id or 'client'}-{uuid.uuid4().hex[:8]}"
        self.replies = replies_key(pool, self.org, self.client_id)
        self.info: dict[str, Any] = {}
        self.backend = f"env servers of pool {pool!r}"
        """Where it runs, as :attr:`envsdk.sandbox.Sandbox.backend` says it for a local sandbox."""
        self.retries = 0
        """Requests sent again (their server died or their deadline passed)."""
        self.served: Counter[str] = Counter()
        """Results by server id."""
        self._seq = itertools.count()
        self._episode_seq = itertools.count()
        self._pending: dict[str, _Pending] = {}
        self._episodes: dict[str, _Episode] = {}
        self._servers: dict[str, Registration] = {}
        self._refreshed_at = 0.0
        self._lock = threading.Lock()
        self._refused: str | None = None
        """Why the pool refuses the package (it took down ``CRASH_LIMIT`` servers), once it does."""
        self._stop = threading.Event()
        self._reader: threading.Thread | None = None

    # -- the Sandbox interface ---------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._reader is not None and self._reader.is_alive()

    def start(self) -> dict[str, Any]:
        """Store the package, start it on every registered server (warm) and return ``describe``'s info;
        ``package_refused`` at once when the pool refuses the package."""
        crashes = crash_count(self.redis, self.pool, self.org, self.package)
        if crashes >= CRASH_LIMIT:
            raise SandboxError("package_refused", refused_message(self.manifest.name, self.package, crashes))
        self.redis.set(package_key(self.pool, self.org, self.package), self._archive, ex=PACKAGE_TTL_S)
        if not self.running:
            self._stop.clear()
            self._reader = threading.Thread(target=self._read, name="env-replies", daemon=True)
            self._reader.start()
        self._refresh()
        servers: list[str | None] = [s for s, r in self._servers.items() if not r.draining] or [None]
        futures = [self.submit("start", {}, server=s) for s in servers]
        self.info = dict(self.gather(futures)[0])
        return self.info

    def close(self) -> None:
        self._stop.set()
        if self._reader is not None:
            self._reader.join(timeout=5)
        try:
            self.redis.delete(self.replies)
        except redis.RedisError:
            pass

    def call(self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        params = dict(params or {})
        if method == "reward_batch":
            return self.reward_batch(list(params.get("items") or []))
        if method == "reset":
            return self._reset(params)
        if method in ("step", "close_episode", "call_tool") and params.get("episode_id") in self._episodes:
            return self._episode_call(method, params)
        return self.gather([self.submit(method, params)])[0]

    def call_many(self, method: str, each: list[dict[str, Any]]) -> list[Any]:
        """``method`` once per params of ``each``, all at once over the pool (``group_reward``'s groups)."""
        return self.gather(self.submit_many(method, each))

    def reward_batch(self, items: list[dict[str, Any]]) -> list[dict[str, Any]]:
        """Score ``items`` in chunks on every free sandbox of the pool at once."""
        results: list[dict[str, Any]] = []
        for chunk in self.gather(self.submit_reward_batch(items)):
            results += chunk
        return results

    def submit_reward_batch(self, items: list[dict[str, Any]]) -> list[Future[Any]]:
        """Send ``items``' chunks; :meth:`gather` their futures for the rewards, in order."""
        if not items:
            return []
        self._refresh(max_age_s=WATCH_S)
        slots = sum(r.capacity for r in self._servers.values() if not r.draining) or 1
        size = math.ceil(len(items) / min(len(items), slots))
        return self.submit_many(
            "reward_batch", [{"items": items[i : i + size]} for i in range(0, len(items), size)]
        )

    # -- requests ----------------------------------------------------------------------------------
    def submit(
        self,
        method: str,
        params: dict[str, Any],
        *,
        server: str | None = None,
        key: str | None = None,
        turn: int | None = None,
    ) -> Future[Any]:
        """Send one request (to ``server``, else the least loaded one); its future holds the result. ``turn``:
        a step's index in its episode (the server records the completed turn under it)."""
        return self.submit_many(method, [params], server=server, key=key, turn=turn)[0]

    def submit_many(
        self,
        method: str,
        each: list[dict[str, Any]],
        *,
        server: str | None = None,
        key: str | None = None,
        turn: int | None = None,
    ) -> list[Future[Any]]:
        """:meth:`submit` once per params of ``each``, in one Redis round trip (``key``: with one only)."""
        futures = [self._prepare(method, params, server, key, turn) for params in each]
        sends = [(p.request, p.server) for p in (self._pending.get(f.key) for f in futures) if p is not None]
        if sends:
            pipe = self.redis.pipeline(transaction=False)
            for request, target in sends:
                self._send(request, target, pipe)
            pipe.execute()
        return [f.future for f in futures]

    def _prepare(
        self, method: str, params: dict[str, Any], server: str | None, key: str | None, turn: int | None
    ) -> _Prepared:
        future: Future[Any] = Future()
        key = key or f"{self.client_id}:{next(self._seq)}"
        if self._refused is not None:
            future.set_exception(SandboxError("package_refused", self._refused))
            return _Prepared(key, future)
        allowed = self.limits.timeout_s + self.limits.startup_timeout_s + QUEUE_MARGIN_S
        request = {
            "key": key,
            "method": method,
            "params": params,
            "package": self.package,
            "name": self.manifest.name,
            "config": self.config,
            "client": self.client_id,
            "job": self.job_id,
            "allowed_s": allowed,
            "turn": turn,
            "deadline": now() + allowed,
        }
        target = server or self._pick()
        with self._lock:
            self._pending[key] = _Pending(request, target, future)
        return _Prepared(key, future)

    def gather(self, futures: list[Future[Any]]) -> list[Any]:
        """The results of ``futures`` in order; the first error raises."""
        return [self._result(f.result()) for f in futures]

    @staticmethod
    def _result(answer: dict[str, Any]) -> Any:
        error = answer.get("error")
        if error:
            raise SandboxError(str(error.get("code") or "remote_error"), str(error.get("message") or "error"))
        return answer.get("result")

    def _send(self, request: dict[str, Any], server: str, pipe: Any = None) -> None:
        request["deadline"] = now() + float(request["allowed_s"])
        (pipe or self.redis).xadd(requests_key(self.pool, self.org, server), {"data": encode(request)})

    def _refresh(self, max_age_s: float = 0.0) -> None:
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

    def _pick(self, exclude: str | None = None, wait_s: float = NO_SERVER_WAIT_S) -> str:
        """The registered, not draining server with the least of this client's work in flight for its
        capacity, then the least load it reported (a report is up to a heartbeat old, so it only breaks
        ties: this client's own requests of a moment ago are in it); waits up to ``wait_s`` for one to
        register."""
        deadline = time.monotonic() + wait_s
        while True:
            with self._lock:
                mine = Counter(p.server for p in self._pending.values())
                candidates = [r for r in self._servers.values() if not r.draining and r.id != exclude]
                if not candidates and exclude is not None:
                    candidates = [r for r in self._servers.values() if not r.draining]
                if candidates:
                    best = min(
                        candidates, key=lambda r: (mine[r.id] / r.capacity, r.inflight / r.capacity, r.id)
                    )
                    return best.id
            if time.monotonic() > deadline:
                raise ServersLost(f"no env server is registered in pool {self.pool!r}")
            time.sleep(WATCH_S)
            self._refresh()

    # -- episodes ----------------------------------------------------------------------------------
    def _reset(self, params: dict[str, Any]) -> Any:
        episode = str(params.get("episode_id") or f"{self.client_id}-e{next(self._episode_seq)}")
        params = {**params, "episode_id": episode}
        future = self.submit("reset", params)
        answer = future.result()
        result = self._result(answer)
        self._episodes[episode] = _Episode(str(answer.get("server")))
        return result

    def _episode_call(self, method: str, params: dict[str, Any]) -> Any:
        episode_id = str(params["episode_id"])
        episode = self._episodes[episode_id]
        key = f"{self.client_id}:{episode_id}:{method}:{episode.turns}"
        turn = episode.turns if method == "step" else None
        for attempt in range(MAX_ATTEMPTS):
            try:
                answer = self.submit(method, params, server=episode.server, key=key, turn=turn).result()
                break
            except _Lost:
                self.retries += 1
                self._resume(episode_id, episode, attempt)
        else:
            raise ServersLost(f"episode {episode_id} lost its env server {MAX_ATTEMPTS} times")
        result = self._result(answer)
        if method == "step":
            episode.turns += 1
            if (result or {}).get("done"):
                self._episodes.pop(episode_id, None)
        elif method == "close_episode":
            self._episodes.pop(episode_id, None)
        return result

    def _resume(self, episode_id: str, episode: _Episode, attempt: int) -> None:
        """Have another server rebuild the episode from its state in Redis (its last completed turn)."""
        self._refresh()
        server = self._pick(exclude=episode.server)
        logger.warning(
            "episode %s: env server %s is gone; resuming it on %s", episode_id, episode.server, server
        )
        key = f"{self.client_id}:{episode_id}:resume{attempt}:{episode.turns}"
        self._result(self.submit("resume", {"episode_id": episode_id}, server=server, key=key).result())
        episode.server = server

    # -- replies and the watch ---------------------------------------------------------------------
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
        self._refused = refused_message(self.manifest.name, self.package, crashes)
        logger.error("env pool %s: %s", self.pool, self._refused)
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        for p in pending:
            p.future.set_exception(SandboxError("package_refused", self._refused))
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
        self._refresh()
        with self._lock:
            lost = [
                (key, p)
                for key, p in self._pending.items()
                if p.server not in self._servers or p.request["deadline"] < now()
            ]
        for key, pending in lost:
            stored = get_bytes(self.redis, result_key(self.pool, self.org, key))
            if stored is not None:
                self._resolve(key, decode(stored))
                continue
            if pending.server not in self._servers and self._count_crash(pending.server):
                return
            with self._lock:
                if self._pending.get(key) is not pending:
                    continue
                if pending.request["method"] in ("step", "close_episode", "call_tool"):
                    del self._pending[key]  # the episode is replayed by its caller
                    pending.future.set_exception(_Lost(key))
                    continue
                if pending.attempts >= MAX_ATTEMPTS:
                    del self._pending[key]
                    pending.future.set_exception(
                        ServersLost(
                            f"package {self.manifest.name}: a {pending.request['method']} request was lost "
                            f"on {pending.attempts} env servers (each died or missed its deadline)"
                        )
                    )
                    continue
            try:
                server = self._pick(exclude=pending.server, wait_s=0)
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
            self._send(pending.request, server)

"""The client side of env servers (:mod:`envsdk.server`): :class:`RemoteSandbox` has the calls of
:class:`envsdk.sandbox.Sandbox` that a trainer makes, and serves them on the pool's registered servers.

* ``reward_batch`` is cut into chunks, one per free sandbox of the pool, spread by load and scored at once;
  ``group_reward``'s groups likewise (:meth:`RemoteSandbox.submit` and :meth:`RemoteSandbox.gather` let a
  caller send work and collect it later).
* ``reset`` places an episode on the least loaded server; its ``step`` and ``close_episode`` calls go to the
  same server.
* Every request has an idempotency key and a deadline. A reader thread collects the replies, and sends a
  request again to another server when its server is gone or its deadline passed
  (:mod:`envsdk.remote_inflight`); where each request goes is :mod:`envsdk.remote_placement`. An
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
import uuid
from collections import Counter
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis

from envsdk.errors import SandboxError
from envsdk.manifest import Maxima, load_manifest
from envsdk.remote_inflight import EPISODE_CALLS, MAX_ATTEMPTS, InFlight, Lost
from envsdk.remote_placement import WATCH_S, Placement, ServersLost
from envsdk.remote_wire import (
    CRASH_LIMIT,
    DEFAULT_POOL,
    PACKAGE_TTL_S,
    check_org,
    crash_count,
    now,
    package_key,
    refused_message,
    replies_key,
)

logger = logging.getLogger(__name__)

QUEUE_MARGIN_S = 10.0
"""Added to a call's own time limits for its deadline (queueing, a cold sandbox start)."""


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
        self._seq = itertools.count()
        self._episode_seq = itertools.count()
        self._episodes: dict[str, _Episode] = {}
        self._placement = Placement(self.redis, pool, self.org)
        self._inflight = InFlight(
            self.redis, self._placement, replies=self.replies, package=self.package, name=self.manifest.name
        )

    @property
    def retries(self) -> int:
        """Requests sent again (their server died or their deadline passed)."""
        return self._inflight.retries

    @property
    def served(self) -> Counter[str]:
        """Results by server id."""
        return self._inflight.served

    # -- the Sandbox interface ---------------------------------------------------------------------
    @property
    def running(self) -> bool:
        return self._inflight.running

    def start(self) -> dict[str, Any]:
        """Store the package, start it on every registered server (warm) and return ``describe``'s info;
        ``package_refused`` at once when the pool refuses the package."""
        crashes = crash_count(self.redis, self.pool, self.org, self.package)
        if crashes >= CRASH_LIMIT:
            raise SandboxError("package_refused", refused_message(self.manifest.name, self.package, crashes))
        self.redis.set(package_key(self.pool, self.org, self.package), self._archive, ex=PACKAGE_TTL_S)
        self._inflight.start()
        self._placement.refresh()
        servers: list[str | None] = [*self._placement.ready()] or [None]
        futures = [self.submit("start", {}, server=s) for s in servers]
        self.info = dict(self.gather(futures)[0])
        return self.info

    def close(self) -> None:
        self._inflight.stop()

    def call(self, method: str, params: dict[str, Any] | None = None, *, timeout: float | None = None) -> Any:
        params = dict(params or {})
        if method == "reward_batch":
            return self.reward_batch(list(params.get("items") or []))
        if method == "reset":
            return self._reset(params)
        if method in EPISODE_CALLS and params.get("episode_id") in self._episodes:
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
        self._placement.refresh(max_age_s=WATCH_S)
        slots = self._placement.slots()
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
        sends = [(p.request, p.server) for p in (self._inflight.get(f.key) for f in futures) if p is not None]
        if sends:
            pipe = self.redis.pipeline(transaction=False)
            for request, target in sends:
                self._inflight.send(request, target, pipe)
            pipe.execute()
        return [f.future for f in futures]

    def _prepare(
        self, method: str, params: dict[str, Any], server: str | None, key: str | None, turn: int | None
    ) -> _Prepared:
        future: Future[Any] = Future()
        key = key or f"{self.client_id}:{next(self._seq)}"
        if self._inflight.refused is not None:
            future.set_exception(SandboxError("package_refused", self._inflight.refused))
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
        self._inflight.add(key, request, server or self._inflight.pick(), future)
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
            except Lost:
                self._inflight.retries += 1
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
        self._placement.refresh()
        server = self._inflight.pick(exclude=episode.server)
        logger.warning(
            "episode %s: env server %s is gone; resuming it on %s", episode_id, episode.server, server
        )
        key = f"{self.client_id}:{episode_id}:resume{attempt}:{episode.turns}"
        self._result(self.submit("resume", {"episode_id": episode_id}, server=server, key=key).result())
        episode.server = server

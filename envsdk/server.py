"""``tunegate env-server``: a process hosting sandboxed environments for the trainers of a pool.

It serves the calls a trainer makes of its environment (``start``, ``reward_batch``, ``group_reward``,
``reset``, ``step``, ``close_episode``) for many jobs and episodes at once, each in the same bubblewrap
sandbox as a trainer's own (:class:`envsdk.sandbox.Sandbox`), over Redis Streams (:mod:`envsdk.remote_wire`
has the key layout):

* It registers itself (capacity, in-flight, packages warm) with a TTL its heartbeat refreshes, so clients find
  it with nothing configured but Redis and the pool's name; and again in the namespace of every organisation
  with a grant (a running environment job: the worker writes it), where that organisation's trainers read it.
* It reads its own request stream in each of those namespaces, at most ``capacity`` requests at a time. The
  organisation of a request is the namespace it was read from, which only that organisation's trainers can
  write (their Redis user reaches nothing else); nothing in the request names it. Each organisation's
  package (and config) gets up to ``capacity`` sandboxes, started on demand and kept warm, never shared with
  another organisation, even for the same package: a package keeps what it saw in its process's memory. A
  multi-turn episode stays in the sandbox that ``reset`` it until it is done or closed
  (:mod:`envsdk.warm` keeps them).
* A request past its deadline is dropped (its client has sent it elsewhere). A result is written once under
  the request's idempotency key (``SET NX``, in the organisation's namespace) and only then answered, so a
  request served twice counts once.
* SIGTERM drains: it says so in its registration (clients send it nothing new), serves what was sent to it
  and the episodes it holds, then deregisters and stops its sandboxes. A second SIGTERM stops it at once.

It is stateless apart from the episodes it holds, and what of those must outlive it is in Redis: each reset's
task and each completed turn, written with the result that served it. When a server dies, a client sends its
open episodes' next call elsewhere after a ``resume``, which rebuilds the episode there from Redis. A package
whose requests took down ``CRASH_LIMIT`` servers in ``CRASH_WINDOW_S`` is refused (``package_refused``) to the
organisation whose trainers counted the deaths.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, cast

import redis
from prometheus_client import Counter, Gauge, Histogram, start_http_server

from envsdk.errors import EnvSDKError, SandboxError
from envsdk.manifest import Maxima
from envsdk.remote_wire import (
    CRASH_LIMIT,
    CRASH_WINDOW_S,
    DEFAULT_POOL,
    REGISTRATION_TTL_S,
    RESULT_TTL_S,
    Registration,
    crashes_key,
    decode,
    deregister,
    encode,
    episode_state,
    get_bytes,
    live_orgs,
    now,
    read_streams,
    record_reset,
    record_turn,
    refused_message,
    register,
    replies_key,
    requests_key,
    result_key,
    served_key,
)
from envsdk.sandbox import Sandbox
from envsdk.warm import WarmSandboxes

logger = logging.getLogger(__name__)

INFLIGHT = Gauge("tunegate_envserver_inflight", "Requests being served")
EPISODES = Gauge("tunegate_envserver_open_episodes", "Multi-turn episodes held open")
QUEUE = Gauge("tunegate_envserver_queue_depth", "Requests waiting in this server's stream")
LATENCY = Histogram(
    "tunegate_envserver_request_seconds",
    "Time to serve one request, by method",
    ["method"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60),
)
REQUESTS = Counter(
    "tunegate_envserver_requests_total",
    "Requests by method and outcome (ok, error, expired, duplicate)",
    ["method", "outcome"],
)
DRAIN_TIMEOUT_S = 120.0
"""Longest a draining server waits for its episodes before it stops anyway."""


class EnvServer:
    """One env server (see the module). ``serve()`` runs it until SIGTERM."""

    def __init__(
        self,
        redis_url: str,
        *,
        pool: str = DEFAULT_POOL,
        capacity: int = 4,
        data_dir: Path,
        maxima: Maxima | None = None,
        allow_unsandboxed: bool = False,
        server_id: str | None = None,
    ) -> None:
        self.redis = redis.Redis.from_url(redis_url)
        self.pool = pool
        self.capacity = max(1, capacity)
        self.data_dir = Path(data_dir)
        self.maxima = maxima or Maxima()
        self.allow_unsandboxed = allow_unsandboxed
        self.id = server_id or f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self._lock = threading.Condition()
        self._inflight = 0
        self._orgs: list[str] = []
        """The organisations served now (those with a live grant), in the order their streams are read."""
        self._last: dict[str, str] = {}
        """Organisation -> the last entry read from its request stream (kept while the server lives: an
        organisation served again goes on from there, so no entry in flight is read twice)."""
        self._sandboxes = WarmSandboxes(
            self.redis,
            pool=self.pool,
            capacity=self.capacity,
            data_dir=self.data_dir,
            maxima=self.maxima,
            allow_unsandboxed=self.allow_unsandboxed,
        )
        self._stopping = threading.Event()
        self._draining = threading.Event()
        self._executor = ThreadPoolExecutor(max_workers=self.capacity, thread_name_prefix="env")

    # -- registration ------------------------------------------------------------------------------
    def registration(self) -> Registration:
        with self._lock:
            inflight = self._inflight
        return Registration(
            id=self.id,
            capacity=self.capacity,
            inflight=inflight,
            host=socket.gethostname(),
            pid=os.getpid(),
            packages=self._sandboxes.packages(),
            draining=self._draining.is_set(),
            started_at=self._started,
        )

    def _register(self) -> None:
        """Register in the pool and in the namespace of each organisation served, which sees its own
        packages only (a package's hash is all another organisation would need to run it)."""
        with self._lock:
            served = list(self._orgs)
        orgs = {org: self._sandboxes.packages(org) for org in served}
        register(self.redis, self.pool, self.registration(), orgs)

    def _refresh_orgs(self) -> None:
        """Read the grants: the organisations to serve (a new one's stream is read from its start)."""
        served = live_orgs(self.redis, self.pool)
        with self._lock:
            kept = [org for org in self._orgs if org in served]
            self._orgs = kept + sorted(served - set(kept))
            for org in self._orgs:
                self._last.setdefault(org, "0")

    def _heartbeat(self) -> None:
        while not self._stopping.is_set():
            try:
                self._refresh_orgs()
                self._register()
                with self._lock:
                    streams = [requests_key(self.pool, org, self.id) for org in self._orgs]
                pipe = self.redis.pipeline(transaction=False)
                for stream in streams:
                    pipe.expire(stream, int(RESULT_TTL_S))
                    pipe.xlen(stream)
                answers = pipe.execute(raise_on_error=False)
                QUEUE.set(sum(a for a in answers[1::2] if isinstance(a, int)))
            except redis.RedisError as exc:
                logger.warning("env server %s: heartbeat failed: %s", self.id, exc)
            self._sandboxes.stop_idle()
            self._stopping.wait(REGISTRATION_TTL_S / 3)

    # -- main loop ---------------------------------------------------------------------------------
    def serve(self) -> None:
        """Register, serve until SIGTERM, drain, deregister."""
        self._started = now()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._refresh_orgs()
        self._register()
        beat = threading.Thread(target=self._heartbeat, name="heartbeat", daemon=True)
        beat.start()
        logger.info("env server %s serving pool %r with capacity %d", self.id, self.pool, self.capacity)
        idle_since: float | None = None
        drain_started = 0.0
        try:
            while True:
                if self._draining.is_set():
                    drain_started = drain_started or time.monotonic()
                    if self._drained(idle_since) or time.monotonic() - drain_started > DRAIN_TIMEOUT_S:
                        break
                with self._lock:
                    while self._inflight >= self.capacity:
                        self._lock.wait(0.1)
                    free = self.capacity - self._inflight
                    streams = {requests_key(self.pool, o, self.id): o for o in self._orgs}
                    if len(self._orgs) > 1:  # the next read starts with the next organisation's stream
                        self._orgs.append(self._orgs.pop(0))
                    cursors = {stream: self._last[org] for stream, org in streams.items()}
                if not streams:
                    idle_since = idle_since or time.monotonic()
                    self._stopping.wait(0.25)
                    continue
                try:
                    answer = read_streams(self.redis, cursors, count=free, block=250)
                except redis.RedisError as exc:
                    logger.warning("env server %s: reading requests failed: %s", self.id, exc)
                    time.sleep(0.5)
                    continue
                entries = [
                    (streams[stream.decode() if isinstance(stream, bytes) else stream], entry)
                    for stream, batch in answer
                    for entry in batch
                ][:free]  # each stream answers up to ``free``: the rest is read again next time
                idle_since = (idle_since or time.monotonic()) if not entries else None
                for org, (entry_id, fields) in entries:
                    last_id = entry_id.decode() if isinstance(entry_id, bytes) else entry_id
                    with self._lock:
                        self._last[org] = last_id
                        self._inflight += 1
                        INFLIGHT.set(self._inflight)
                    self._executor.submit(self._serve_one, org, last_id, fields)
        finally:
            self._stopping.set()
            self._executor.shutdown(wait=True)
            # a heartbeat caught mid-write would register the server again after it deregistered
            beat.join(timeout=REGISTRATION_TTL_S)
            try:
                with self._lock:
                    orgs = sorted(set(self._last))
                deregister(self.redis, self.pool, self.id, orgs)
            except redis.RedisError as exc:
                logger.warning("env server %s: could not deregister: %s", self.id, exc)
            self._sandboxes.close()
            logger.info("env server %s stopped", self.id)

    def _drained(self, idle_since: float | None) -> bool:
        with self._lock:
            inflight = self._inflight
        busy = inflight or self._sandboxes.open_episodes()
        return not busy and idle_since is not None and time.monotonic() - idle_since >= 1.0

    def drain(self) -> None:
        """Stop taking new work (clients see ``draining``), finish what it holds, then stop."""
        if self._draining.is_set():
            raise KeyboardInterrupt
        logger.info("env server %s draining", self.id)
        self._draining.set()
        try:
            self._register()
        except redis.RedisError:
            pass

    def install_signals(self) -> None:
        signal.signal(signal.SIGTERM, lambda *_: self.drain())
        signal.signal(signal.SIGINT, lambda *_: self.drain())

    # -- one request -------------------------------------------------------------------------------
    def _serve_one(self, org: str, entry_id: str, fields: dict[bytes, bytes]) -> None:
        """Serve one request of ``org`` (the namespace of the stream it came from)."""
        method = "unknown"
        started = time.monotonic()
        try:
            request = decode(fields[b"data"])
            method = str(request.get("method"))
            self._answer(org, request, method)
        except Exception:
            logger.exception("env server %s: request %s failed", self.id, entry_id)
            REQUESTS.labels(method, "error").inc()
        finally:
            LATENCY.labels(method).observe(time.monotonic() - started)
            EPISODES.set(self._sandboxes.open_episodes())
            with self._lock:
                self._inflight -= 1
                INFLIGHT.set(self._inflight)
                self._lock.notify_all()
            try:
                self.redis.xdel(requests_key(self.pool, org, self.id), entry_id)
            except redis.RedisError:
                pass

    def _answer(self, org: str, request: dict[str, Any], method: str) -> None:
        """Serve ``request`` and answer it; every key it touches is in ``org``'s namespace, whatever the
        request names."""
        key = str(request["key"])
        stored_at = result_key(self.pool, org, key)
        sha256 = str(request["package"])
        check = self.redis.pipeline(transaction=False)
        check.get(stored_at)
        check.zcount(crashes_key(self.pool, org, sha256), now() - CRASH_WINDOW_S, "+inf")
        stored, crashes = cast(list[Any], check.execute())
        if stored is not None:  # served already (by this server or another): answer the same again
            REQUESTS.labels(method, "duplicate").inc()
            self._reply(org, request, key, stored.decode())
            return
        if float(request.get("deadline") or 0) < now():
            REQUESTS.labels(method, "expired").inc()
            return
        try:
            if int(crashes) >= CRASH_LIMIT:  # the package took down too many servers: refused
                raise SandboxError(
                    "package_refused", refused_message(str(request.get("name")), sha256, crashes)
                )
            result: dict[str, Any] = {"result": self._call(org, request, method), "server": self.id}
            REQUESTS.labels(method, "ok").inc()
        except EnvSDKError as exc:
            result = {"error": {"code": exc.code, "message": exc.message}, "server": self.id}
            REQUESTS.labels(method, "error").inc()
        payload = encode(result)
        pipe = self.redis.pipeline(transaction=True)
        pipe.set(stored_at, payload, nx=True, ex=RESULT_TTL_S)
        params, job = request.get("params") or {}, str(request.get("job") or "")
        episode = str(params.get("episode_id"))
        if "result" in result and method == "reset":  # the episode's state outlives this server
            record_reset(pipe, self.pool, org, job, episode, dict(params.get("task") or {}))
        elif "result" in result and method == "step" and request.get("turn") is not None:
            turn, message = int(request["turn"]), dict(params.get("assistant_message") or {})
            record_turn(pipe, self.pool, org, job, episode, turn, message)
        if job:
            served = served_key(self.pool, org, job)
            pipe.hsetnx(served, key, encode({"server": self.id, "method": method, "items": _items(request)}))
            pipe.expire(served, RESULT_TTL_S)
        written = pipe.execute()[0]
        if not written:  # another server's answer counted first: send that one
            REQUESTS.labels(method, "duplicate").inc()
            payload = (get_bytes(self.redis, stored_at) or payload.encode()).decode()
        self._reply(org, request, key, payload)

    def _reply(self, org: str, request: dict[str, Any], key: str, payload: str) -> None:
        """Answer on the reply stream of the request's client, in ``org``'s namespace."""
        stream = replies_key(self.pool, org, str(request["client"]))
        pipe = self.redis.pipeline(transaction=False)
        pipe.xadd(stream, {"key": key, "data": payload}, maxlen=10000, approximate=True)
        pipe.expire(stream, RESULT_TTL_S)
        pipe.execute()

    def _call(self, org: str, request: dict[str, Any], method: str) -> Any:
        warm = self._sandboxes.warm_for(org, str(request["package"]), dict(request.get("config") or {}))
        params = dict(request.get("params") or {})
        episode = str(params["episode_id"]) if params.get("episode_id") is not None else None
        index, slot = self._sandboxes.acquire(warm, episode if method not in ("reset", "resume") else None)
        try:
            if not slot.sandbox.running:
                try:
                    slot.sandbox.start()
                except SandboxError as exc:
                    raise SandboxError(exc.code, f"start failed: {exc.message}") from None
            if method == "start":
                return slot.sandbox.info
            try:
                if method == "resume":
                    result = self._resume(org, slot.sandbox, str(request.get("job") or ""), str(episode))
                else:
                    result = slot.sandbox.call(method, params)
            except SandboxError:
                self._sandboxes.forget_slot_episodes(warm, index)
                raise
            if method in ("reset", "resume"):
                self._sandboxes.hold(warm, str(result["episode_id"]), index)
            elif episode is not None and (method == "close_episode" or (result or {}).get("done")):
                self._sandboxes.end(warm, episode)
            return result
        finally:
            self._sandboxes.release(slot)

    def _resume(self, org: str, sandbox: Sandbox, job: str, episode: str) -> dict[str, Any]:
        """Rebuild an episode whose server died from its state in Redis (``org``'s): ``reset`` with its task,
        then its completed turns in order (recorded already: nothing is written again)."""
        task, turns = episode_state(self.redis, self.pool, org, job, episode)
        if task is None:
            raise SandboxError(
                "episode_lost", f"episode {episode} has no state in Redis (expired or never reset)"
            )
        sandbox.call("reset", {"task": task, "episode_id": episode})
        for message in turns:
            sandbox.call("step", {"episode_id": episode, "assistant_message": message})
        return {"episode_id": episode, "turns": len(turns)}


def _items(request: dict[str, Any]) -> int:
    """Completions a request scores (1 for the calls of an episode)."""
    params = request.get("params") or {}
    return len(params.get("items") or params.get("completions") or [None])


def run_env_server(
    redis_url: str,
    *,
    pool: str,
    capacity: int,
    data_dir: Path,
    maxima: Maxima | None = None,
    allow_unsandboxed: bool = False,
    metrics_port: int | None = None,
) -> None:
    """Run an env server in the foreground until SIGTERM (``tunegate env-server``)."""
    if metrics_port:
        start_http_server(metrics_port)
    server = EnvServer(
        redis_url,
        pool=pool,
        capacity=capacity,
        data_dir=data_dir,
        maxima=maxima,
        allow_unsandboxed=allow_unsandboxed,
    )
    server.install_signals()
    try:
        server.serve()
    except KeyboardInterrupt:
        logger.warning("env server %s stopped without draining", server.id)

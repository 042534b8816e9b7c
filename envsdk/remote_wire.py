"""What env servers (:mod:`envsdk.server`) and their clients (:mod:`envsdk.remote`) share in Redis.

All keys live under ``tunegate:envpool:<pool>:`` (a pool is a name; every server and client of one pool
names the same one, ``default`` unless the operator says otherwise):

* ``servers`` -- a set of server ids; ``server:<id>`` -- that server's registration (JSON: id, host, pid,
  capacity, in-flight, packages warm, draining), written with a TTL that its heartbeat refreshes. A server
  whose registration expired is gone: its requests are sent again elsewhere.
* ``requests:<id>`` -- the server's request stream (``XADD`` by clients, read by that server alone, so a
  client chooses where each request runs: by load, and an episode's calls on the server holding it).
* ``replies:<client>`` -- a client's reply stream.
* ``result:<key>`` -- a request's result, written once (``SET NX``) under its idempotency key: a request
  sent twice (its server died, or its deadline passed) counts once, whichever server answers first.
* ``served:<job>`` -- a hash, idempotency key -> the server whose result counted, the method and the number
  of completions it scored (what served what).
* ``episode:<job>:<episode>`` -- an open episode's state, the part that must outlive its server: ``task``
  (what ``reset`` was given) and one field per completed turn (``0``, ``1``, ...: the assistant message that
  ``step`` answered), each written once (``HSETNX``) by the server that served it, in the transaction that
  stores the result; kept ``EPISODE_TTL_S``. A server taking over an episode whose server died rebuilds it
  from these (``resume``: ``reset`` with the task, then the turns in order) and records nothing new.
* ``crashes:<sha256>`` -- a sorted set of the servers that died while serving the package (member: the server
  id, so clients that saw the same death count it once; score: when), over the last ``CRASH_WINDOW_S``. At
  ``CRASH_LIMIT`` servers refuse the package and its clients fail at once (``package_refused``).

Packages are content-addressed: a client stores the package's reproducible archive
(:func:`envsdk.archive.pack`) under ``tunegate:envpool:package:<sha256>`` and requests name the hash; a
server fetches, checks and unpacks it once.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any, cast

import redis

PREFIX = "tunegate:envpool"
DEFAULT_POOL = "default"
REGISTRATION_TTL_S = 3.0
"""Life of a registration between heartbeats (a server beats every third of it)."""
RESULT_TTL_S = 900
"""How long a result (and so its idempotency key) is kept."""
PACKAGE_TTL_S = 7 * 24 * 3600
"""How long a package archive stays in Redis after the last job that stored it."""
EPISODE_TTL_S = 3600
"""How long an episode's state is kept after its last turn."""
CRASH_WINDOW_S = 600.0
"""The window over which servers that died serving a package are counted."""
CRASH_LIMIT = 3
"""Servers dead while serving a package, within ``CRASH_WINDOW_S``, at which the pool refuses it."""


def pool_key(pool: str, *parts: str) -> str:
    return ":".join((PREFIX, pool, *parts))


def package_key(sha256: str) -> str:
    return f"{PREFIX}:package:{sha256}"


def encode(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"))


def decode(raw: bytes | str) -> Any:
    return json.loads(raw)


@dataclass
class Registration:
    """One env server as it registered itself."""

    id: str
    capacity: int
    inflight: int = 0
    host: str = ""
    pid: int = 0
    packages: list[str] = field(default_factory=list)
    draining: bool = False
    started_at: float = 0.0

    @property
    def free(self) -> int:
        return max(0, self.capacity - self.inflight)

    def to_json(self) -> str:
        return encode(self.__dict__)

    @classmethod
    def from_json(cls, raw: bytes | str) -> Registration:
        data = decode(raw)
        known = {k: v for k, v in data.items() if k in cls.__dataclass_fields__}
        return cls(**known)


def register(client: redis.Redis, pool: str, registration: Registration) -> None:
    """Write (or refresh) a registration and keep its id in the pool's set."""
    pipe = client.pipeline(transaction=False)
    pipe.set(
        pool_key(pool, "server", registration.id), registration.to_json(), px=int(REGISTRATION_TTL_S * 1000)
    )
    pipe.sadd(pool_key(pool, "servers"), registration.id)
    pipe.execute()


def deregister(client: redis.Redis, pool: str, server_id: str) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.delete(pool_key(pool, "server", server_id))
    pipe.srem(pool_key(pool, "servers"), server_id)
    pipe.execute()


def live_servers(client: redis.Redis, pool: str) -> dict[str, Registration]:
    """The pool's registered servers by id (ids whose registration expired are dropped from the set)."""
    ids = sorted(
        x.decode() if isinstance(x, bytes) else str(x)
        for x in cast(set[bytes], client.smembers(pool_key(pool, "servers")))
    )
    if not ids:
        return {}
    raws = cast(list[bytes | None], client.mget([pool_key(pool, "server", i) for i in ids]))
    found: dict[str, Registration] = {}
    gone: list[str] = []
    for server_id, raw in zip(ids, raws, strict=True):
        if raw is None:
            gone.append(server_id)
        else:
            found[server_id] = Registration.from_json(raw)
    if gone:
        client.srem(pool_key(pool, "servers"), *gone)
    return found


def get_bytes(client: redis.Redis, key: str) -> bytes | None:
    """``GET`` (the client's answers are bytes)."""
    return cast(bytes | None, client.get(key))


def read_streams(
    client: redis.Redis, streams: dict[str, str], *, count: int | None = None, block: int
) -> list[Any]:
    """``XREAD``: ``[(stream, [(entry id, fields), ...]), ...]``."""
    return cast(list[Any], cast(Any, client).xread(streams, count=count, block=block))


def now() -> float:
    """Wall-clock seconds: deadlines travel between machines (their clocks are assumed synchronised)."""
    return time.time()


def episode_key(pool: str, job: str, episode: str) -> str:
    return pool_key(pool, "episode", job or "-", episode)


def record_reset(pipe: Any, pool: str, job: str, episode: str, task: dict[str, Any]) -> None:
    """Queue on ``pipe`` the write of an episode's task (once)."""
    key = episode_key(pool, job, episode)
    pipe.hsetnx(key, "task", encode(task))
    pipe.expire(key, EPISODE_TTL_S)


def record_turn(pipe: Any, pool: str, job: str, episode: str, turn: int, message: dict[str, Any]) -> None:
    """Queue on ``pipe`` the write of completed turn ``turn`` (once: a turn served twice is recorded once)."""
    key = episode_key(pool, job, episode)
    pipe.hsetnx(key, str(turn), encode(message))
    pipe.expire(key, EPISODE_TTL_S)


def episode_state(client: redis.Redis, pool: str, job: str, episode: str) -> tuple[Any, list[Any]]:
    """An episode's task (``None`` when nothing is recorded) and its completed turns, in order."""
    fields = {
        (k.decode() if isinstance(k, bytes) else str(k)): v
        for k, v in cast(dict[Any, bytes], client.hgetall(episode_key(pool, job, episode))).items()
    }
    task = decode(fields["task"]) if "task" in fields else None
    turns: list[Any] = []
    while str(len(turns)) in fields:
        turns.append(decode(fields[str(len(turns))]))
    return task, turns


def crashes_key(pool: str, sha256: str) -> str:
    return pool_key(pool, "crashes", sha256)


def record_crash(client: redis.Redis, pool: str, sha256: str, server_id: str) -> int:
    """Count ``server_id``'s death while serving the package (once per server); the deaths in the window."""
    key = crashes_key(pool, sha256)
    pipe = client.pipeline(transaction=True)
    pipe.zadd(key, {server_id: now()}, nx=True)
    pipe.zremrangebyscore(key, "-inf", now() - CRASH_WINDOW_S)
    pipe.zcard(key)
    pipe.expire(key, int(CRASH_WINDOW_S))
    return int(pipe.execute()[2])


def crash_count(client: redis.Redis, pool: str, sha256: str) -> int:
    """Servers that died serving the package within the window."""
    return int(cast(int, client.zcount(crashes_key(pool, sha256), now() - CRASH_WINDOW_S, "+inf")))


def refused_message(name: str, sha256: str, crashes: int) -> str:
    return (
        f"package {name} (sha256 {sha256[:12]}) took down {crashes} env servers in the last "
        f"{CRASH_WINDOW_S / 60:.0f} minutes: env servers refuse it"
    )

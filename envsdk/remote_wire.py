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

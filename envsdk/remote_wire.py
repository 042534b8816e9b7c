"""What env servers (:mod:`envsdk.server`) and their clients (:mod:`envsdk.remote`) share in Redis.

All keys live under ``tunegate:envpool:<pool>:`` (a pool is a name; every server and client of one pool
names the same one, ``default`` unless the operator says otherwise). The pool's own keys, which only
servers and workers reach:

* ``servers`` -- a set of server ids; ``server:<id>`` -- that server's registration (JSON: id, host, pid,
  capacity, in-flight, packages warm, draining), written with a TTL that its heartbeat refreshes. A server
  whose registration expired is gone: its requests are sent again elsewhere.
* ``grants`` -- a hash, the Redis user of each running environment job -> its organisation, job and lease
  (JSON, written and renewed by the job's worker: ``gateway.worker.redis_acl``). A server serves the
  organisations with a grant whose lease has not run out, and nothing else.

Everything a job's trainer reads or writes is in its organisation's namespace, ``org:<org>:`` (the worker
gives the trainer a Redis user that reaches that namespace alone). A server takes the organisation of a
request from the stream it read it from, never from the request, and keys everything it keeps for it by
that organisation: its warm sandboxes, its unpacked packages, its results and its episodes.

* ``org:<org>:servers``, ``org:<org>:server:<id>`` -- the registrations again, as the organisation's
  trainers see them: each server writes them at every heartbeat for every organisation with a grant, and
  lists there only that organisation's packages.
* ``org:<org>:requests:<id>`` -- the server's request stream for the organisation (``XADD`` by clients,
  read by that server alone, so a client chooses where each request runs: by load, and an episode's calls
  on the server holding it).
* ``org:<org>:replies:<client>`` -- a client's reply stream (the server names it from the request's
  ``client`` in the same namespace).
* ``org:<org>:result:<key>`` -- a request's result, written once (``SET NX``) under its idempotency key: a
  request sent twice (its server died, or its deadline passed) counts once, whichever server answers first.
* ``org:<org>:served:<job>`` -- a hash, idempotency key -> the server whose result counted, the method and
  the number of completions it scored (what served what).
* ``org:<org>:episode:<job>:<episode>`` -- an open episode's state, the part that must outlive its server:
  ``task`` (what ``reset`` was given) and one field per completed turn (``0``, ``1``, ...: the assistant
  message that ``step`` answered), each written once (``HSETNX``) by the server that served it, in the
  transaction that stores the result; kept ``EPISODE_TTL_S``. A server taking over an episode whose server
  died rebuilds it from these (``resume``: ``reset`` with the task, then the turns in order) and records
  nothing new.
* ``org:<org>:crashes:<sha256>`` -- a sorted set of the servers that died while serving the package
  (member: the server id, so clients that saw the same death count it once; score: when), over the last
  ``CRASH_WINDOW_S``. At ``CRASH_LIMIT`` servers refuse the package to the organisation and its clients fail
  at once (``package_refused``). The count is the organisation's: its own trainers write it, so no other
  organisation's count can refuse its package, and a tenant can change a package's hash at will, so a count
  shared across organisations would protect the servers no better.
* ``org:<org>:package:<sha256>`` -- packages are content-addressed: a client stores the package's
  reproducible archive (:func:`envsdk.archive.pack`) there and requests name the hash; a server fetches,
  checks and unpacks it once per organisation.
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
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
MIRROR_TTL_S = 60
"""Life of an organisation's set of registrations once no server writes it (its grants ended)."""
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,128}")


def pool_key(pool: str, *parts: str) -> str:
    return ":".join((PREFIX, pool, *parts))


def org_key(pool: str, org: str, *parts: str) -> str:
    """A key of organisation ``org``'s namespace in ``pool``."""
    return pool_key(pool, "org", check_org(org), *parts)


def org_prefix(pool: str, org: str) -> str:
    """Where ``org``'s namespace starts: every key of it begins with this (a Redis ACL key pattern's
    prefix)."""
    return org_key(pool, org) + ":"


def check_org(org: str) -> str:
    """``org`` when it can name a namespace (letters, digits, ``_.-``: no ``:`` to leave it, no glob
    character to widen an ACL pattern), else ``ValueError``."""
    if not _NAME.fullmatch(org):
        raise ValueError(f"not an organisation id: {org!r}")
    return org


def grants_key(pool: str) -> str:
    return pool_key(pool, "grants")


def package_key(pool: str, org: str, sha256: str) -> str:
    return org_key(pool, org, "package", sha256)


def requests_key(pool: str, org: str, server_id: str) -> str:
    return org_key(pool, org, "requests", server_id)


def replies_key(pool: str, org: str, client_id: str) -> str:
    return org_key(pool, org, "replies", client_id)


def result_key(pool: str, org: str, key: str) -> str:
    return org_key(pool, org, "result", key)


def served_key(pool: str, org: str, job: str) -> str:
    return org_key(pool, org, "served", job or "-")


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


def register(
    client: redis.Redis,
    pool: str,
    registration: Registration,
    orgs: Mapping[str, list[str]] | None = None,
) -> None:
    """Write (or refresh) a registration and keep its id in the pool's set; and the same in the namespace of
    each organisation of ``orgs`` (organisation -> its packages warm on the server: an organisation's
    trainers see no other's)."""
    ttl_ms = int(REGISTRATION_TTL_S * 1000)
    pipe = client.pipeline(transaction=False)
    pipe.set(pool_key(pool, "server", registration.id), registration.to_json(), px=ttl_ms)
    pipe.sadd(pool_key(pool, "servers"), registration.id)
    pipe.execute()
    if not orgs:
        return
    mirrors = client.pipeline(transaction=False)
    for org, packages in orgs.items():
        seen = replace(registration, packages=sorted(packages))
        mirrors.set(org_key(pool, org, "server", registration.id), seen.to_json(), px=ttl_ms)
        mirrors.sadd(org_key(pool, org, "servers"), registration.id)
        mirrors.expire(org_key(pool, org, "servers"), MIRROR_TTL_S)
    # an organisation's trainers may write their namespace, so one of them can spoil only its own mirror
    mirrors.execute(raise_on_error=False)


def deregister(
    client: redis.Redis, pool: str, server_id: str, orgs: list[str] | tuple[str, ...] = ()
) -> None:
    pipe = client.pipeline(transaction=False)
    pipe.delete(pool_key(pool, "server", server_id))
    pipe.srem(pool_key(pool, "servers"), server_id)
    for org in orgs:
        pipe.delete(org_key(pool, org, "server", server_id), requests_key(pool, org, server_id))
        pipe.srem(org_key(pool, org, "servers"), server_id)
    pipe.execute(raise_on_error=False)


def live_servers(client: redis.Redis, pool: str, org: str | None = None) -> dict[str, Registration]:
    """The pool's registered servers by id, as the pool has them, or as ``org``'s trainers see them (ids
    whose registration expired are dropped from the set)."""

    def key(*parts: str) -> str:
        return pool_key(pool, *parts) if org is None else org_key(pool, org, *parts)

    ids = sorted(
        x.decode() if isinstance(x, bytes) else str(x)
        for x in cast(set[bytes], client.smembers(key("servers")))
    )
    if not ids:
        return {}
    raws = cast(list[bytes | None], client.mget([key("server", i) for i in ids]))
    found: dict[str, Registration] = {}
    gone: list[str] = []
    for server_id, raw in zip(ids, raws, strict=True):
        if raw is None:
            gone.append(server_id)
        else:
            found[server_id] = Registration.from_json(raw)
    if gone:
        client.srem(key("servers"), *gone)
    return found


def live_orgs(client: redis.Redis, pool: str) -> set[str]:
    """The organisations with a grant whose lease has not run out: those a server serves."""
    orgs: set[str] = set()
    for raw in cast(list[bytes], client.hvals(grants_key(pool))):
        try:
            grant = decode(raw)
            if float(grant["expires_at"]) > now():
                orgs.add(check_org(str(grant["org"])))
        except (ValueError, KeyError, TypeError):  # not one the worker wrote: ignored
            continue
    return orgs


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


def episode_key(pool: str, org: str, job: str, episode: str) -> str:
    return org_key(pool, org, "episode", job or "-", episode)


def record_reset(pipe: Any, pool: str, org: str, job: str, episode: str, task: dict[str, Any]) -> None:
    """Queue on ``pipe`` the write of an episode's task (once)."""
    key = episode_key(pool, org, job, episode)
    pipe.hsetnx(key, "task", encode(task))
    pipe.expire(key, EPISODE_TTL_S)


def record_turn(
    pipe: Any, pool: str, org: str, job: str, episode: str, turn: int, message: dict[str, Any]
) -> None:
    """Queue on ``pipe`` the write of completed turn ``turn`` (once: a turn served twice is recorded once)."""
    key = episode_key(pool, org, job, episode)
    pipe.hsetnx(key, str(turn), encode(message))
    pipe.expire(key, EPISODE_TTL_S)


def episode_state(client: redis.Redis, pool: str, org: str, job: str, episode: str) -> tuple[Any, list[Any]]:
    """An episode's task (``None`` when nothing is recorded) and its completed turns, in order."""
    fields = {
        (k.decode() if isinstance(k, bytes) else str(k)): v
        for k, v in cast(dict[Any, bytes], client.hgetall(episode_key(pool, org, job, episode))).items()
    }
    task = decode(fields["task"]) if "task" in fields else None
    turns: list[Any] = []
    while str(len(turns)) in fields:
        turns.append(decode(fields[str(len(turns))]))
    return task, turns


def crashes_key(pool: str, org: str, sha256: str) -> str:
    return org_key(pool, org, "crashes", sha256)


def record_crash(client: redis.Redis, pool: str, org: str, sha256: str, server_id: str) -> int:
    """Count ``server_id``'s death while serving the package (once per server); the deaths in the window."""
    key = crashes_key(pool, org, sha256)
    pipe = client.pipeline(transaction=True)
    pipe.zadd(key, {server_id: now()}, nx=True)
    pipe.zremrangebyscore(key, "-inf", now() - CRASH_WINDOW_S)
    pipe.zcard(key)
    pipe.expire(key, int(CRASH_WINDOW_S))
    return int(pipe.execute()[2])


def crash_count(client: redis.Redis, pool: str, org: str, sha256: str) -> int:
    """Servers that died serving the package within the window."""
    return int(cast(int, client.zcount(crashes_key(pool, org, sha256), now() - CRASH_WINDOW_S, "+inf")))


def refused_message(name: str, sha256: str, crashes: int) -> str:
    return (
        f"package {name} (sha256 {sha256[:12]}) took down {crashes} env servers in the last "
        f"{CRASH_WINDOW_S / 60:.0f} minutes: env servers refuse it"
    )

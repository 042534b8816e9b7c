"""The env servers' pool as an environment job's trainer reaches it: a Redis user of the job's own, for its
organisation's namespace of the pool and nothing else.

The trainer needs Redis only for the env servers (:mod:`envsdk.remote`), and there only its organisation's
keys (``tunegate:envpool:<pool>:org:<org>:*``, :mod:`envsdk.remote_wire`). So the worker does not hand it the
deployment's Redis URL: for each trainer run it makes an ACL user (Redis 6 and later) that

* reaches the keys of that one pattern (the registrations its servers copy there, its requests and replies,
  its results, its package, its crash counts), and no other key: not the queue, the rate-limit buckets,
  the pool's own keys, or another organisation's namespace (``NOPERM``);
* runs only the commands the client makes (``COMMANDS``): no ``KEYS``, ``SCAN``, ``ACL``, ``CONFIG``,
  ``FLUSHALL``, ``EVAL`` or Pub/Sub;
* has a random password that lives in the worker's memory and the trainer's environment, never in a file.

Env servers serve an organisation only while it has a grant (an entry of the pool's ``grants`` hash, written
here with the user) whose lease has not run out, and take a request's organisation from the namespace they
read it from: a trainer can write requests for its own organisation only, so it cannot make a server run its
calls as another's. The heartbeat renews the lease and states the user again (a Redis that restarted
without its ACL users gets it back); :func:`revoke` deletes the user and the grant when the trainer ends,
which also closes the trainer's connections. A grant whose worker died is swept by the next grant or revoke
on any worker of the pool (:func:`sweep`), and servers stop serving it when its lease runs out.

A Redis without ACL (before 6), or one whose deployment user may not manage users, cannot scope a
credential: the grant then falls back, with a warning, to the deployment's URL, and the organisation's
namespace holds only against a trainer that does not forge another's. ``PoolGrant.scoped`` says which.
"""

from __future__ import annotations

import contextlib
import logging
import re
import secrets
from dataclasses import dataclass
from typing import Any, cast
from urllib.parse import parse_qsl, quote, urlencode, urlsplit, urlunsplit

from redis.asyncio import Redis
from redis.exceptions import NoPermissionError, ResponseError

from envsdk.remote_wire import (
    MIRROR_TTL_S,
    REGISTRATION_TTL_S,
    Registration,
    decode,
    encode,
    grants_key,
    now,
    org_key,
    org_prefix,
    pool_key,
)
from trainer.contract import ENV_POOL_NAME_ENV, ENV_POOL_ORG_ENV, ENV_POOL_REDIS_ENV

logger = logging.getLogger(__name__)

GRANT_TTL_S = 120.0
"""Life of a grant between renewals (the worker renews it at every heartbeat of the job)."""
USER_PREFIX = "tunegate-job-"
COMMANDS = (
    "ping",
    "select",
    "get",
    "set",
    "del",
    "mget",
    "smembers",
    "srem",
    "xadd",
    "xread",
    "zadd",
    "zcard",
    "zcount",
    "zremrangebyscore",
    "expire",
    "multi",
    "exec",
    "discard",
)
"""What :class:`envsdk.remote.RemoteSandbox` and ``trainer.envpool`` run, and nothing more."""
_GLOB = re.compile(r"([*?\[\]\\])")


@dataclass(frozen=True)
class PoolGrant:
    """One trainer run's access to the pool: its Redis user, and what the trainer is told."""

    pool: str
    org_id: str
    job_id: str
    user: str
    """The ACL user (and the grant's field in the pool's ``grants`` hash)."""
    password: str
    url: str
    """The Redis URL the trainer gets: the deployment's Redis, as ``user``."""
    scoped: bool
    """False when Redis could not make the user: ``url`` is then the deployment's own."""

    @property
    def env(self) -> dict[str, str]:
        """The trainer's variables for the pool (``trainer.envpool`` reads them)."""
        return {ENV_POOL_REDIS_ENV: self.url, ENV_POOL_NAME_ENV: self.pool, ENV_POOL_ORG_ENV: self.org_id}


def acl_rules(pool: str, org_id: str, password: str) -> list[str]:
    """``ACL SETUSER`` rules of a job's user: everything reset, then on, its password, its organisation's
    namespace of ``pool`` (glob characters of the pool's name escaped), no channels, ``COMMANDS``."""
    pattern = _GLOB.sub(r"\\\1", org_prefix(pool, org_id)) + "*"
    return [
        "reset",
        "on",
        f">{password}",
        f"~{pattern}",
        "resetchannels",
        "-@all",
        *(f"+{command}" for command in COMMANDS),
    ]


def scoped_url(redis_url: str, user: str, password: str) -> str:
    """``redis_url`` as ``user`` (``redis://``, ``rediss://``, ``unix://``; credentials it held dropped)."""
    parts = urlsplit(redis_url)
    host = parts.netloc.rpartition("@")[2]
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}"
    query = [
        (k, v) for k, v in parse_qsl(parts.query, keep_blank_values=True) if k not in ("username", "password")
    ]
    return urlunsplit((parts.scheme, netloc, parts.path, urlencode(query), parts.fragment))


async def grant(client: Redis, *, redis_url: str, pool: str, org_id: str, job_id: str) -> PoolGrant:
    """Make the user of a trainer run of ``job_id`` (organisation ``org_id``) and its grant, and copy the
    pool's registrations into the organisation's namespace (the trainer looks for servers there as it
    starts; from then on the servers' heartbeats write them). ``client`` is the worker's own Redis."""
    org_prefix(pool, org_id)  # an id that cannot name a namespace is refused before anything is written
    await sweep(client, pool)
    user = f"{USER_PREFIX}{job_id}-{secrets.token_hex(4)}"
    password = secrets.token_urlsafe(32)
    made = PoolGrant(pool, org_id, job_id, user, password, scoped_url(redis_url, user, password), True)
    await _lease(client, made)  # before the user exists: a sweep finds every user by its grant
    try:
        await client.execute_command("ACL", "SETUSER", user, *acl_rules(pool, org_id, password))
    except ResponseError as exc:
        if not isinstance(exc, NoPermissionError) and "unknown command" not in str(exc).lower():
            await _done(client.hdel(grants_key(pool), user))
            raise
        logger.warning(
            "job %s: Redis makes no ACL user (%s): its trainer gets the deployment's Redis URL", job_id, exc
        )
        made = PoolGrant(pool, org_id, job_id, user, "", redis_url, False)
        await _lease(client, made)
    await _mirror(client, pool, org_id)
    return made


async def renew(client: Redis, granted: PoolGrant) -> None:
    """Extend the grant's lease, and state its user again (a Redis that restarted lost it)."""
    await _lease(client, granted)
    if granted.scoped:
        rules = acl_rules(granted.pool, granted.org_id, granted.password)
        await client.execute_command("ACL", "SETUSER", granted.user, *rules)


async def revoke(client: Redis, granted: PoolGrant) -> None:
    """Delete the user (its connections are closed) and the grant; then sweep the pool."""
    if granted.scoped:
        await client.execute_command("ACL", "DELUSER", granted.user)
    await _done(client.hdel(grants_key(granted.pool), granted.user))
    await sweep(client, granted.pool)


async def sweep(client: Redis, pool: str) -> int:
    """Delete the users and grants of ``pool`` whose lease ran out (their worker died); how many."""
    grants = cast(dict[bytes | str, bytes | str], await _done(client.hgetall(grants_key(pool))))
    swept = 0
    for field, raw in grants.items():
        user = field.decode() if isinstance(field, bytes) else field
        try:
            lease = decode(raw)
            expired, scoped = float(lease["expires_at"]) <= now(), bool(lease["scoped"])
        except (ValueError, KeyError, TypeError):  # not one this module wrote: gone too
            expired, scoped = True, True
        if not expired:
            continue
        if scoped and user.startswith(USER_PREFIX):
            with contextlib.suppress(ResponseError):  # a Redis that cannot: nothing to delete there
                await client.execute_command("ACL", "DELUSER", user)
        await _done(client.hdel(grants_key(pool), user))
        swept += 1
    if swept:
        logger.info("env pool %s: swept %d grant(s) of trainers that are gone", pool, swept)
    return swept


async def _done(call: Any) -> Any:
    """Await a command of the asyncio client (redis-py types its hash and set commands for both clients)."""
    return await call


async def _lease(client: Redis, granted: PoolGrant) -> None:
    lease: dict[str, Any] = {
        "org": granted.org_id,
        "job": granted.job_id,
        "scoped": granted.scoped,
        "expires_at": now() + GRANT_TTL_S,
    }
    await _done(client.hset(grants_key(granted.pool), granted.user, encode(lease)))


async def _mirror(client: Redis, pool: str, org_id: str) -> None:
    """The pool's live registrations, copied to ``org_id``'s namespace with no packages listed."""
    members = cast(set[bytes | str], await _done(client.smembers(pool_key(pool, "servers"))))
    ids = sorted(x.decode() if isinstance(x, bytes) else x for x in members)
    if not ids:
        return
    raws = cast(list[bytes | None], await client.mget([pool_key(pool, "server", i) for i in ids]))
    pipe = client.pipeline(transaction=False)
    for server_id, raw in zip(ids, raws, strict=True):
        if raw is None:
            continue
        registration = Registration.from_json(raw)
        registration.packages = []
        pipe.set(
            org_key(pool, org_id, "server", server_id),
            registration.to_json(),
            px=int(REGISTRATION_TTL_S * 1000),
        )
        pipe.sadd(org_key(pool, org_id, "servers"), server_id)
    pipe.expire(org_key(pool, org_id, "servers"), MIRROR_TTL_S)
    await pipe.execute()

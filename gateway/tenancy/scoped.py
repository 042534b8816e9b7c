"""Short-lived, organisation-scoped API keys that the system mints for its own work.

A worker that acts for an organisation (an eval run sampling a model and calling model graders, the trainer
of a job whose grader calls a model) does not call the inference engines directly: it calls the gateway with
a key of that organisation, so ownership checks, rate limits, budgets and usage metering apply to its
requests exactly as to a client's. (A request that causes model calls of its own, `graders/run` or
`environments/run`, makes them with the key it came with: `gateway.serving.calls`.) Such a key:

- has a `kind` (`eval`, `job`, or `episode` for an episode of captured traffic: `gateway.capture`) and an
  `expires_at`: its holder renews it while it works (`renew`), so a holder that dies leaves a key that stops
  working within `ttl_s`;
- may call the inference routes (`/v1/chat/completions`, `/v1/completions`, `/v1/responses`, `/v1/messages`)
  and nothing else (files, jobs, evals, models, usage...): `deps.authenticate_person`, behind every other
  route's key check, refuses it;
- is revoked when the work ends (`minted` does it on the way out, also when cancelled), or when a reaper
  takes the work back from a holder that died (`revoke_named`: the work names its key); a gateway that has
  it cached stops accepting it within `auth_cache_ttl_s`.

Its usage rows carry its own `api_key_id`, so the usage API can tell an eval run's tokens from a person's.
The plaintext lives only in the holder's memory; the database keeps the digest, as for every key.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field

from gateway.db import Conn
from gateway.tenancy import store
from gateway.tenancy.keys import generate_key

KINDS = ("eval", "job", "episode")
"""Kinds of minted keys (people's keys are `user`)."""


@dataclass(frozen=True, slots=True)
class MintedKey:
    """A key minted for one piece of work."""

    id: str
    """The key's id (`key_...`): what usage rows and the admin API name it by."""
    organization_id: str
    """The organisation it acts for."""
    kind: str
    """`eval` or `job`."""
    secret: str = field(repr=False)
    """The bearer token (`sk-tg-...`), kept in memory only."""


async def mint(conn: Conn, *, org_id: str, kind: str, name: str, ttl_s: float) -> MintedKey:
    """A new key of `org_id` that expires `ttl_s` from now unless renewed."""
    if kind not in KINDS:
        raise ValueError(f"minted keys are of kind {' or '.join(KINDS)}, not {kind!r}")
    plaintext, display, digest = generate_key()
    row = await store.create_key(
        conn, org_id=org_id, name=name, display_prefix=display, digest=digest, kind=kind, ttl_s=ttl_s
    )
    return MintedKey(row.id, org_id, kind, plaintext)


async def renew(conn: Conn, key_id: str, *, ttl_s: float) -> bool:
    """Keep a minted key alive for `ttl_s` more; False when it was revoked meanwhile."""
    return await store.renew_key(conn, key_id=key_id, ttl_s=ttl_s)


async def revoke(conn: Conn, key_id: str) -> None:
    """End a minted key now (its holder finished, or was found dead)."""
    await store.revoke_key(conn, key_id=key_id)


async def revoke_named(conn: Conn, *, org_id: str, kind: str, name: str) -> list[str]:
    """End every live key minted as `kind` and `name` for `org_id`: what a reaper does for work whose holder
    died, since the key's id died with the holder. Returns the ids revoked."""
    if kind not in KINDS:
        raise ValueError(f"minted keys are of kind {' or '.join(KINDS)}, not {kind!r}")
    return await store.revoke_minted(conn, org_id=org_id, kind=kind, name=name)


@asynccontextmanager
async def minted(conn: Conn, *, org_id: str, kind: str, name: str, ttl_s: float) -> AsyncIterator[MintedKey]:
    """A key for the duration of a block; revoked when the block ends, however it ends."""
    key = await mint(conn, org_id=org_id, kind=kind, name=name, ttl_s=ttl_s)
    try:
        yield key
    finally:
        await asyncio.shield(revoke(conn, key.id))

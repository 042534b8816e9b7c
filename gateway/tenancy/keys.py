"""API keys: made from 192 random bits, stored only as a SHA-256 digest, checked with one indexed lookup.

The authenticator caches lookups for a few seconds so the request path makes no database round trip for a
key it has seen; a revocation on this gateway drops the entry at once, other gateways see it within the TTL.
`last_used_at` is written in batches by a background flush, never on the request path. An expiring key (one
the system minted for its own work, see `gateway.tenancy.scoped`) is cached no longer than it lives.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import secrets
import time
from dataclasses import dataclass

import asyncpg

from gateway.errors import AuthenticationFailed
from gateway.singleflight import SingleFlight
from gateway.tenancy import store

logger = logging.getLogger(__name__)

KEY_PREFIX = "sk-tg-"
EPISODE_KEY_NAME = "episode "
"""An episode key's name is this and its episode's id."""


@dataclass(frozen=True, slots=True)
class Principal:
    """Who is calling: an organisation through one of its keys."""

    organization_id: str
    api_key_id: str
    kind: str = "user"
    """`user` for keys made through the admin API; `eval` or `job` for keys the system minted for one eval
    run or training job, `episode` for a key minted for one episode of captured traffic
    (`gateway.tenancy.scoped`): those may call the inference routes only."""
    episode_id: str | None = None
    """The episode of an `episode` key: every call made with it is captured into that episode."""


def generate_key() -> tuple[str, str, bytes]:
    """A new key: `(plaintext, display prefix, digest)`. The plaintext is shown once and never stored."""
    plaintext = KEY_PREFIX + secrets.token_urlsafe(24)  # 192 bits
    return plaintext, plaintext[: len(KEY_PREFIX) + 4] + "..." + plaintext[-4:], digest_of(plaintext)


def digest_of(plaintext: str) -> bytes:
    return hashlib.sha256(plaintext.encode()).digest()


def bearer_token(authorization: str | None) -> str:
    """The token of an `Authorization: Bearer ...` header, or a 401."""
    if not authorization:
        raise AuthenticationFailed(
            "You didn't provide an API key. Provide it in the Authorization header (Bearer auth)."
        )
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise AuthenticationFailed("Malformed Authorization header; expected 'Bearer <key>'.")
    return token.strip()


class Authenticator:
    """Resolves bearer tokens to principals, with a short-lived local cache."""

    def __init__(self, pool: asyncpg.Pool, *, ttl_s: float) -> None:
        self._pool = pool
        self._ttl = ttl_s
        self._cache: dict[bytes, tuple[float, Principal]] = {}
        self._used: set[str] = set()
        self._lookups: SingleFlight[bytes, Principal | None] = SingleFlight()
        self._forgotten = 0
        """Keys revoked so far: a lookup that saw a revocation while it ran does not cache its result."""

    async def authenticate(self, token: str) -> Principal:
        digest = digest_of(token)
        now = time.monotonic()
        hit = self._cache.get(digest)
        if hit is not None and hit[0] > now:
            principal: Principal | None = hit[1]
        else:  # one lookup for all the requests of a key whose entry expired together
            principal = await self._lookups.run(digest, lambda: self._lookup(digest))
        if principal is None:
            masked = token[:6] + "*" * 4 + token[-4:] if len(token) > 12 else "***"
            raise AuthenticationFailed(f"Incorrect API key provided: {masked}.")
        self._used.add(principal.api_key_id)
        return principal

    async def _lookup(self, digest: bytes) -> Principal | None:
        forgotten = self._forgotten
        row = await store.key_by_digest(self._pool, digest=digest)
        if row is None:
            self._cache.pop(digest, None)
            return None
        episode = row.name.removeprefix(EPISODE_KEY_NAME) if row.kind == "episode" and row.name else None
        principal = Principal(row.organization_id, row.id, row.kind, episode)
        if len(self._cache) > 100_000:
            self._cache.clear()
        if forgotten == self._forgotten:  # else a key was revoked meanwhile: look again next time
            ttl = self._ttl if row.expires_in_s is None else min(self._ttl, row.expires_in_s)
            self._cache[digest] = (time.monotonic() + ttl, principal)
        return principal

    def forget_key(self, key_id: str) -> None:
        """Drop a revoked key from the cache now."""
        self._forgotten += 1
        for digest, (_, principal) in list(self._cache.items()):
            if principal.api_key_id == key_id:
                del self._cache[digest]

    async def flush_last_used(self) -> None:
        """Write `last_used_at` for the keys used since the last flush."""
        if not self._used:
            return
        used, self._used = list(self._used), set()
        await store.touch_keys(self._pool, key_ids=used)

    async def run_flusher(self, interval_s: float = 5.0) -> None:
        """Background task: flush `last_used_at` every few seconds until cancelled."""
        while True:
            await asyncio.sleep(interval_s)
            try:
                await self.flush_last_used()
            except (OSError, asyncpg.PostgresError) as exc:
                logger.warning("could not record key use: %s", exc)

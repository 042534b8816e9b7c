"""Redis side of rate limits and budgets: token buckets and budget reservations, each checked and taken in
one Lua script (atomic across every gateway), registered with redis-py `register_script` (which reloads the
script after a `NOSCRIPT`).

Buckets refill continuously: a limit of N per minute holds at most N and gains N/60 each second. Budgets
are in micro-USD (whole numbers, so Redis keeps them exact): a hash per organisation and month holding
`spent` and each gateway's hold (see `holds`). If Redis cannot be reached (or answers later than the
client's timeout) the calls answer None and log a warning, and Redis is then left alone for a few seconds so
a dead Redis costs no latency; meanwhile the guard keeps the limits and budgets in memory, as if it were the
only gateway (`fallback`, `Guard._hold_here`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

from redis.asyncio import Redis
from redis.exceptions import RedisError

logger = logging.getLogger(__name__)

KEY_PREFIX = "tunegate:"
DOWN_FOR_S = 5.0

# KEYS: bucket keys. ARGV: now_ms, then (capacity, cost, lease wanted, given back) per key. What is given back
# (a lease's leftover; negative: owed) goes in first. All buckets must then hold their cost, or nothing is
# taken. A bucket that can spare it also lends a lease: at most what was wanted and a sixteenth of what is
# left after the cost, and nothing under twice the cost (see `leases`). Returns {allowed, retry_after_ms,
# then remaining, ms until full, lease, per key}.
TAKE = """
local now = tonumber(ARGV[1])
local state = {}
local allowed = 1
local retry = 0
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[4 * i - 2])
  local cost = math.min(tonumber(ARGV[4 * i - 1]), cap)
  local rate = cap / 60000.0
  local h = redis.call('HMGET', key, 'tokens', 'ts')
  local tokens = tonumber(h[1]) or cap
  local ts = tonumber(h[2]) or now
  tokens = math.min(cap, tokens + math.max(0, now - ts) * rate + tonumber(ARGV[4 * i + 1]))
  state[i] = {tokens, cap, cost, rate, tonumber(ARGV[4 * i])}
  if tokens < cost then
    allowed = 0
    retry = math.max(retry, math.ceil((cost - tokens) / rate))
  end
end
local out = {allowed, retry}
for i, key in ipairs(KEYS) do
  local tokens, cap, cost, rate, want = state[i][1], state[i][2], state[i][3], state[i][4], state[i][5]
  local lease = 0
  if allowed == 1 then
    tokens = tokens - cost
    lease = math.min(want, math.floor(tokens / 16))
    if lease < 2 * cost then lease = 0 end
    tokens = tokens - lease
  end
  redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now))
  redis.call('PEXPIRE', key, 120000)
  out[#out + 1] = math.floor(math.max(0, tokens))
  out[#out + 1] = math.ceil((cap - tokens) / rate)
  out[#out + 1] = lease
end
return out
"""

# KEYS: bucket keys. ARGV: now_ms, then (capacity, delta) per key: take `delta` more (negative: give back).
ADJUST = """
local now = tonumber(ARGV[1])
for i, key in ipairs(KEYS) do
  local cap = tonumber(ARGV[2 * i])
  local delta = tonumber(ARGV[2 * i + 1])
  local h = redis.call('HMGET', key, 'tokens', 'ts')
  if h[1] then
    local rate = cap / 60000.0
    local tokens = math.min(cap, tonumber(h[1]) + math.max(0, now - tonumber(h[2])) * rate)
    tokens = math.min(cap, tokens - delta)
    redis.call('HSET', key, 'tokens', tostring(tokens), 'ts', tostring(now))
  end
end
return 1
"""

# KEYS[1]: the month's budget hash. ARGV: limit, gateway id, the gateway's hold now (its requests in flight
# and what is left of its lease), the new request's estimate (0: a sync), lease wanted, cost to add to spent,
# seed ('' when unknown), now_ms, hold_ttl_ms; money in micro-USD. Other gateways' holds count until their
# expiry (a gateway that stopped renewing its hold is forgotten). The request fits when spent, every hold and
# its estimate stay within the limit; a lease is lent when an eighth of the room left beyond that covers it
# and two estimates at least. The gateway's hold becomes what it held, plus the estimate and the lease when
# granted. Returns {1, lease} granted, {0, 0} over budget, {-1} spend unknown (the caller reads it from the
# database and calls again with a seed; nothing was changed).
HOLD = """
local key = KEYS[1]
local limit, me, base = tonumber(ARGV[1]), ARGV[2], tonumber(ARGV[3])
local est, want, add = tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6])
local now, ttl = tonumber(ARGV[8]), tonumber(ARGV[9])
if redis.call('EXISTS', key) == 0 then
  if ARGV[7] == '' then return {-1} end
  redis.call('HSET', key, 'spent', ARGV[7])
  redis.call('EXPIRE', key, 3456000)
  add = 0
end
local fields = redis.call('HGETALL', key)
local h = {}
for i = 1, #fields, 2 do h[fields[i]] = fields[i + 1] end
local spent = tonumber(h['spent'] or '0') + add
if add ~= 0 then redis.call('HSET', key, 'spent', string.format('%d', spent)) end
local used = spent
for f, v in pairs(h) do
  if string.sub(f, 1, 2) == 'x:' then
    local g = string.sub(f, 3)
    if g ~= me then
      if tonumber(v) < now then
        redis.call('HDEL', key, f, 'h:' .. g)
      else
        used = used + tonumber(h['h:' .. g] or '0')
      end
    end
  end
end
local room = limit - used - base - est
local granted, lease = 1, 0
if room < 0 and est > 0 then
  granted = 0
elseif est > 0 then
  lease = math.min(want, math.floor(room / 8))
  if lease < 2 * est then lease = 0 end
end
local hold = base
if granted == 1 then hold = base + est + lease end
if hold > 0 then
  redis.call('HSET', key, 'h:' .. me, string.format('%d', hold), 'x:' .. me, string.format('%d', now + ttl))
else
  redis.call('HDEL', key, 'h:' .. me, 'x:' .. me)
end
return {granted, lease}
"""

# KEYS[1]: the month's budget hash. ARGV: cost to add to its spend (micro-USD): how a worker adds a training
# run's cost. Added only where the hash exists (else the next request seeds it from the database).
ADD_SPENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HINCRBY', KEYS[1], 'spent', tonumber(ARGV[1]))
return 1
"""


@dataclass(frozen=True, slots=True)
class BucketState:
    """One bucket after a check: what the `x-ratelimit-*` headers report."""

    limit: int
    remaining: int
    reset_ms: int


@dataclass(frozen=True, slots=True)
class TakeResult:
    allowed: bool
    retry_after_ms: int
    buckets: list[BucketState]
    leased: list[int]
    """The lease each bucket lent besides the cost (0: none)."""
    fallback: bool = False
    """Taken from this gateway's own buckets while Redis was unreachable (`gateway.limits.fallback`)."""


MAX_MICRO = 2**53
"""Most micro-USD any amount is counted as: the largest integer Redis' Lua numbers (doubles) hold exactly."""


def to_micro(usd: float) -> int:
    """USD as whole micro-USD, rounded up (a reservation never underestimates), at most `MAX_MICRO` (a
    budget stored before budgets were capped, even an infinite one, never makes a request fail)."""
    if not usd * 1_000_000 < MAX_MICRO:  # also NaN and infinity
        return MAX_MICRO
    return int(-(-usd * 1_000_000 // 1))


def month_key(org_id: str, at: float | None = None) -> str:
    return f"{KEY_PREFIX}budget:{org_id}:{time.strftime('%Y%m', time.gmtime(at or time.time()))}"


def key_month_key(key_id: str, at: float | None = None) -> str:
    """The month hash of an API key's spend limit (as `month_key` is of an organisation's budget)."""
    return f"{KEY_PREFIX}keyspend:{key_id}:{time.strftime('%Y%m', time.gmtime(at or time.time()))}"


def bucket_key(subject: str, kind: str) -> str:
    """`subject` is `org:<id>` or `key:<id>`; `kind` is `requests` or `tokens`."""
    return f"{KEY_PREFIX}rl:{subject}:{kind}"


def make_limits_redis(redis_url: str) -> Redis:
    """A Redis client for limits: short timeouts, since a slow Redis must not slow serving."""
    return Redis.from_url(redis_url, socket_connect_timeout=0.5, socket_timeout=1.0)


class Buckets:
    """The scripts on one Redis client, failing open while Redis is unreachable."""

    def __init__(self, redis: Redis) -> None:
        self.redis = redis
        self._take = redis.register_script(TAKE)
        self._adjust = redis.register_script(ADJUST)
        self._hold = redis.register_script(HOLD)
        self._add_spent = redis.register_script(ADD_SPENT)
        self._down_until = 0.0
        self.failures = 0
        """Redis calls that failed (each one let its request through)."""

    @property
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _failed(self, what: str, exc: BaseException) -> None:
        self.failures += 1
        self._down_until = time.monotonic() + DOWN_FOR_S
        logger.warning("redis unavailable for %s, failing open for %.0fs: %s", what, DOWN_FOR_S, exc)

    async def take(
        self, buckets: list[tuple[str, int, int]], leases: list[tuple[int, int]]
    ) -> TakeResult | None:
        """Take `cost` from every `(key, capacity, cost)` bucket, or from none; None when Redis is down.
        `leases`: per bucket, `(lease wanted, leftover given back first)`."""
        if not buckets or not self.available:
            return None
        args: list[int] = [int(time.time() * 1000)]
        for (_, cap, cost), (want, back) in zip(buckets, leases, strict=True):
            args += [cap, cost, want, back]
        try:
            out = await self._take(keys=[b[0] for b in buckets], args=args)
        except (RedisError, OSError) as exc:
            self._failed("rate limits", exc)
            return None
        states = [
            BucketState(limit=buckets[i][1], remaining=int(out[2 + 3 * i]), reset_ms=int(out[3 + 3 * i]))
            for i in range(len(buckets))
        ]
        leased = [int(out[4 + 3 * i]) for i in range(len(buckets))]
        return TakeResult(allowed=bool(out[0]), retry_after_ms=int(out[1]), buckets=states, leased=leased)

    async def adjust(self, buckets: list[tuple[str, int, int]]) -> None:
        """Take `delta` more from each `(key, capacity, delta)` bucket (negative gives back)."""
        if not buckets or not self.available:
            return
        args: list[int] = [int(time.time() * 1000)]
        for _, cap, delta in buckets:
            args += [cap, delta]
        try:
            await self._adjust(keys=[b[0] for b in buckets], args=args)
        except (RedisError, OSError) as exc:
            self._failed("rate limits", exc)

    async def hold(
        self,
        key: str,
        *,
        gateway: str,
        limit: int,
        base: int,
        estimate: int = 0,
        lease: int = 0,
        spent: int = 0,
        seed: int | None = None,
        ttl_ms: int,
    ) -> tuple[int, int] | None:
        """One `HOLD` call (see the script): `(1, lease)` granted, `(0, 0)` over budget, `(-1, 0)` spend
        unknown (call again with `seed`); None when Redis is down."""
        if not self.available:
            return None
        now_ms = int(time.time() * 1000)
        known = "" if seed is None else seed
        args: list[str | int] = [limit, gateway, base, estimate, lease, spent, known, now_ms, ttl_ms]
        try:
            out = await self._hold(keys=[key], args=args)
        except (RedisError, OSError) as exc:
            self._failed("budgets", exc)
            return None
        return int(out[0]), int(out[1]) if len(out) > 1 else 0

    async def add_spent(self, key: str, cost: int) -> None:
        """Add `cost` (micro-USD) to the month's spend."""
        if not self.available:
            return
        try:
            await self._add_spent(keys=[key], args=[cost])
        except (RedisError, OSError) as exc:
            self._failed("budgets", exc)

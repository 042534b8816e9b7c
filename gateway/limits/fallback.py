"""Rate limits a gateway keeps by itself while Redis is unreachable.

Redis holds the buckets every gateway shares (`buckets.TAKE`). When a call to it fails (it is down, or too
slow to answer within the client's timeout: `buckets.make_limits_redis`), `Buckets` leaves it alone for
`DOWN_FOR_S` and the guard takes from these buckets instead of letting every request through. Each bucket
here starts from the last state Redis reported for it (`seen`), goes on refilling at the same rate, and is
checked all-or-nothing as the script does: a hiccup mid-minute neither refills a bucket nor empties it, and
a flood while Redis is away is refused at the same rate as before. What is taken here is owed to Redis and
taken there once it answers again (`owed`). With several gateways each keeps its own copy, so together they
may admit up to their number of times the limit until Redis is back. Budgets have the same fallback in the
guard (`Guard._hold_here`).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

from gateway.limits.buckets import BucketState, TakeResult

MAX_BUCKETS = 100_000
"""Buckets remembered at most (all are forgotten past it: they start full, as in a new Redis)."""


@dataclass(slots=True)
class _Bucket:
    tokens: float
    at: float
    """`time.monotonic()` of `tokens`."""


class LocalBuckets:
    """This gateway's own rate-limit buckets: `seen` copies Redis's answers, `take` checks and takes."""

    def __init__(self) -> None:
        self._buckets: dict[str, _Bucket] = {}
        self._owed: dict[str, tuple[int, int]] = {}
        """Taken here and not yet from Redis: bucket key -> (capacity, amount)."""

    def _room(self, n: int) -> None:
        if len(self._buckets) + n > MAX_BUCKETS:
            self._buckets.clear()
            self._owed.clear()

    def owed(self) -> list[tuple[str, int, int]]:
        """What was taken here since Redis last answered, `(key, capacity, amount)` per bucket, forgotten
        here once asked for (the caller takes it from Redis)."""
        if not self._owed:  # every Redis call asks: most find nothing owed
            return []
        owed, self._owed = self._owed, {}
        return [(key, cap, amount) for key, (cap, amount) in owed.items()]

    def seen(self, checks: list[tuple[str, int, int]], states: list[BucketState]) -> None:
        """What Redis said of `checks`' buckets `(key, capacity, cost)` after taking from them."""
        self._room(len(checks))
        now = time.monotonic()
        for (key, _, _), state in zip(checks, states, strict=True):
            self._buckets[key] = _Bucket(float(state.remaining), now)

    def take(self, checks: list[tuple[str, int, int]]) -> TakeResult:
        """Take each `(key, capacity, cost)` from its bucket, or from none when one is short (with how long
        until it holds its cost); a bucket never seen starts full."""
        self._room(len(checks))
        now = time.monotonic()
        levels: list[float] = []
        retry_ms = 0
        for key, cap, cost in checks:
            rate = cap / 60_000.0  # per millisecond, as the script refills
            bucket = self._buckets.get(key)
            level = float(cap)
            if bucket is not None:
                level = min(level, bucket.tokens + (now - bucket.at) * 1000 * rate)
            levels.append(level)
            cost = min(cost, cap)
            if level < cost:
                retry_ms = max(retry_ms, math.ceil((cost - level) / rate))
        allowed = retry_ms == 0
        states = []
        for (key, cap, cost), level in zip(checks, levels, strict=True):
            if allowed:
                level -= min(cost, cap)
                self._owed[key] = (cap, self._owed.get(key, (cap, 0))[1] + min(cost, cap))
            self._buckets[key] = _Bucket(level, now)
            full_ms = math.ceil((cap - level) / (cap / 60_000.0))
            states.append(BucketState(limit=cap, remaining=int(max(0.0, level)), reset_ms=full_ms))
        return TakeResult(allowed=allowed, retry_after_ms=retry_ms, buckets=states, leased=[0] * len(checks))

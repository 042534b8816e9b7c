"""Local leases on rate-limit buckets: how a gateway admits most requests without a Redis round trip.

When a request goes to Redis anyway, the gateway may take a little more from each bucket than the request
costs: a *lease*, sized to about `lease_s` seconds of this gateway's own recent traffic on that bucket (every
request counts, admitted from a lease or from Redis; older traffic weighs less and less) and never more than
a sixteenth of what the bucket holds beyond the request (the script decides; see `buckets.TAKE`). Later
requests are admitted against the leases in memory until one runs short or a lease is `LEASE_TTL_S` old;
then the next request goes to Redis again, giving back what its leases have left in the same call, and the
requests that find the leases short meanwhile wait for it. A lease down to a quarter of its last grant is
topped up in the background (`low`), so that steady traffic seldom finds it empty.

Nothing is ever admitted that the shared bucket did not grant, so every gateway together stays within the
limit. What leases cost is the other way round: tokens leased by one gateway and not yet used are held from
the others for at most `LEASE_TTL_S` (they are given back when the lease expires). A bucket too small to
spare at least two requests' worth is never leased from, so small limits are counted exactly, request by
request, as without leases. The `x-ratelimit-remaining-*` headers of a locally admitted request are the
bucket's state at the lease's grant less what this gateway has used since (refills not counted).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gateway.limits.buckets import BucketState

LEASE_TTL_S = 1.0
"""A lease older than this is given back instead of used."""


@dataclass(slots=True)
class Demand:
    """How fast this gateway has been using something lately (a bucket, a budget): cost since `since`, the
    window halved (its rate kept) once it is longer than asked, so that old traffic fades."""

    cost: float = 0.0
    since: float = 0.0

    def rate(self, now: float, window: float) -> float:
        """Cost per second lately."""
        span = max(now - self.since, 1e-3)
        rate = self.cost / span
        if span > window:
            self.cost /= 2
            self.since = now - span / 2
        return rate


@dataclass(slots=True)
class Lease:
    """What one gateway holds of one bucket, and how fast it has been using the bucket."""

    cap: int
    left: int
    """Taken from Redis and not used yet (negative: used more than taken, owed at the next call)."""
    remaining: int
    """The bucket's contents in Redis right after the last grant (the lease not counted)."""
    granted: float
    """When the last lease was granted (`time.monotonic()`)."""
    grant: int
    """The last lease granted."""
    demand: Demand


def _state(cap: int, remaining: int) -> BucketState:
    remaining = max(0, min(cap, remaining))
    return BucketState(limit=cap, remaining=remaining, reset_ms=math.ceil((cap - remaining) * 60_000 / cap))


class Leases:
    """The leases of one gateway, by bucket key."""

    def __init__(self, lease_s: float) -> None:
        self.lease_s = lease_s
        self._held: dict[str, Lease] = {}

    def __len__(self) -> int:
        return len(self._held)

    def take(self, checks: list[tuple[str, int, int]], now: float) -> list[BucketState] | None:
        """Admit `(key, capacity, cost)` from the leases alone: the buckets' states, or None when a lease
        is missing, expired, of another capacity or too small (nothing is taken then)."""
        held = self._held
        for key, cap, cost in checks:
            lease = held.get(key)
            if lease is None or lease.cap != cap or lease.left < cost or now - lease.granted > LEASE_TTL_S:
                return None
        states = []
        for key, cap, cost in checks:
            lease = held[key]
            lease.left -= cost
            lease.demand.cost += cost
            states.append(_state(cap, lease.remaining + lease.left))
        return states

    def leasable(self, checks: list[tuple[str, int, int]]) -> bool:
        """Whether every bucket of `checks` lent a lease last time (waiting for a renewal can help)."""
        for key, _, _ in checks:
            lease = self._held.get(key)
            if lease is None or lease.grant <= 0:
                return False
        return True

    def low(self, checks: list[tuple[str, int, int]]) -> bool:
        """Whether a lease on `checks` is down to a quarter of its last grant (time to top it up)."""
        for key, _, _ in checks:
            lease = self._held.get(key)
            if lease is not None and lease.left * 4 < lease.grant:
                return True
        return False

    def renewals(
        self, checks: list[tuple[str, int, int]], now: float, *, top_up: bool = False
    ) -> list[tuple[int, int]]:
        """For a Redis call on `checks`: per bucket, `(lease wanted, leftover given back)`. The leftovers
        leave the leases at once (so concurrent requests do not use them), except for a `top_up`, which
        gives nothing back; `granted` adds the new ones."""
        out = []
        for key, _, _ in checks:
            lease = self._held.get(key)
            want = 0
            give_back = 0
            if lease is not None:
                if not top_up:
                    give_back, lease.left = lease.left, 0
                if self.lease_s > 0:
                    want = int(lease.demand.rate(now, 4 * self.lease_s) * self.lease_s)
            out.append((want, give_back))
        return out

    def granted(
        self,
        checks: list[tuple[str, int, int]],
        states: list[BucketState],
        leased: list[int],
        now: float,
        *,
        top_up: bool = False,
    ) -> list[BucketState]:
        """Record the leases a Redis call granted (added to what concurrent calls granted); returns the
        states to report (the leases counted as still in the bucket). A `top_up` took the costs for no
        request: they join the leases."""
        out = []
        for (key, cap, cost), state, lease in zip(checks, states, leased, strict=True):
            held = self._held.get(key)
            extra, used = (cost, 0) if top_up else (0, cost)
            if held is not None and held.cap == cap:
                held.left += lease + extra
                held.demand.cost += used
                held.remaining, held.granted, held.grant = state.remaining, now, lease
            elif self.lease_s > 0:
                self._held[key] = Lease(cap, lease + extra, state.remaining, now, lease, Demand(used, now))
            out.append(_state(cap, state.remaining + lease) if lease else state)
        return out

    def settle(self, key: str, cap: int, delta: int) -> bool:
        """Charge `delta` more (negative: give back) to the lease on `key`; False when there is none."""
        lease = self._held.get(key)
        if lease is None or lease.cap != cap:
            return False
        lease.left -= delta
        return True

    def expired(self, now: float) -> list[tuple[str, int, int]]:
        """Drop the leases older than `LEASE_TTL_S`: `(key, capacity, leftover)` of each, to give back."""
        old = [k for k, lease in self._held.items() if now - lease.granted > LEASE_TTL_S]
        return [(k, lease.cap, lease.left) for k in old if (lease := self._held.pop(k)).left]

"""Budget holds: how a gateway admits most requests of an organisation with a monthly budget without a Redis
round trip.

Each gateway keeps one amount of its own in the organisation's month hash in Redis, its *hold*: the
estimated cost of its requests in flight plus a *lease*, budget it may spend without asking (see
`buckets.HOLD`). A request the lease covers is admitted in memory. One it does not cover makes one Redis
call, which checks the month's spend, every gateway's hold and the request's estimate against the budget,
sets this gateway's hold anew and may lend a new lease: about `lease_s` seconds of this gateway's recent
spending, never more than an eighth of the room left, and nothing under two estimates (so a budget near its
end is counted request by request, as without leases). Requests that find the lease short while a call is
in flight wait for it rather than make their own.

Actual costs are added to `spent`, and the unused part of estimates leaves the hold, with the next call: a
background sync calls at least every `SYNC_S` while the gateway holds or owes anything. A lease unused for
`LEASE_TTL_S` is given back. Nothing is ever admitted that the hash did not cover, so every gateway together
stays within the budget (give or take answers longer than their estimate). A gateway that dies stops
renewing its hold and the others stop counting it `HOLD_TTL_S` later, so nothing stays reserved for good;
what it loses is the spend of its last sync interval in the Redis counter, which PostgreSQL's usage rows
(billing, and the counter's seed for a new month) still have.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from gateway.limits.leases import LEASE_TTL_S, Demand

SYNC_S = LEASE_TTL_S / 2
"""How often a gateway that holds or owes budget tells Redis (its spend, its hold)."""
HOLD_TTL_S = 10.0
"""How long a gateway's hold counts after its last call (its syncs renew it)."""


@dataclass(slots=True)
class Account:
    """This gateway's side of one organisation's month, or of one of its keys' (one Redis hash)."""

    org_id: str
    limit: int
    """The budget or the key's spend limit (micro-USD) as last known."""
    key_id: str | None = None
    """The key whose spend limit this is; None for the organisation's budget."""
    in_flight: int = 0
    """Estimates of the requests admitted and not settled yet."""
    available: int = 0
    """Lease left: what requests may still be admitted against in memory."""
    unsent: int = 0
    """Actual costs settled here and not yet added to `spent` in Redis."""
    sent_hold: int = 0
    """The hold Redis has for this gateway, as of its last call."""
    granted: float = 0.0
    """When the lease was last granted (`time.monotonic()`)."""
    synced: float = 0.0
    """When Redis last heard from this account (its hold expires `HOLD_TTL_S` later)."""
    demand: Demand = field(default_factory=Demand)
    """Estimates admitted lately (how fast this gateway spends)."""
    call: asyncio.Future[None] | None = None
    """The Redis call in flight on this account (one at a time), done when it is."""
    floor: int | None = None
    """While Redis is unreachable: the month's spend in PostgreSQL as last read (`Guard._hold_here`)."""
    floor_at: float = 0.0
    """When `floor` was read (`time.monotonic()`)."""
    floor_unsent: int = 0
    """`unsent` when `floor` was read: what was settled here since is not in it."""

    @property
    def hold(self) -> int:
        """What this gateway holds now: requests in flight and the lease left."""
        return self.in_flight + self.available

    @property
    def idle(self) -> bool:
        """Nothing held here, in Redis or owed to it: the account can go."""
        return not (self.in_flight or self.available or self.unsent or self.sent_hold) and self.call is None

    def take(self, estimate: int, now: float) -> bool:
        """Admit a request of `estimate` from the lease; False when it is short or old (nothing taken)."""
        if self.available < estimate or now - self.granted > LEASE_TTL_S:
            return False
        self.available -= estimate
        self.admitted(estimate)
        return True

    def fits_alone(self, estimate: int) -> bool:
        """Redis unreachable: admit `estimate` when it fits the limit beside `floor` (the month's spend in
        PostgreSQL), what was settled here since it was read and the requests in flight; False when not."""
        used = (self.floor or 0) + self.unsent - self.floor_unsent + self.in_flight
        if used + estimate > self.limit:
            return False
        self.admitted(estimate)
        return True

    def admitted(self, estimate: int) -> None:
        self.in_flight += estimate
        self.demand.cost += estimate

    def settle(self, estimate: int, actual: int) -> None:
        """A request admitted here ended: its estimate leaves the hold, its actual cost is owed to Redis."""
        self.in_flight -= estimate
        self.unsent += actual

    def due(self, now: float) -> bool:
        """Whether a sync has something to tell Redis: spend, a changed hold, or a hold to renew."""
        return (
            bool(self.unsent)
            or self.hold != self.sent_hold
            or (self.sent_hold > 0 and now - self.synced > HOLD_TTL_S / 2)
        )

    def expire(self, now: float) -> None:
        """Give back a lease older than `LEASE_TTL_S` (with the next call)."""
        if now - self.granted > LEASE_TTL_S:
            self.available = 0

    def want(self, now: float, lease_s: float) -> int:
        """The lease to ask for: `lease_s` of this gateway's recent spending (nothing before it has any)."""
        if lease_s <= 0:
            return 0
        if not self.demand.since:
            self.demand.since = now
            return 0
        return int(self.demand.rate(now, 4 * lease_s) * lease_s)

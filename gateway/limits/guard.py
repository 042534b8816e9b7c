"""The request-path guard: rate limits, the monthly budget and keys' monthly spend limits, checked before
the upstream call and settled after it.

`admit()` takes one request and the estimated tokens (prompt estimate + max tokens) from the key's and the
organisation's buckets in one Lua call (a key without limits of its own gets `default_requests_per_minute` /
`default_tokens_per_minute`), or, while this gateway holds leases on all of them, from the leases in memory
(see `leases`), then holds the estimated cost against the organisation's budget and the key's spend limit,
each from this gateway's lease on it or with another call (see `holds`); `settle()` gives back the unused
tokens and turns the estimates into the actual cost, in memory. `admit_request()` takes one request from
the key's request bucket alone, for the routes of a key that cost no tokens (files, evals, graders, jobs,
models, usage). Limits and budgets are cached here for `limits_cache_ttl_s` (no database round trip per
request); the admin API drops the entry of an organisation it changes.

Every admitted completion carries OpenAI's `x-ratelimit-{limit,remaining,reset}-{requests,tokens}` headers:
the tightest bucket of each kind, or `UNLIMITED` for a kind no bucket limits.

While Redis is unreachable (down, or slower than its client's timeout) nothing fails open: the buckets go on
in this gateway's memory from the state Redis last reported (`fallback`), and budgets are held against the
month's spend in PostgreSQL plus this gateway's own since (`_hold_here`), as if it were the only gateway.

Size: over 450 lines, and left whole: its parts are split already (the Redis buckets in `buckets`, the
in-memory leases in `leases`, the budget holds in `holds`, the rate-limit headers in `headers`), and what
stays is one request path, `admit` and `settle`, over the caches, flights and background work they share;
cutting it would hand one class's state to another module.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
import time
from collections.abc import Coroutine
from dataclasses import dataclass, field
from typing import Any

import asyncpg

from gateway.errors import InsufficientQuota
from gateway.limits import store
from gateway.limits.buckets import (
    DOWN_FOR_S,
    Buckets,
    BucketState,
    TakeResult,
    bucket_key,
    key_month_key,
    month_key,
    to_micro,
)
from gateway.limits.budget import key_month_spend_usd, month_spend_usd
from gateway.limits.fallback import LocalBuckets
from gateway.limits.headers import headers_of, refusal_of
from gateway.limits.holds import HOLD_TTL_S, SYNC_S, Account
from gateway.limits.leases import LEASE_TTL_S, Leases
from gateway.settings import Settings
from gateway.singleflight import SingleFlight
from gateway.usage.pricing import completion_cost

logger = logging.getLogger(__name__)

ADJUST_DELAY_S = 0.01
"""How long token-bucket corrections wait to be sent together."""


@dataclass(frozen=True, slots=True)
class Limit:
    """Per-minute limits of one subject (None: unlimited)."""

    requests: int | None = None
    tokens: int | None = None


@dataclass(slots=True)
class OrgPolicy:
    """What the guard knows of one organisation."""

    org: Limit = field(default_factory=Limit)
    keys: dict[str, Limit] = field(default_factory=dict)
    budget_micro: int | None = None
    """Monthly hard limit in micro-USD, None for none."""
    key_spend_micro: dict[str, int] = field(default_factory=dict)
    """Monthly spend limits of its keys that have one, in micro-USD."""
    expires: float = 0.0
    plans: dict[str, list[tuple[str, int, str]]] = field(default_factory=dict)
    """Per API key: the buckets its requests take from, `(Redis key, capacity, kind)` (see `Guard._plan`)."""


@dataclass(slots=True)
class Admission:
    """A request let through: what to settle afterwards and which headers to send."""

    org_id: str
    base_model: str
    token_buckets: list[tuple[str, int, int]]
    """`(key, capacity, tokens taken)` of the token buckets charged with the estimate."""
    holds: list[tuple[str, int]]
    """`(month key, micro-USD held)` of the budget and the key's spend limit it is held against."""
    headers: dict[str, str]
    settled: bool = False


class Guard:
    """Rate limits and budgets for every request of one gateway."""

    def __init__(self, settings: Settings, pool: asyncpg.Pool, buckets: Buckets | None) -> None:
        self.settings = settings
        self.pool = pool
        self.buckets = buckets
        self._policies: dict[str, OrgPolicy] = {}
        self._loading: SingleFlight[str, OrgPolicy] = SingleFlight()
        self._forgotten = 0
        """Policies dropped so far: a load that saw this change while it ran does not cache its result."""
        self._adjustments: dict[str, tuple[int, int]] = {}
        """Token-bucket corrections not yet sent: bucket key -> (capacity, tokens to take, negative gives)."""
        self._flusher: asyncio.Task[None] | None = None
        self.leases = Leases(settings.rate_limit_lease_s)
        self.own_buckets = LocalBuckets()
        """The buckets this gateway keeps while Redis is unreachable (`fallback`)."""
        self._sweeper: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        self._accounts: dict[str, Account] = {}
        """This gateway's budget holds, by month key (see `holds`)."""
        self._syncer: asyncio.Task[None] | None = None
        self.gateway_id = secrets.token_hex(8)
        """Names this gateway's hold in the month hashes."""
        self._renewing: dict[tuple[str, ...], asyncio.Future[None]] = {}
        """Redis calls in flight per set of buckets: requests that find the leases short meanwhile wait
        for it (one call renews the leases for all of them) instead of each asking Redis."""
        self.default_key = Limit(
            settings.default_requests_per_minute or None, settings.default_tokens_per_minute or None
        )
        """Limits of a key that has none of its own (None: unlimited)."""

    # ---- cached policies ------------------------------------------------------------------------------
    async def policy(self, org_id: str) -> OrgPolicy:
        """The organisation's limits and budget: from the cache; an expired entry is still used while one
        refresh runs in the background (so an expiry under load costs no request a database round trip),
        a missing one is loaded once for all the requests that want it."""
        hit = self._policies.get(org_id)
        if hit is not None:
            if hit.expires <= time.monotonic() and org_id not in self._loading:
                self._loading.start(org_id, lambda: self._load_policy(org_id))
            return hit
        return await self._loading.run(org_id, lambda: self._load_policy(org_id))

    async def _load_policy(self, org_id: str) -> OrgPolicy:
        forgotten = self._forgotten
        policy = OrgPolicy(expires=time.monotonic() + self.settings.limits_cache_ttl_s)
        for row in await store.limits_of_org(self.pool, org_id=org_id):
            limit = Limit(row.max_requests_per_1_minute, row.max_tokens_per_1_minute)
            if row.api_key_id:
                if row.monthly_spend_limit_usd is not None:
                    policy.key_spend_micro[row.api_key_id] = to_micro(row.monthly_spend_limit_usd)
                # A field the key leaves unset falls back to the default, as a key without a row does.
                policy.keys[row.api_key_id] = Limit(
                    limit.requests or self.default_key.requests, limit.tokens or self.default_key.tokens
                )
            else:
                policy.org = limit
        billing = await store.billing_of_org(self.pool, org_id=org_id)
        if billing is not None and billing.monthly_budget_usd is not None:
            policy.budget_micro = to_micro(billing.monthly_budget_usd)
        if len(self._policies) > 100_000:
            self._policies.clear()
        if forgotten == self._forgotten:  # else a change landed meanwhile: the next request reads it
            self._policies[org_id] = policy
        return policy

    def _queue_adjust(self, key: str, cap: int, delta: int) -> None:
        """Token-bucket corrections go to this gateway's lease on the bucket when it holds one; else they
        are summed per bucket and sent together a few milliseconds later: one Redis call for many requests
        instead of one each (two calls per request were a third of the gateway's CPU). A correction only
        gives back or charges the difference to the estimate."""
        if delta == 0 or self.leases.settle(key, cap, delta):
            return
        entry = self._adjustments.get(key)
        self._adjustments[key] = (cap, delta + (entry[1] if entry is not None else 0))
        if self._flusher is None:
            self._flusher = asyncio.get_running_loop().create_task(self._flush_adjustments())

    async def _flush_adjustments(self) -> None:
        try:
            await asyncio.sleep(ADJUST_DELAY_S)
        finally:
            self._flusher = None
            pending, self._adjustments = self._adjustments, {}
            if pending and self.buckets is not None:
                await self.buckets.adjust([(k, cap, delta) for k, (cap, delta) in pending.items() if delta])

    async def _sweep_leases(self) -> None:
        """Give back what expired leases have left, while this gateway holds any."""
        try:
            while len(self.leases):
                await asyncio.sleep(LEASE_TTL_S)
                for key, cap, left in self.leases.expired(time.monotonic()):
                    self._queue_adjust(key, cap, -left)
        finally:
            self._sweeper = None

    def forget(self, org_id: str) -> None:
        """Drop the cached policy of an organisation (its limits or budget changed), and the leases of its
        budget and its keys' spend limits."""
        self._policies.pop(org_id, None)
        for account in self._accounts.values():
            if account.org_id == org_id:
                account.available = 0
        self._forgotten += 1

    async def month_spend_micro(self, org_id: str) -> int:
        """Month-to-date spend of an organisation from the database (completions and training)."""
        return to_micro(await month_spend_usd(self.pool, self.settings, org_id=org_id))

    async def _seed(self, account: Account) -> int:
        """What a new month's counter starts from: the month's spend of the account's organisation or key."""
        if account.key_id is None:
            return await self.month_spend_micro(account.org_id)
        org_id, key_id = account.org_id, account.key_id
        return to_micro(await key_month_spend_usd(self.pool, self.settings, org_id=org_id, key_id=key_id))

    # ---- the request path ------------------------------------------------------------------------------
    async def admit(
        self, org_id: str, key_id: str, base_model: str, prompt_tokens: int, max_tokens: int
    ) -> Admission:
        """Let a request through, or raise 429 `rate_limit_exceeded` / `insufficient_quota`."""
        policy = await self.policy(org_id)
        estimate = prompt_tokens + max_tokens
        plan = self._plan(policy, org_id, key_id)
        checks = [(key, cap, estimate if kind == "tokens" else 1) for key, cap, kind in plan]
        kinds = [kind for _, _, kind in plan]
        headers: dict[str, str] | None = None
        token_buckets: list[tuple[str, int, int]] = []
        if checks and self.buckets is not None:
            taken = await self._take(checks)
            headers = headers_of(kinds, taken.buckets)
            if not taken.allowed:
                raise refusal_of(taken, headers)
            if not taken.fallback:  # what this gateway's own buckets took stays taken
                token_buckets = [
                    (c[0], c[1], min(c[2], c[1])) for c, k in zip(checks, kinds, strict=True) if k == "tokens"
                ]
        if headers is None:  # nothing taken (no limits, or no Redis): the effective limits
            headers = headers_of(kinds, [BucketState(c[1], c[1], 0) for c in checks])
        admission = Admission(org_id, base_model, token_buckets, [], headers)
        if self.buckets is not None:
            key_limit = policy.key_spend_micro.get(key_id)
            if policy.budget_micro is not None:
                await self._reserve(admission, None, policy.budget_micro, prompt_tokens, max_tokens)
            if key_limit is not None:
                await self._reserve(admission, key_id, key_limit, prompt_tokens, max_tokens)
        return admission

    async def admit_request(self, org_id: str, key_id: str) -> None:
        """Take one request from the key's request bucket, or raise 429 `rate_limit_exceeded` (with
        `retry-after`): the per-key limit of the routes that cost no tokens (files, evals, graders, jobs,
        models, usage), so that a flood of them is refused as cheaply as a flood of chats. The key's bucket
        is the one its completions take from; the organisation's buckets and the budget meter model calls
        (those the graders routes make take from them as chats do), and reading one's files never waits for
        money."""
        limit = (await self.policy(org_id)).keys.get(key_id, self.default_key).requests
        if not limit or self.buckets is None:
            return
        checks = [(bucket_key(f"key:{key_id}", "requests"), limit, 1)]
        taken = await self._take(checks)
        if not taken.allowed:
            raise refusal_of(taken, headers_of(["requests"], taken.buckets))

    def _plan(self, policy: OrgPolicy, org_id: str, key_id: str) -> list[tuple[str, int, str]]:
        """The buckets a request of `key_id` takes from, built once per key and cached policy."""
        plan = policy.plans.get(key_id)
        if plan is None:
            plan = []
            key_limit = policy.keys.get(key_id, self.default_key)
            for subject, limit in ((f"key:{key_id}", key_limit), (f"org:{org_id}", policy.org)):
                for kind, cap in (("requests", limit.requests), ("tokens", limit.tokens)):
                    if cap:
                        plan.append((bucket_key(subject, kind), cap, kind))
            policy.plans[key_id] = plan
        return plan

    async def _take(self, checks: list[tuple[str, int, int]]) -> TakeResult:
        """From this gateway's leases when they cover every bucket, else from Redis (renewing them), else,
        while Redis is unreachable, from this gateway's own buckets (`fallback`)."""
        local = self.leases.take(checks, time.monotonic())
        if local is not None:
            if self.leases.low(checks):
                flight = tuple(c[0] for c in checks)
                if flight not in self._renewing:  # registered now, so that one top-up runs at a time
                    self._background(self._renew(checks, flight, self._flight(flight), top_up=True))
            return TakeResult(True, 0, local, [])
        flight = tuple(c[0] for c in checks)
        # A call in flight on the same buckets may bring leases for this request too: wait for it (then for
        # the next, while the buckets lend leases) rather than add a Redis call of its own. A burst on cold
        # buckets thus makes one call, not one per request.
        pending = self._renewing.get(flight)
        while pending is not None:
            await asyncio.shield(pending)
            local = self.leases.take(checks, time.monotonic())
            if local is not None:
                return TakeResult(True, 0, local, [])
            pending = self._renewing.get(flight) if self.leases.leasable(checks) else None
        taken = await self._renew(checks, flight, self._flight(flight))
        return self.own_buckets.take(checks) if taken is None else taken

    def _flight(self, flight: tuple[str, ...]) -> asyncio.Future[None]:
        """Register a Redis call on the buckets `flight`: what requests that find them short wait for."""
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._renewing[flight] = done
        return done

    async def _renew(
        self,
        checks: list[tuple[str, int, int]],
        flight: tuple[str, ...],
        done: asyncio.Future[None],
        *,
        top_up: bool = False,
    ) -> TakeResult | None:
        """One Redis call for `checks` (registered as `done`): the request's costs and new leases (a
        `top_up` takes the costs into the leases, for requests still to come)."""
        assert self.buckets is not None
        try:
            now = time.monotonic()
            renewals = self.leases.renewals(checks, now, top_up=top_up)
            taken = await self.buckets.take(checks, renewals)
            if taken is None:
                return None
            self.own_buckets.seen(checks, taken.buckets)
            for key, cap, amount in self.own_buckets.owed():  # Redis is back: what was taken meanwhile
                self._queue_adjust(key, cap, amount)
            if not taken.allowed:
                return taken
            states = self.leases.granted(checks, taken.buckets, taken.leased, now, top_up=top_up)
        finally:
            if self._renewing.get(flight) is done:
                del self._renewing[flight]
            done.set_result(None)
        if self._sweeper is None and len(self.leases):
            self._sweeper = self._background(self._sweep_leases())
        return TakeResult(True, 0, states, taken.leased)

    def _background(self, work: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run `work` as a task this guard keeps a reference to until it ends."""
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _reserve(
        self, adm: Admission, key_id: str | None, limit: int, prompt_tokens: int, max_tokens: int
    ) -> None:
        """Hold the request's estimated cost against the organisation's budget (`key_id` None) or the key's
        spend limit: from this gateway's lease, else with one Redis call (after the one in flight on the same
        month, if any); 429 `insufficient_quota` when over (what the request held already is given back)."""
        estimate = to_micro(completion_cost(self.settings, adm.base_model, prompt_tokens, max_tokens))
        key = month_key(adm.org_id) if key_id is None else key_month_key(key_id)
        account = self._accounts.get(key)
        if account is None:
            account = self._accounts[key] = Account(adm.org_id, limit, key_id=key_id)
            if self._syncer is None:
                self._syncer = self._background(self._sync_holds())
        account.limit = limit
        # A request that would cost more than the whole month's limit is refused here, Redis or not.
        granted: bool | None = estimate <= limit
        while granted and not account.take(estimate, time.monotonic()):
            if account.call is not None:
                await asyncio.shield(account.call)
                continue
            granted = await self._hold(key, account, estimate)
            if granted is None:  # a request that costs nothing, and Redis unreachable: nothing to hold
                return
            break
        if not granted:
            await self._refund_tokens(adm)
            self._release(adm)
            whose = "the organization's monthly budget"
            if key_id is not None:
                whose = "this API key's monthly spend limit"
            raise InsufficientQuota(
                f"You exceeded your current quota: {whose} is spent.", headers=adm.headers
            )
        adm.holds.append((key, estimate))

    async def _hold(self, key: str, account: Account, estimate: int) -> bool | None:
        """One Redis call for `account` (the only one in flight on it): sends its spend and its hold and, for
        a request's `estimate`, asks for it and for a lease. True granted, False over budget; while Redis is
        unreachable, as `_hold_here` decides (None for a sync, which has nothing to ask)."""
        assert self.buckets is not None
        done: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        account.call = done
        try:
            now = time.monotonic()
            account.expire(now)
            base, owed = account.hold, account.unsent
            call = functools.partial(
                self.buckets.hold,
                key,
                gateway=self.gateway_id,
                limit=account.limit,
                base=base,
                estimate=estimate,
                lease=account.want(now, self.leases.lease_s) if estimate else 0,
                spent=owed,
                ttl_ms=int(HOLD_TTL_S * 1000),
            )
            out = await call()
            if out is not None and out[0] == -1:  # a new month (or a new Redis): seed it from the database
                out = await call(seed=await self._seed(account))
            if out is None:
                return await self._hold_here(account, estimate) if estimate else None
            granted, lease = out
            account.unsent -= owed
            account.synced = time.monotonic()
            account.floor = None  # Redis counts again: a later outage reads the month afresh
            account.sent_hold = base
            if granted and estimate:
                account.admitted(estimate)
                account.available += lease
                account.sent_hold += estimate + lease
                if lease:
                    account.granted = account.synced
            return bool(granted)
        finally:
            account.call = None
            done.set_result(None)

    async def _hold_here(self, account: Account, estimate: int) -> bool:
        """Redis unreachable: hold `estimate` against what this gateway knows of the month, as if it were the
        only gateway: the spend in PostgreSQL (read again every `DOWN_FOR_S`), what it settled since and its
        requests in flight. What it spends meanwhile is owed to Redis, and sent once Redis answers."""
        now = time.monotonic()
        if account.floor is None or now - account.floor_at > DOWN_FOR_S:
            account.floor = await self._seed(account)
            account.floor_at, account.floor_unsent = now, account.unsent
        return account.fits_alone(estimate)

    async def _sync_holds(self) -> None:
        """Tell Redis this gateway's spend and holds every `SYNC_S` while it holds or owes any."""
        try:
            while self._accounts:
                await asyncio.sleep(SYNC_S)
                now = time.monotonic()
                due = []
                for key, account in list(self._accounts.items()):
                    account.expire(now)
                    if account.idle:
                        del self._accounts[key]
                    elif account.call is None and account.due(now):
                        due.append(self._hold(key, account, 0))
                # Shielded: a call cut short could not tell whether Redis counted the spend it carried.
                results = await asyncio.shield(asyncio.gather(*due, return_exceptions=True))
                for result in results:
                    if isinstance(result, Exception):
                        logger.warning("could not sync a budget hold: %s", result)
        finally:
            self._syncer = None

    async def aclose(self) -> None:
        """Stop the background work; give back every lease and send what is owed (the gateway stops)."""
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.buckets is None:
            return
        for key, account in list(self._accounts.items()):
            while account.call is not None:  # a sync still running
                await asyncio.shield(account.call)
            account.available = 0
            if account.due(time.monotonic()):
                await self._hold(key, account, 0)

    async def _refund_tokens(self, adm: Admission) -> None:
        if adm.token_buckets and self.buckets is not None:
            await self.buckets.adjust([(k, cap, -taken) for k, cap, taken in adm.token_buckets])

    def settle(self, adm: Admission, prompt_tokens: int, completion_tokens: int) -> None:
        """After the answer: charge the actual tokens and cost instead of the estimates, in memory (the next
        Redis calls carry them). Only the first call counts."""
        if adm.settled or self.buckets is None:
            return
        adm.settled = True
        actual = prompt_tokens + completion_tokens
        for key, cap, taken in adm.token_buckets:
            self._queue_adjust(key, cap, actual - taken)
        if adm.holds:
            cost = to_micro(completion_cost(self.settings, adm.base_model, prompt_tokens, completion_tokens))
            self._release(adm, cost)

    def _release(self, adm: Admission, cost: int = 0) -> None:
        """Take what `adm` holds off its accounts and owe them its actual `cost`."""
        for key, reserved in adm.holds:
            account = self._accounts.get(key)
            if account is not None:
                account.settle(reserved, cost)
        adm.holds = []

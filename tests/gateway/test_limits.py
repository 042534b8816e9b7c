"""Rate limits and budgets on the serving path, through a real engine: 429s with OpenAI's headers at the
configured rate and recovery after it; concurrent requests never overspend a budget; the files, evals,
graders, jobs, models and usage routes take from the key's request limit too, the admin key's usage reads
from none."""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import openai
import pytest
from redis.asyncio import Redis

from gateway.db import create_pool
from gateway.errors import InsufficientQuota, RateLimited
from gateway.limits import store as limits_store
from gateway.limits.buckets import (
    DOWN_FOR_S,
    Buckets,
    bucket_key,
    make_limits_redis,
    month_key,
    to_micro,
)
from gateway.limits.guard import Guard
from gateway.limits.headers import KINDS, UNLIMITED
from gateway.limits.leases import LEASE_TTL_S
from gateway.serving.tokens import estimate_prompt_tokens
from gateway.settings import ModelPrice, Settings
from tests.support.data import BASE, MESSAGES, SAYS_YES
from tests.support.fixtures import gateway_fixture
from tests.support.servers import RedisServer
from tests.support.stack import Admin, GatewayServer, Services, Tenant, make_settings
from tunegate.processes import free_port

DOLLAR_PER_TOKEN = ModelPrice(input_per_million=1e6, output_per_million=1e6)

gw = gateway_fixture("limits", prices={BASE: DOLLAR_PER_TOKEN})


def test_requests_per_minute_429_with_headers_then_recovery(gw_admin: Admin) -> None:
    org = gw_admin.tenant("rl-" + secrets.token_hex(3))
    resp = gw_admin.http.post(
        f"/v1/admin/api_keys/{org.key_id}/limits",
        json={"max_requests_per_1_minute": 30, "max_tokens_per_1_minute": 100_000},
    )
    assert resp.status_code == 200 and resp.json()["max_requests_per_1_minute"] == 30

    def ask(_: int) -> Any:
        return org.client.chat.completions.with_raw_response.create(
            model=BASE, messages=MESSAGES, max_tokens=1
        )

    with ThreadPoolExecutor(6) as pool:
        raws = list(pool.map(ask, range(30)))
    remaining = sorted(int(r.headers["x-ratelimit-remaining-requests"]) for r in raws)
    assert remaining == list(range(30))  # every request took exactly one
    assert all(r.headers["x-ratelimit-limit-requests"] == "30" for r in raws)
    assert all(r.headers["x-ratelimit-limit-tokens"] == "100000" for r in raws)
    with pytest.raises(openai.RateLimitError) as info:
        org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1)
    assert info.value.code == "rate_limit_exceeded"
    headers = info.value.response.headers
    assert int(headers["retry-after"]) >= 1 and headers["x-ratelimit-remaining-requests"] == "0"
    time.sleep(int(headers["retry-after"]) + 0.2)  # 30/min refills one every 2 s
    ok = org.client.chat.completions.with_raw_response.create(model=BASE, messages=MESSAGES, max_tokens=1)
    assert ok.http_response.status_code == 200
    # An organisation-wide token limit smaller than one request's estimate stops it too.
    gw_admin.http.post(f"/v1/admin/organizations/{org.org_id}/limits", json={"max_tokens_per_1_minute": 5})
    with pytest.raises(openai.RateLimitError):
        for _ in range(2):
            org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=50)


def test_concurrent_requests_never_overspend_the_budget(gw_admin: Admin) -> None:
    org = gw_admin.tenant("budget-" + secrets.token_hex(3))
    max_tokens = 2
    per_request = estimate_prompt_tokens({"messages": MESSAGES}) + max_tokens  # USD, at $1 a token
    budget = 10 * per_request + 0.5
    resp = gw_admin.http.post(
        f"/v1/admin/organizations/{org.org_id}/billing", json={"monthly_budget_usd": budget}
    )
    assert resp.status_code == 200 and resp.json()["monthly_budget_usd"] == budget
    outcomes = [code for code, _ in _fifty_at_once(org, max_tokens)]
    served = outcomes.count("served")
    assert 1 <= served <= 10, outcomes
    assert outcomes.count("insufficient_quota") == 50 - served


def _fifty_at_once(org: Tenant, max_tokens: int) -> list[tuple[str, str]]:
    """Fifty chats of `org`'s key at once: `("served", "")`, or the 429's code and message, for each."""

    def ask(_: int) -> tuple[str, str]:
        try:
            org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=max_tokens)
            return "served", ""
        except openai.RateLimitError as exc:
            # a spent budget is not worth a retry: the SDKs that honour the header raise at once
            assert exc.code != "insufficient_quota" or exc.response.headers["x-should-retry"] == "false"
            return str(exc.code), exc.message

    with ThreadPoolExecutor(50) as pool:
        return list(pool.map(ask, range(50)))


@contextlib.asynccontextmanager
async def _pool_and_redis(database: str, redis_url: str) -> AsyncIterator[tuple[asyncpg.Pool, Redis]]:
    """A database pool and a limits Redis client for guards made in the test."""
    pool = await create_pool(database, min_size=1, max_size=2)
    redis = make_limits_redis(redis_url)
    try:
        yield pool, redis
    finally:
        await redis.aclose()
        await pool.close()


def _guard_settings(services: Services, database: str, tmp_path: Path, **extra: Any) -> Settings:
    """Settings for guards made in the test, on the shared database and Redis."""
    return make_settings(
        data_dir=tmp_path, database_url=database, redis_url=services.redis_url, tiny_model=tmp_path, **extra
    )


def _budget_settings(services: Services, database: str, tmp_path: Path) -> Settings:
    """Guards' settings where a token costs $1 and keys have no rate limits: only budgets refuse."""
    return _guard_settings(
        services,
        database,
        tmp_path,
        prices={BASE: DOLLAR_PER_TOKEN},
        default_requests_per_minute=0,
        default_tokens_per_minute=0,
    )


def _set_budget(admin: Admin, org: Tenant, usd: float) -> None:
    admin.http.post(
        f"/v1/admin/organizations/{org.org_id}/billing", json={"monthly_budget_usd": usd}
    ).raise_for_status()


async def _script_calls(redis: Redis) -> int:
    """Lua script calls Redis has run so far (every limit and budget call is one)."""
    stats = await redis.info("commandstats")
    return sum(int(stats.get(f"cmdstat_{c}", {}).get("calls", 0)) for c in ("evalsha", "eval"))


async def _alternate_until_refused(guards: list[Guard], org: Tenant, refusal: type[Exception]) -> list[int]:
    """Requests (10 prompt tokens, 5 at most of completion, 2 used) through each guard in turn until every
    guard refuses with `refusal`; how many each admitted."""
    admitted = [0] * len(guards)
    refused: set[int] = set()
    i = 0
    while len(refused) < len(guards):
        g = i % len(guards)
        i += 1
        if g in refused:
            continue
        try:
            adm = await guards[g].admit(org.org_id, org.key_id, BASE, 10, 5)
        except refusal:
            refused.add(g)
            continue
        guards[g].settle(adm, 10, 2)
        admitted[g] += 1
    return admitted


RATE_HEADERS = [f"x-ratelimit-{what}-{kind}" for what in ("limit", "remaining", "reset") for kind in KINDS]


def test_rate_limit_headers_on_every_completion_without_configured_limits(gw_admin: Admin) -> None:
    org = gw_admin.tenant("hdr-" + secrets.token_hex(3))  # no limits of its own: the defaults apply
    chat = org.client.chat.completions.with_raw_response
    plain = org.client.completions.with_raw_response
    raws = [
        chat.create(model=BASE, messages=MESSAGES, max_tokens=2),
        chat.create(model=BASE, messages=MESSAGES, max_tokens=2, stream=True),
        plain.create(model=BASE, prompt="Paris is", max_tokens=2),
        plain.create(model=BASE, prompt="Paris is", max_tokens=2, stream=True),
    ]
    for raw in raws:
        for name in RATE_HEADERS:
            assert name in raw.headers, (name, dict(raw.headers))
        assert raw.headers["x-ratelimit-limit-requests"] == "10000"
        assert raw.headers["x-ratelimit-limit-tokens"] == "10000000"
        raw.parse()  # the body (or the whole stream) is a normal answer
    remaining = [int(r.headers["x-ratelimit-remaining-requests"]) for r in raws]
    # Each request took one from the key's default bucket (which refills 166 a second meanwhile).
    assert remaining[0] == 9999 and all(9996 <= r <= 9999 for r in remaining)
    tokens_left = int(raws[0].headers["x-ratelimit-remaining-tokens"])
    assert tokens_left == 10_000_000 - estimate_prompt_tokens({"messages": MESSAGES}) - 2


async def test_unlimited_defaults_still_send_headers(
    gw_admin: Admin, services: Services, database: str, tmp_path: Path
) -> None:
    """With both defaults 0 (unlimited) a key without limits takes nothing, yet its headers are there."""
    org = gw_admin.tenant("unl-" + secrets.token_hex(3))
    settings = _guard_settings(
        services, database, tmp_path, default_requests_per_minute=0, default_tokens_per_minute=0
    )
    async with _pool_and_redis(database, services.redis_url) as (pool, redis):
        guard = Guard(settings, pool, Buckets(redis))
        org_id = org.org_id
        adm = await guard.admit(org_id, org.key_id, BASE, 10, 5)
        assert adm.token_buckets == []  # nothing limits it, so nothing was taken
        for kind in KINDS:
            assert adm.headers[f"x-ratelimit-limit-{kind}"] == str(UNLIMITED)
            assert adm.headers[f"x-ratelimit-remaining-{kind}"] == str(UNLIMITED)
        # An organisation limit applies on its own kind; the other kind stays unlimited.
        await limits_store.set_limits(pool, org_id=org_id, key_id=None, requests=7, tokens=None)
        guard.forget(org_id)
        adm = await guard.admit(org_id, org.key_id, BASE, 10, 5)
        assert adm.headers["x-ratelimit-limit-requests"] == "7"
        assert adm.headers["x-ratelimit-remaining-requests"] == "6"
        assert adm.headers["x-ratelimit-limit-tokens"] == str(UNLIMITED)


async def test_leases_admit_locally_and_two_gateways_never_exceed_the_limit(
    gw_admin: Admin, services: Services, database: str, tmp_path: Path
) -> None:
    """Two guards (two gateways) on one bucket admit mostly from their leases, together exactly the limit
    (plus what refilled meanwhile); a lease left unused is given back to the bucket when it expires."""
    org = gw_admin.tenant("lease-" + secrets.token_hex(3))
    limit = 600
    gw_admin.http.post(
        f"/v1/admin/api_keys/{org.key_id}/limits",
        json={"max_requests_per_1_minute": limit, "max_tokens_per_1_minute": 100_000_000},
    ).raise_for_status()
    settings = _guard_settings(services, database, tmp_path)
    assert settings.rate_limit_lease_s > 0
    async with _pool_and_redis(database, services.redis_url) as (pool, redis):
        guards = [Guard(settings, pool, Buckets(redis)) for _ in range(2)]
        calls_before = await _script_calls(redis)
        started = time.monotonic()
        admitted = sum(await _alternate_until_refused(guards, org, RateLimited))
        refill = (time.monotonic() - started) * limit / 60
        calls = await _script_calls(redis) - calls_before
        assert limit <= admitted <= limit + refill + 1, (admitted, refill)
        assert calls < admitted / 4, (calls, admitted)  # most were admitted from the leases

        # One guard takes a lease and goes quiet: the sweep gives the lease back.
        fresh = gw_admin.tenant("lease-back-" + secrets.token_hex(3))
        quiet = Guard(settings, pool, Buckets(redis))
        for _ in range(40):
            await quiet.admit(fresh.org_id, fresh.key_id, BASE, 10, 5)
        key = bucket_key(f"key:{fresh.key_id}", "requests")
        before = float(await redis.hget(key, "tokens"))
        assert before < settings.default_requests_per_minute - 40  # the lease is out of the bucket
        await asyncio.sleep(LEASE_TTL_S * 2 + 0.1)
        after = float(await redis.hget(key, "tokens"))
        assert after >= settings.default_requests_per_minute - 40, (before, after)


async def test_budget_leases_admit_locally_and_two_gateways_never_overspend(
    gw_admin: Admin, services: Services, database: str, tmp_path: Path
) -> None:
    """Two guards (two gateways) spend one organisation's budget: mostly from their budget leases, together
    never beyond it and close to all of it; closing them gives their leases back and sends their spend, so
    Redis ends with exactly what was spent and no holds."""
    org = gw_admin.tenant("budget-lease-" + secrets.token_hex(3))
    budget_usd = 3000.0  # at $1 a token: 200 estimates of 15 tokens, 250 answers of 12
    _set_budget(gw_admin, org, budget_usd)
    settings = _budget_settings(services, database, tmp_path)
    async with _pool_and_redis(database, services.redis_url) as (pool, redis):
        guards = [Guard(settings, pool, Buckets(redis)) for _ in range(2)]
        calls_before = await _script_calls(redis)
        admitted = await _alternate_until_refused(guards, org, InsufficientQuota)
        calls = await _script_calls(redis) - calls_before
        served = sum(admitted)
        assert 12 * served <= budget_usd, admitted  # never beyond the budget
        assert 12 * served >= budget_usd - 15 - budget_usd / 8, admitted  # and close to all of it
        assert min(admitted) > 0 and calls < served / 4, (calls, admitted)  # mostly from the leases
        for guard in guards:
            await guard.aclose()
        month = await redis.hgetall(month_key(org.org_id))
        assert int(month[b"spent"]) == to_micro(12.0) * served
        assert not [f for f in month if f.startswith((b"h:", b"x:"))], month


async def test_rate_limits_hold_while_redis_is_gone(
    gw_admin: Admin, services: Services, database: str, tmp_path: Path
) -> None:
    """Redis stops between two requests of a key limited to 3 a minute: the guard goes on from the bucket's
    last state in its own memory (one left, not three), then refuses with OpenAI's 429 and `retry-after`;
    a key Redis never saw starts full. Nothing fails open; what was taken meanwhile is taken from Redis once
    it answers again."""
    org = gw_admin.tenant("redis-gone-" + secrets.token_hex(3))
    gw_admin.http.post(
        f"/v1/admin/api_keys/{org.key_id}/limits", json={"max_requests_per_1_minute": 3}
    ).raise_for_status()
    redis_server = RedisServer(free_port(), tmp_path)
    redis_server.start()
    settings = _guard_settings(services, database, tmp_path)
    try:
        async with _pool_and_redis(database, redis_server.url) as (pool, redis):
            guard = Guard(settings, pool, Buckets(redis))
            for _ in range(2):
                await guard.admit_request(org.org_id, org.key_id)
            assert guard.buckets is not None and guard.buckets.failures == 0
            redis_server.stop()
            await guard.admit_request(org.org_id, org.key_id)
            assert guard.buckets.failures == 1  # Redis was asked, and then left alone
            with pytest.raises(RateLimited) as info:
                await guard.admit_request(org.org_id, org.key_id)
            assert int(info.value.headers["retry-after"]) >= 1
            assert info.value.headers["x-ratelimit-remaining-requests"] == "0"
            # Chats take from the same bucket; another key's bucket starts full.
            with pytest.raises(RateLimited):
                await guard.admit(org.org_id, org.key_id, BASE, 10, 5)
            other = gw_admin.tenant("redis-gone-other-" + secrets.token_hex(3))
            adm = await guard.admit(other.org_id, other.key_id, BASE, 10, 5)
            assert adm.headers["x-ratelimit-remaining-requests"] == "9999"
            # A new Redis (empty) once the guard asks again: it is told the request taken meanwhile, so the
            # key's new bucket of 3 admits two more requests, not three.
            redis_server.start()
            await asyncio.sleep(DOWN_FOR_S + 0.2)
            await guard.admit_request(org.org_id, org.key_id)
            await asyncio.sleep(0.2)  # what is owed is sent a few milliseconds after
            await guard.admit_request(org.org_id, org.key_id)
            assert guard.buckets.failures == 1
            with pytest.raises(RateLimited):
                await guard.admit_request(org.org_id, org.key_id)
            await guard.aclose()
    finally:
        redis_server.stop()


async def test_budgets_hold_while_redis_is_unreachable(
    gw_admin: Admin, services: Services, database: str, tmp_path: Path
) -> None:
    """With no Redis to be reached, a budget of ten estimates admits exactly ten of fifty concurrent requests
    (the month's spend read from PostgreSQL, the requests in flight held in memory); settled requests free
    what they did not use, and one more fits."""
    org = gw_admin.tenant("budget-noredis-" + secrets.token_hex(3))
    _set_budget(gw_admin, org, 150.0)  # at $1 a token: ten estimates of 15 tokens
    settings = _budget_settings(services, database, tmp_path)
    async with _pool_and_redis(database, f"redis://127.0.0.1:{free_port()}/0") as (pool, redis):
        guard = Guard(settings, pool, Buckets(redis))

        async def one() -> Any:
            try:
                return await guard.admit(org.org_id, org.key_id, BASE, 10, 5)
            except InsufficientQuota:
                return None

        admitted = [a for a in await asyncio.gather(*(one() for _ in range(50))) if a is not None]
        assert len(admitted) == 10
        assert all(a.holds == [(month_key(org.org_id), to_micro(15.0))] for a in admitted)
        for adm in admitted[:5]:
            guard.settle(adm, 10, 2)  # $12 each instead of $15: $15 free again
        assert await one() is not None
        assert await one() is None
        assert guard.buckets is not None and guard.buckets.failures >= 1
        await guard.aclose()


async def test_a_hold_that_is_not_renewed_stops_counting(
    gw_admin: Admin, services: Services, database: str, tmp_path: Path
) -> None:
    """A gateway that died holding the whole budget blocks the others only until its hold expires."""
    org = gw_admin.tenant("budget-dead-" + secrets.token_hex(3))
    _set_budget(gw_admin, org, 100.0)
    settings = _guard_settings(services, database, tmp_path, prices={BASE: DOLLAR_PER_TOKEN})
    async with _pool_and_redis(database, services.redis_url) as (pool, redis):
        buckets = Buckets(redis)
        key = month_key(org.org_id)
        everything = to_micro(100.0)
        held = await buckets.hold(key, gateway="dead", limit=everything, base=everything, seed=0, ttl_ms=300)
        assert held == (1, 0)
        guard = Guard(settings, pool, buckets)
        with pytest.raises(InsufficientQuota):
            await guard.admit(org.org_id, org.key_id, BASE, 10, 5)
        await asyncio.sleep(0.4)
        adm = await guard.admit(org.org_id, org.key_id, BASE, 10, 5)
        assert adm.holds == [(key, to_micro(15.0))]
        assert b"h:dead" not in await redis.hgetall(key)  # forgotten by the call that found it expired
        await guard.aclose()


ROUTE_FAMILIES: dict[str, tuple[str, str, dict[str, Any] | None]] = {
    "files": ("GET", "/v1/files", None),
    "evals": ("GET", "/v1/evals", None),
    "graders": ("POST", "/v1/fine_tuning/alpha/graders/validate", {"grader": SAYS_YES}),
    "jobs": ("GET", "/v1/fine_tuning/jobs", None),
    "models": ("GET", "/v1/models", None),
    "usage": ("GET", "/v1/organization/usage/completions?start_time=0", None),
    "costs": ("GET", "/v1/organization/costs?start_time=0", None),
}
"""One request of each route family that costs no tokens: (method, path, JSON body)."""


@pytest.mark.parametrize("family", list(ROUTE_FAMILIES))
def test_routes_that_cost_no_tokens_take_from_the_keys_request_limit(
    gw: GatewayServer, gw_admin: Admin, family: str
) -> None:
    """A key limited to 2 requests a minute gets 2 answers from each route family of a key that costs no
    tokens (files, evals, graders, jobs, models, usage), then the chat route's 429 in OpenAI's envelope;
    its own chats share the bucket, another key's do not."""
    org = gw_admin.tenant("rl-routes-" + secrets.token_hex(3))
    gw_admin.http.post(
        f"/v1/admin/api_keys/{org.key_id}/limits", json={"max_requests_per_1_minute": 2}
    ).raise_for_status()
    method, path, body = ROUTE_FAMILIES[family]
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {org.key}"}, timeout=60) as api:
        answers = [api.request(method, path, json=body) for _ in range(3)]
    assert [a.status_code for a in answers] == [200, 200, 429], [a.text[:300] for a in answers]
    refused = answers[2]
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("requests", None, "rate_limit_exceeded")
    retry_s = int(refused.headers["retry-after"])
    assert 1 <= retry_s <= 30  # 2 a minute: one back every 30 s
    assert error["message"] == (
        f"Rate limit reached for this organization or API key; please try again in {retry_s}s."
    )
    assert refused.headers["x-ratelimit-limit-requests"] == "2"
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    with pytest.raises(openai.RateLimitError):  # the key's chats take from the same bucket
        org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1)
    other = gw_admin.tenant("rl-routes-other-" + secrets.token_hex(3))
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {other.key}"}, timeout=60) as api:
        assert api.request(method, path, json=body).status_code == 200
    if path.startswith("/v1/organization/"):  # the admin key, in no key's bucket, still reads that usage
        assert gw_admin.http.get(f"{path}&organization_id={org.org_id}").status_code == 200


def _second_key(admin: Admin, org: Tenant) -> Tenant:
    """Another key of `org`'s organisation."""
    made = admin.http.post(f"/v1/admin/organizations/{org.org_id}/api_keys", json={"name": "second"})
    made.raise_for_status()
    return Tenant(admin.gateway_url, org.org_id, made.json()["key"], made.json()["id"])


def test_a_keys_spend_limit_refuses_its_completions_and_no_other_keys(gw_admin: Admin) -> None:
    """Concurrent requests of a key never spend beyond its monthly spend limit; the organisation's other key
    goes on; the key's month to date is what it was served, from the usage rows."""
    org = gw_admin.tenant("key-spend-" + secrets.token_hex(3))
    other = _second_key(gw_admin, org)
    max_tokens = 2
    per_request = estimate_prompt_tokens({"messages": MESSAGES}) + max_tokens  # USD, at $1 a token
    limit = 10 * per_request + 0.5
    resp = gw_admin.http.post(
        f"/v1/admin/api_keys/{org.key_id}/spend_limit", json={"monthly_spend_limit_usd": limit}
    )
    assert resp.status_code == 200, resp.text
    assert resp.json() == {
        "object": "api_key.spend_limit",
        "api_key_id": org.key_id,
        "organization_id": org.org_id,
        "monthly_spend_limit_usd": limit,
        "month_to_date_usd": 0.0,
    }
    answers = _fifty_at_once(org, max_tokens)
    refusals = {message for code, message in answers if code == "insufficient_quota"}
    assert all(m.endswith("this API key's monthly spend limit is spent.") for m in refusals), refusals
    outcomes = [code for code, _ in answers]
    served = outcomes.count("served")
    assert 1 <= served <= 10, outcomes
    assert outcomes.count("insufficient_quota") == 50 - served
    answer = other.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=max_tokens)
    assert answer.usage is not None and answer.usage.completion_tokens >= 1  # the other key is not limited
    # The key's month to date, from the usage rows once they are written: what it was served (held against
    # the limit at the estimate, charged at the actual tokens, as the organisation's budget is).
    prompt = answer.usage.prompt_tokens
    low, high = served * (prompt + 1), served * (prompt + max_tokens)
    deadline = time.monotonic() + 15
    while (seen := gw_admin.http.get(f"/v1/admin/api_keys/{org.key_id}/spend_limit").json())[
        "month_to_date_usd"
    ] < low:
        assert time.monotonic() < deadline, seen
        time.sleep(0.3)
    assert low <= seen["month_to_date_usd"] <= high, (seen, served)
    with pytest.raises(openai.RateLimitError):  # spent: refused still
        org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1)
    listed = gw_admin.http.get(f"/v1/admin/organizations/{org.org_id}/limits").json()
    mine = [k for k in listed["api_keys"] if k["api_key_id"] == org.key_id]
    assert len(mine) == 1 and mine[0]["monthly_spend_limit_usd"] == limit
    assert mine[0]["max_requests_per_1_minute"] is None  # setting the spend limit left the rate limits alone
    # Cleared: the key is served again.
    cleared = gw_admin.http.post(
        f"/v1/admin/api_keys/{org.key_id}/spend_limit", json={"monthly_spend_limit_usd": None}
    )
    assert cleared.status_code == 200 and cleared.json()["monthly_spend_limit_usd"] is None
    org.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=1)


def test_spend_limit_bad_input_gets_openais_envelope(gw: GatewayServer, gw_admin: Admin) -> None:
    org = gw_admin.tenant("key-spend-bad-" + secrets.token_hex(3))
    path = f"/v1/admin/api_keys/{org.key_id}/spend_limit"
    for body in (
        {"monthly_spend_limit_usd": -1},
        {"monthly_spend_limit_usd": 1e10},
        {"monthly_spend_limit_usd": "ten"},
        {},
    ):
        resp = gw_admin.http.post(path, json=body)
        error = resp.json()["error"]
        assert resp.status_code == 400 and set(error) == {"message", "type", "param", "code"}, resp.text
        assert (error["type"], error["param"]) == ("invalid_request_error", "monthly_spend_limit_usd"), error
    raw = gw_admin.http.post(
        path, content='{"monthly_spend_limit_usd": NaN}', headers={"content-type": "application/json"}
    )
    assert raw.status_code == 400 and raw.json()["error"]["param"] == "monthly_spend_limit_usd", raw.text
    for method in ("GET", "POST"):
        missing = gw_admin.http.request(
            method, "/v1/admin/api_keys/key_nope/spend_limit", json={"monthly_spend_limit_usd": 1}
        )
        assert missing.status_code == 404 and missing.json()["error"]["param"] == "key_id", missing.text
    # Only the admin key sets it: the organisation's own key is refused.
    mine = httpx.post(
        f"{gw.url}{path}", json={"monthly_spend_limit_usd": 1}, headers={"Authorization": f"Bearer {org.key}"}
    )
    assert mine.status_code in (401, 403), mine.text
    assert gw_admin.http.get(path).json()["monthly_spend_limit_usd"] is None

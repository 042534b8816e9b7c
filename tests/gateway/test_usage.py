"""Usage metering through a real engine: a burst of mixed requests is recorded exactly, the usage API's
buckets agree with it, and one organisation never sees another's usage."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from tests.support.data import BASE, MESSAGES
from tests.support.engine import make_lora_adapter, register_model
from tests.support.fixtures import gateway_fixture
from tests.support.servers import PostgresServer
from tests.support.stack import Admin, GatewayServer, Tenant

gw = gateway_fixture("usage", usage_flush_interval_s=0.3)


def _rows(database: str, org_id: str) -> list[asyncpg.Record]:
    async def run() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(database)
        try:
            return await conn.fetch("SELECT * FROM completion_usage WHERE organization_id = $1", org_id)
        finally:
            await conn.close()

    return asyncio.run(run())


def test_burst_is_metered_exactly_and_usage_api_agrees(
    gw: GatewayServer, gw_admin: Admin, database: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    org = gw_admin.tenant("burst-" + secrets.token_hex(3))
    second = gw_admin.http.post(f"/v1/admin/organizations/{org.org_id}/api_keys", json={"name": "two"}).json()
    keys = [org, Tenant(gw.url, org.org_id, second["key"], second["id"])]
    ft = f"ft:{BASE}:{org.org_id}::ftjob-{secrets.token_hex(6)}"
    register_model(
        database, org.org_id, ft, str(make_lora_adapter(tiny_model_dir, tmp_path / "lora", seed=5))
    )
    start = int(time.time()) - 5

    def one(i: int) -> tuple[str, str, int, int]:
        who, model = keys[i % 2], (BASE, ft)[(i // 2) % 2]
        kwargs: dict[str, Any] = dict(model=model, messages=MESSAGES, max_tokens=1 + i % 3, temperature=0)
        if i % 4 == 3:
            chunks = list(
                who.client.chat.completions.create(
                    **kwargs, stream=True, stream_options={"include_usage": True}
                )
            )
            usage = chunks[-1].usage
        else:
            usage = who.client.chat.completions.create(**kwargs).usage
        assert usage is not None
        return who.key_id, model, usage.prompt_tokens, usage.completion_tokens

    with ThreadPoolExecutor(12) as pool:
        results = list(pool.map(one, range(200)))
    expected: Counter[tuple[str, str, str]] = Counter()
    for key_id, model, p, c in results:
        expected[(key_id, model, "in")] += p
        expected[(key_id, model, "out")] += c
        expected[(key_id, model, "n")] += 1

    deadline = time.monotonic() + 15
    while len(rows := _rows(database, org.org_id)) < 200 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(rows) == 200
    got: Counter[tuple[str, str, str]] = Counter()
    for r in rows:
        got[(r["api_key_id"], r["model"], "in")] += r["prompt_tokens"]
        got[(r["api_key_id"], r["model"], "out")] += r["completion_tokens"]
        got[(r["api_key_id"], r["model"], "n")] += 1
        assert r["base_model"] == BASE and r["status"] == 200 and r["latency_ms"] >= 0
    assert got == expected

    for group in ("model", "api_key_id"):
        page = httpx.get(
            f"{gw.url}/v1/organization/usage/completions",
            params={"start_time": start, "bucket_width": "1h", "group_by": group, "limit": 2},
            headers={"Authorization": f"Bearer {org.key}"},
        ).json()
        assert page["object"] == "page"
        api: Counter[tuple[str, str]] = Counter()
        for bucket in page["data"]:
            for res in bucket["results"]:
                api[(res[group], "in")] += res["input_tokens"]
                api[(res[group], "out")] += res["output_tokens"]
                api[(res[group], "n")] += res["num_model_requests"]
        index = 0 if group == "api_key_id" else 1
        want: Counter[tuple[str, str]] = Counter()
        for k, v in expected.items():
            want[((k[0], k[1])[index], k[2])] += v
        assert api == want

    costs = httpx.get(
        f"{gw.url}/v1/organization/costs",
        params={"start_time": start, "group_by": "line_item"},
        headers={"Authorization": f"Bearer {org.key}"},
    ).json()
    items = {r["line_item"]: r for b in costs["data"] for r in b["results"]}
    price = gw.settings.price_of(BASE)
    total_in = sum(v for k, v in expected.items() if k[2] == "in")
    assert items[f"{BASE}, input"]["quantity"] == total_in
    assert items[f"{BASE}, input"]["amount"]["value"] == pytest.approx(
        total_in * price.input_per_million / 1e6
    )


def test_usage_of_another_organisation_is_never_visible(gw: GatewayServer, gw_admin: Admin) -> None:
    a = gw_admin.tenant("ua-" + secrets.token_hex(3))
    b = gw_admin.tenant("ub-" + secrets.token_hex(3))
    start = int(time.time()) - 5
    a.client.chat.completions.create(model=BASE, messages=MESSAGES, max_tokens=2)
    time.sleep(1.0)  # one flush interval and more

    def total(key: str, **extra: str) -> int:
        page = httpx.get(
            f"{gw.url}/v1/organization/usage/completions",
            params={"start_time": start, "bucket_width": "1h", **extra},
            headers={"Authorization": f"Bearer {key}"},
        )
        assert page.status_code == 200
        return sum(r["num_model_requests"] for bk in page.json()["data"] for r in bk["results"])

    assert total(a.key) == 1
    assert total(b.key) == 0
    assert total(b.key, organization_id=a.org_id) == 0  # a key cannot name another organisation
    admin_key = gw.settings.admin_key
    assert admin_key is not None
    assert total(admin_key.get_secret_value(), organization_id=a.org_id) == 1
    assert total(admin_key.get_secret_value(), organization_id=b.org_id) == 0


def test_a_batch_is_written_whole_even_with_a_row_of_an_unknown_organisation(own_database: str) -> None:
    """Usage is an append-only log: one row naming no organisation the database knows (there is no foreign
    key to check on every row) does not fail, and so cannot hold back, the rest of its batch."""
    from gateway.db import create_pool, migrate
    from gateway.usage.buffer import UsageBuffer

    async def run() -> list[tuple[str, int]]:
        await migrate(own_database)
        pool = await create_pool(own_database, min_size=1, max_size=2)
        try:
            buffer = UsageBuffer(flush_interval_s=60)
            buffer.start(pool)
            usage = {"prompt_tokens": 3, "completion_tokens": 4}
            for org in ("org_a", "org_gone", "org_a"):
                buffer.record(org, "key_1", "tiny-chat", usage, started=time.time())
            await buffer.aclose()
            assert buffer.written == 3 and buffer.pending == 0 and buffer.dropped == 0
            rows = await pool.fetch(
                "SELECT organization_id, completion_tokens FROM completion_usage ORDER BY id"
            )
            return [(r["organization_id"], r["completion_tokens"]) for r in rows]
        finally:
            await pool.close()

    assert asyncio.run(run()) == [("org_a", 4), ("org_gone", 4), ("org_a", 4)]


def test_usage_recorded_while_postgres_restarts_is_written_once_it_is_back(tmp_path: Path) -> None:
    """The flushes' kept connection dies with the server: the rows wait in the buffer, and the first flush
    after the restart writes them on a new connection, none lost and none twice."""
    from gateway.db import create_pool, migrate
    from gateway.usage.buffer import UsageBuffer

    server = PostgresServer(tmp_path / "pg")
    server.start()
    dsn = server.url
    usage = {"prompt_tokens": 3, "completion_tokens": 4}

    async def run() -> tuple[int, int, int]:
        await migrate(dsn)
        pool = await create_pool(dsn, min_size=1, max_size=2)
        try:
            buffer = UsageBuffer(flush_interval_s=60)
            buffer._pool = pool  # flushed by hand below, not by the background task
            for _ in range(3):
                buffer.record("org_a", "key_1", "tiny-chat", usage, started=time.time())
            assert await buffer.flush() == 3
            server.stop()  # under the kept connection
            for _ in range(2):
                buffer.record("org_a", "key_1", "tiny-chat", usage, started=time.time())
            with pytest.raises((OSError, asyncpg.PostgresError, asyncpg.InterfaceError)):
                await buffer.flush()
            assert buffer.pending == 2
            server.start()
            written = 0
            for _ in range(50):  # the pool may hand out a dead connection first
                try:
                    written = await buffer.flush()
                    break
                except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError):
                    await asyncio.sleep(0.2)
            await buffer.aclose()
            rows = await pool.fetchval("SELECT count(*) FROM completion_usage")
            return written, rows, buffer.dropped
        finally:
            await pool.close()

    try:
        assert asyncio.run(run()) == (2, 5, 0)
    finally:
        server.stop()

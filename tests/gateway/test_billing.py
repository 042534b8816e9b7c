"""Stripe billing: the real `stripe` SDK against a local stand-in of Stripe's meter-event endpoint that
checks required fields, dedupes by `identifier` and fails a share of calls with 429/500.

The billing pass runs in a child process that is killed mid-flight twice, then once to the end: the
stand-in's totals must equal the database's usage — nothing lost, nothing billed twice.
"""

from __future__ import annotations

import asyncio
import os
import random
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import asyncpg
import pytest

from gateway.settings import Settings, settings_env
from gateway.usage.buffer import COLUMNS as USAGE_COLUMNS
from tests.support.stack import ROOT, Admin
from tests.support.stripe import StripeStandIn, serve_stripe

EVENTS = {
    "input_tokens": "tg_test_input",
    "output_tokens": "tg_test_output",
    "training_tokens": "tg_test_training_tokens",
    "training_seconds": "tg_test_training_seconds",
}


@pytest.fixture(scope="module")
def stripe_standin() -> Iterator[tuple[StripeStandIn, str]]:
    with serve_stripe(fail_rate=0.3) as served:
        yield served


def _billing_settings(database: str, base: str, data_dir: Path) -> Settings:
    return Settings(
        data_dir=data_dir,
        database_url=database,
        stripe_api_key="sk_test_standin",  # type: ignore[arg-type]
        stripe_api_base=base,
        stripe_max_retries=1,
        stripe_meter_input_tokens=EVENTS["input_tokens"],
        stripe_meter_output_tokens=EVENTS["output_tokens"],
        stripe_meter_training_tokens=EVENTS["training_tokens"],
        stripe_meter_training_seconds=EVENTS["training_seconds"],
        billing_window_s=600,
    )


async def _seed_usage(database: str, orgs: list[str]) -> None:
    """Completion usage over the last hours (many windows) and a job's training usage per organisation."""
    rng = random.Random(11)
    now = datetime.now(UTC)
    conn = await asyncpg.connect(database)
    try:
        for org in orgs:
            rows = [
                (
                    org,
                    "key_x",
                    "tiny-chat",
                    "tiny-chat",
                    rng.randint(1, 500),
                    rng.randint(1, 200),
                    10,
                    200,
                    now - timedelta(seconds=rng.randint(1, 5 * 3600)),
                )
                for _ in range(150)
            ]
            await conn.copy_records_to_table(
                "completion_usage",
                records=rows,
                columns=USAGE_COLUMNS,
            )
            job = "ftjob-" + secrets.token_hex(6)
            await conn.execute(
                "INSERT INTO fine_tuning_jobs (id, organization_id, model, training_file, status, method,"
                " seed) VALUES ($1, $2, 'tiny-chat', 'file-x', 'succeeded',"
                ' \'{"type": "supervised"}\'::jsonb, 1)',
                job,
                org,
            )
            for attempt in range(3):
                await conn.execute(
                    "INSERT INTO training_usage (organization_id, job_id, base_model, method,"
                    " trained_tokens, steps, training_seconds, outcome, created_at)"
                    " VALUES ($1, $2, 'tiny-chat', 'supervised', $3, 2, $4, 'paused',"
                    " now() - make_interval(mins => $5))",
                    org,
                    job,
                    1000 + attempt,
                    12.5 + attempt,
                    attempt * 30,
                )
    finally:
        await conn.close()


async def _db_totals(database: str, orgs: list[str]) -> dict[str, dict[str, int]]:
    conn = await asyncpg.connect(database)
    try:
        out: dict[str, dict[str, int]] = {}
        for org in orgs:
            c = await conn.fetchrow(
                "SELECT sum(prompt_tokens)::bigint AS i, sum(completion_tokens)::bigint AS o,"
                " bool_and(billed) AS billed FROM completion_usage WHERE organization_id = $1",
                org,
            )
            t = await conn.fetchrow(
                "SELECT sum(trained_tokens)::bigint AS tt, bool_and(billed) AS billed"
                " FROM training_usage WHERE organization_id = $1",
                org,
            )
            assert c["billed"] and t["billed"]
            out[org] = {"input_tokens": c["i"], "output_tokens": c["o"], "training_tokens": t["tt"]}
        return out
    finally:
        await conn.close()


async def _outbox(database: str, orgs: list[str]) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(database)
    try:
        return await conn.fetch("SELECT * FROM billing_outbox WHERE organization_id = ANY($1::text[])", orgs)
    finally:
        await conn.close()


def _billing_child(settings: Settings) -> subprocess.Popen[bytes]:
    code = (
        "import asyncio, logging\n"
        "from gateway.settings import Settings\n"
        "from gateway.db import create_pool\n"
        "from gateway.billing.outbox import run_billing\n"
        "async def main():\n"
        "    s = Settings()\n"
        "    pool = await create_pool(s.database_url)\n"
        "    print(await run_billing(pool, s), flush=True)\n"
        "asyncio.run(main())\n"
    )
    env = {**os.environ, **settings_env(settings)}
    return subprocess.Popen([sys.executable, "-c", code], env=env, cwd=str(ROOT))


def test_stripe_totals_match_database_through_faults_and_kills(
    admin: Admin, database: str, stripe_standin: tuple[StripeStandIn, str], tmp_path: Path
) -> None:
    standin, base = stripe_standin
    orgs, customers = [], {}
    for i in range(2):
        tenant = admin.tenant(f"billed-{i}-" + secrets.token_hex(3))
        customer = "cus_" + secrets.token_hex(6)
        resp = admin.http.post(
            f"/v1/admin/organizations/{tenant.org_id}/billing", json={"stripe_customer_id": customer}
        )
        assert resp.status_code == 200 and resp.json()["stripe_customer_id"] == customer
        orgs.append(tenant.org_id)
        customers[tenant.org_id] = customer
    asyncio.run(_seed_usage(database, orgs))
    settings = _billing_settings(database, base, tmp_path)

    for more in (1, 5):  # killed mid-flight: once Stripe has seen `more` calls of it
        seen = standin.calls
        child = _billing_child(settings)
        deadline = time.monotonic() + 120
        while standin.calls < seen + more and child.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        child.kill()
        child.wait()
    killed_calls = standin.calls
    for _ in range(6):  # to the end: faults leave rows pending for the next pass
        child = _billing_child(settings)
        assert child.wait(timeout=120) == 0
        if all(r["status"] == "sent" for r in asyncio.run(_outbox(database, orgs))):
            break
    rows = asyncio.run(_outbox(database, orgs))
    assert rows and all(r["status"] == "sent" for r in rows)
    assert standin.failures > 0 and killed_calls > 0

    expected = asyncio.run(_db_totals(database, orgs))
    got = standin.totals()
    for org in orgs:
        for meter in ("input_tokens", "output_tokens", "training_tokens"):
            assert got.get((customers[org], EVENTS[meter]), 0) == expected[org][meter], (org, meter)
        assert got[(customers[org], EVENTS["training_seconds"])] > 0
    # The outbox is visible to the admin: everything for these organisations is sent.
    listed = admin.http.get("/v1/admin/billing/outbox", params={"organization_id": orgs[0], "limit": 1000})
    assert listed.status_code == 200
    assert {r["status"] for r in listed.json()["data"]} == {"sent"}
    assert len(listed.json()["data"]) == len([r for r in rows if r["organization_id"] == orgs[0]])

"""What the Tinker API keeps of a request: its data until it is answered, its answer for
`tinker_request_retention_s` (a worker's cron forgets older ones). On a migrated database of its own."""

from __future__ import annotations

import asyncpg

from gateway.tenancy import store as tenancy_store
from gateway.tinker import store


async def test_answered_requests_drop_their_data_and_are_forgotten_later(migrated_pool: asyncpg.Pool) -> None:
    pool = migrated_pool
    org = (await tenancy_store.create_org(pool, name="tinker-store")).id
    data = {"data": [{"tokens": list(range(100)), "inputs": {"target_tokens": list(range(100))}}]}
    for name in ("done", "failed", "open"):
        await store.add_request(
            pool, request_id=f"tr-{name}", org_id=org, model_id=None, kind="forward_backward", payload=data
        )
    await store.finish(pool, request_id="tr-done", result=b"answer")
    await store.finish(pool, request_id="tr-failed", error="it broke", category="user")
    payloads = dict(await pool.fetch("SELECT id, payload FROM tinker_requests"))
    assert payloads == {"tr-done": {}, "tr-failed": {}, "tr-open": data}

    assert await store.forget_finished(pool, older_than_s=3600) == 0  # answered just now: kept
    assert (await store.get_request(pool, request_id="tr-done", org_id=org)).result == b"answer"  # type: ignore[union-attr]
    await pool.execute(
        "UPDATE tinker_requests SET finished_at = now() - interval '2 hours' WHERE id = 'tr-done'"
    )
    assert await store.forget_finished(pool, older_than_s=3600) == 1
    assert await store.get_request(pool, request_id="tr-done", org_id=org) is None
    assert await store.forget_finished(pool, older_than_s=0) == 1  # the failed one; the open one stays
    assert await store.get_request(pool, request_id="tr-open", org_id=org) is not None

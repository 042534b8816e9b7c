"""What the Tinker API keeps: a request's data until it is answered, its answer for
`tinker_request_retention_s`, a checkpoint until it expires (a worker's cron forgets what is past). On a
migrated database of its own."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from gateway.blobstore import BlobStore
from gateway.models import store as models_store
from gateway.settings import Settings
from gateway.tenancy import store as tenancy_store
from gateway.tinker import store
from gateway.tinker.housekeeping import tinker_housekeeping
from gateway.tinker.paths import SEGMENT, checkpoint_key, served_model_id


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


async def test_expired_checkpoints_go_with_their_served_model_and_files(
    migrated_pool: asyncpg.Pool, tmp_path: Path
) -> None:
    pool = migrated_pool
    org = (await tenancy_store.create_org(pool, name="tinker-expiry")).id
    model_id = "ts-expiry:train:0"
    await store.create_model(
        pool, model_id=model_id, org_id=org, key_id="key", session_id="ts-expiry", base_model="tiny-chat",
        rank=4, lora_config={"rank": 4}, metadata=None,
    )  # fmt: skip
    blobs = BlobStore(tmp_path / "blobs")
    for name, ttl in (("old", 3600.0), ("kept", None)):
        key = checkpoint_key(org, model_id, SEGMENT["sampler"], name)
        (blobs.path(key)).mkdir(parents=True)
        (blobs.path(key) / "adapter_model.safetensors").write_bytes(b"weights")
        await store.add_checkpoint(
            pool, org_id=org, model_id=model_id, kind="sampler", name=name, path=str(blobs.path(key)),
            served_model=served_model_id("tiny-chat", org, model_id, name), with_optimizer=False,
            size_bytes=7, base_model="tiny-chat", ttl_s=ttl,
        )  # fmt: skip
    listed = {c.name: c for c in await store.list_checkpoints(pool, org_id=org, model_id=model_id)}
    assert listed["old"].expires_at is not None and listed["kept"].expires_at is None
    ctx = {"settings": Settings(base_models={}), "pool": pool, "blobs": blobs}
    assert await tinker_housekeeping(ctx) == {"requests": 0, "checkpoints": 0}  # nothing due yet

    await pool.execute(
        "UPDATE tinker_checkpoints SET expires_at = now() - interval '1 second' WHERE name = 'old'"
    )
    # past its expiry it is no longer listed nor loadable, even before the cron runs
    assert [c.name for c in await store.list_checkpoints(pool, org_id=org, model_id=model_id)] == ["kept"]
    assert await store.get_checkpoint(pool, org_id=org, model_id=model_id, kind="sampler", name="old") is None
    assert await tinker_housekeeping(ctx) == {"requests": 0, "checkpoints": 1}
    served = {r.id for r in await models_store.list_for_org(pool, org_id=org)}
    assert served == {served_model_id("tiny-chat", org, model_id, "kept")}
    assert not blobs.exists(checkpoint_key(org, model_id, SEGMENT["sampler"], "old"))
    assert blobs.exists(checkpoint_key(org, model_id, SEGMENT["sampler"], "kept"))

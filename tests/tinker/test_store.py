"""What the Tinker API keeps: a request's data until it is answered, its answer for
`tinker_request_retention_s`, a checkpoint until it expires (a worker's cron forgets what is past); ids taken
once, rows of one organisation never replaced by another's, and blob keys made only of checked parts. On a
migrated database of its own."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import asyncpg
import pytest

from gateway.blobstore import BlobStore
from gateway.db import list_migrations
from gateway.models import store as models_store
from gateway.settings import Settings
from gateway.tenancy import store as tenancy_store
from gateway.tinker import store
from gateway.tinker.housekeeping import tinker_housekeeping
from gateway.tinker.paths import (
    IDLE_SEGMENT,
    SEGMENT,
    checkpoint_key,
    model_id_of,
    parse_tinker_path,
    sampler_id_of,
    served_model_id,
    workdir_key,
)

MODEL: dict[str, Any] = {
    "key_id": "key",
    "base_model": "tiny-chat",
    "rank": 4,
    "lora_config": {"rank": 4},
    "metadata": None,
}
"""The fields of a Tinker model row that no test here varies."""


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
    await store.create_model(pool, model_id=model_id, org_id=org, session_id="ts-expiry", **MODEL)
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


async def test_an_id_in_use_is_reported_and_another_organisations_rows_are_never_replaced(
    migrated_pool: asyncpg.Pool,
) -> None:
    pool = migrated_pool
    a = (await tenancy_store.create_org(pool, name="tinker-ids-a")).id
    b = (await tenancy_store.create_org(pool, name="tinker-ids-b")).id
    await store.create_session(
        pool, session_id="ts-a", org_id=a, key_id="key", tags=[], metadata=None, sdk=""
    )
    assert await store.own_session(pool, session_id="ts-a", org_id=a)
    assert not await store.own_session(pool, session_id="ts-a", org_id=b)
    made = await store.create_model(pool, model_id="ts-a:train:0", org_id=a, session_id="ts-a", **MODEL)
    assert made is not None and made.seq > 0
    assert (
        await store.create_model(pool, model_id="ts-a:train:0", org_id=a, session_id="ts-a", **MODEL) is None
    )
    sampler = {
        "session_id": "ts-a",
        "base_model": "tiny-chat",
        "model_path": None,
        "served_model": "tiny-chat",
    }
    assert await store.create_sampler(pool, sampler_id="ts-a:sample:0", org_id=a, **sampler)
    assert not await store.create_sampler(pool, sampler_id="ts-a:sample:0", org_id=a, **sampler)

    # a checkpoint (and the model it is served as) is replaced by its own organisation only
    served = served_model_id("tiny-chat", a, "ts-a:train:0", "s")
    ckpt = {"model_id": "ts-a:train:0", "kind": "sampler", "name": "s", "with_optimizer": False}
    await store.add_checkpoint(
        pool, org_id=a, path="/blobs/a", served_model=served, size_bytes=1, base_model="tiny-chat", **ckpt
    )
    with pytest.raises(ValueError, match="another organisation"):
        await store.add_checkpoint(
            pool, org_id=b, path="/blobs/b", served_model=served, size_bytes=2, base_model="tiny-chat", **ckpt
        )
    kept = await store.get_checkpoint(pool, org_id=a, model_id="ts-a:train:0", kind="sampler", name="s")
    assert kept is not None and kept.path == "/blobs/a"
    assert await pool.fetchval("SELECT adapter_path FROM models WHERE id = $1", served) == "/blobs/a"
    assert await pool.fetchval("SELECT count(*) FROM models WHERE organization_id = $1", b) == 0


async def test_rows_made_against_the_id_policy_before_it_held_are_dropped(
    migrated_pool: asyncpg.Pool,
) -> None:
    """Migration 0012, applied again over rows a client could make before ids were checked: a model in
    another organisation's session, one under a path for a session id, and their samplers, checkpoints,
    served models and requests go; the rightful owner's rows stay."""
    pool = migrated_pool
    a = (await tenancy_store.create_org(pool, name="tinker-forged-a")).id
    b = (await tenancy_store.create_org(pool, name="tinker-forged-b")).id
    await store.create_session(
        pool, session_id="ts-a", org_id=a, key_id="key", tags=[], metadata=None, sdk=""
    )
    forged = {
        "ts-a:train:1": (b, "ts-a"),  # b squatting in a's session
        f"../{a}/ts-a:train:0": (b, f"../{a}/ts-a"),  # a path for a session id
    }
    for i, (model_id, (org, session)) in enumerate({"ts-a:train:0": (a, "ts-a"), **forged}.items()):
        await store.create_model(pool, model_id=model_id, org_id=org, session_id=session, **MODEL)
        await store.add_request(
            pool,
            request_id=f"tr-{i}",
            org_id=org,
            model_id=model_id,
            kind="optim_step",
            payload={},
        )
        served = served_model_id("tiny-chat", org, model_id, "s")
        await store.add_checkpoint(
            pool, org_id=org, model_id=model_id, kind="sampler", name="s", path="/x", served_model=served,
            with_optimizer=False, size_bytes=1, base_model="tiny-chat",
        )  # fmt: skip
    for sampler_id, org in (("ts-a:sample:0", a), ("ts-a:sample:1", b)):
        await store.create_sampler(
            pool, sampler_id=sampler_id, org_id=org, session_id="ts-a", base_model="tiny-chat",
            model_path=None, served_model="tiny-chat",
        )  # fmt: skip

    migration = next(path for version, _, path in list_migrations() if version == 12)
    await pool.execute(migration.read_text())

    assert [r["id"] for r in await pool.fetch("SELECT id FROM tinker_models")] == ["ts-a:train:0"]
    assert [r["model_id"] for r in await pool.fetch("SELECT model_id FROM tinker_requests")] == [
        "ts-a:train:0"
    ]
    assert [r["model_id"] for r in await pool.fetch("SELECT model_id FROM tinker_checkpoints")] == [
        "ts-a:train:0"
    ]
    assert [r["organization_id"] for r in await pool.fetch("SELECT organization_id FROM models")] == [a]
    assert [r["id"] for r in await pool.fetch("SELECT id FROM tinker_samplers")] == ["ts-a:sample:0"]


def test_keys_are_made_only_of_checked_parts() -> None:
    assert (
        checkpoint_key("org-a1", "ts-Ab1:train:3", "weights", "v1..2")
        == "tinker/org-a1/ts-Ab1_train_3/weights/v1..2"
    )
    assert checkpoint_key("org-a1", "ts-Ab1:train:3", IDLE_SEGMENT, "resume").endswith("/idle/resume")
    for org, model_id, segment, name in (
        ("org-a1", "../org-b/ts-x:train:0", "weights", "a"),
        ("org-a1", "/abs:train:0", "weights", "a"),
        ("org-a1", "ts-x:train:-1", "weights", "a"),
        ("org-a1", "ts-x:sample:0", "weights", "a"),
        ("../org-b", "ts-x:train:0", "weights", "a"),
        ("org-a1", "ts-x:train:0", "..", "a"),
        ("org-a1", "ts-x:train:0", "weights", ".."),
        ("org-a1", "ts-x:train:0", "weights", "a/../../b"),
    ):
        with pytest.raises(ValueError):
            checkpoint_key(org, model_id, segment, name)
    with pytest.raises(ValueError):
        model_id_of("../org-b/ts-x", 0)
    with pytest.raises(ValueError):
        model_id_of("ts-x", -1)
    assert model_id_of("ts-x", 7) == "ts-x:train:7" and sampler_id_of("ts-x", 0) == "ts-x:sample:0"
    assert parse_tinker_path("tinker://ts-x:train:0/weights/a") == ("ts-x:train:0", "training", "a")
    for path in (
        "tinker://../org-b/ts-x:train:0/weights/a",
        "tinker://..:train:0/weights/a",
        "tinker://ts-x:train:0/weights/..",
        "tinker:///etc:train:0/weights/a",
    ):
        assert parse_tinker_path(path) is None
    assert workdir_key(12) == "work/tinker/12"

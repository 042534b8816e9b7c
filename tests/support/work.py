"""Worker-held work made straight in the database, for tests of claiming and leases without a stack."""

from __future__ import annotations

import asyncpg

from gateway.tinker import store as tinker_store


async def waiting_model(pool: asyncpg.Pool, org_id: str, name: str) -> str:
    """A Tinker training model `ts-<name>:train:0` with one open request and no holder; returns its id."""
    model_id = f"ts-{name}:train:0"
    await tinker_store.create_model(
        pool, model_id=model_id, org_id=org_id, key_id="key", session_id=f"ts-{name}", base_model="tiny-chat",
        rank=4, lora_config={"rank": 4}, metadata=None,
    )  # fmt: skip
    await tinker_store.add_request(
        pool, request_id=f"tr-{name}", org_id=org_id, model_id=model_id, kind="forward_backward", payload={}
    )
    return model_id

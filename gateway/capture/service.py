"""Capture settings (admin API) and the stored-completions API over the organisation's captured calls.
Another organisation's ids are 404, as unknown ones are."""

from __future__ import annotations

import dataclasses
from typing import Any, Literal

from gateway.capture import store
from gateway.capture.protocol import (
    CaptureSettingOut,
    CaptureUpdate,
    check_metadata,
    deleted,
    stored_completion,
    stored_messages,
)
from gateway.capture.sequences import Turn, rebuild
from gateway.capture.store import CapturedRow
from gateway.deps import Resources
from gateway.errors import not_found
from gateway.tenancy import store as tenancy_store
from gateway.tenancy.keys import Principal


# ---- admin ------------------------------------------------------------------------------------------------
async def _check_org(res: Resources, org_id: str) -> None:
    if await tenancy_store.get_org(res.pool, org_id=org_id) is None:
        raise not_found("organization", org_id, param="org_id")


async def _org_of_key(res: Resources, key_id: str) -> str:
    org_id = await store.org_of_key(res.pool, key_id=key_id)
    if org_id is None:
        raise not_found("API key", key_id, param="key_id")
    return org_id


async def set_org(res: Resources, org_id: str, body: CaptureUpdate) -> CaptureSettingOut:
    await _check_org(res, org_id)
    row = await store.set_setting(
        res.pool, org_id=org_id, key_id="", enabled=body.enabled, retention_days=body.retention_days
    )
    res.capture.policies.put(row)
    return CaptureSettingOut.of(org_id, None, row)


async def get_org(res: Resources, org_id: str) -> CaptureSettingOut:
    await _check_org(res, org_id)
    return CaptureSettingOut.of(org_id, None, await store.get_setting(res.pool, org_id=org_id, key_id=""))


async def set_key(res: Resources, key_id: str, body: CaptureUpdate) -> CaptureSettingOut:
    org_id = await _org_of_key(res, key_id)
    row = await store.set_setting(
        res.pool, org_id=org_id, key_id=key_id, enabled=body.enabled, retention_days=body.retention_days
    )
    res.capture.policies.put(row)
    return CaptureSettingOut.of(org_id, key_id, row)


async def get_key(res: Resources, key_id: str) -> CaptureSettingOut:
    org_id = await _org_of_key(res, key_id)
    row = await store.get_setting(res.pool, org_id=org_id, key_id=key_id)
    return CaptureSettingOut.of(org_id, key_id, row)


# ---- stored completions ----------------------------------------------------------------------------------
async def _get(res: Resources, who: Principal, completion_id: str) -> CapturedRow:
    row = await store.get(res.pool, org_id=who.organization_id, completion_id=completion_id)
    if row is None:
        raise not_found("chat completion", completion_id, param="completion_id")
    return await _whole(res, row)


def _made_whole(row: CapturedRow, turn: Turn | None) -> CapturedRow:
    """The record with its whole prompt ids and messages (from its episode's `turn` of it)."""
    if turn is None or (row.prompt_prefix_tokens == 0 and row.messages_prefix == 0):
        return row
    return dataclasses.replace(
        row,
        prompt_token_ids=turn.prompt_ids,
        request={**row.request, "messages": turn.messages},
        prompt_prefix_tokens=0,
        messages_prefix=0,
    )


async def _whole(res: Resources, row: CapturedRow) -> CapturedRow:
    """A record stored as a delta on an earlier turn of its episode, made whole."""
    if row.episode_id is None or (row.prompt_prefix_tokens == 0 and row.messages_prefix == 0):
        return row
    records = await store.episode_records(res.pool, org_id=row.organization_id, episode_id=row.episode_id)
    return _made_whole(row, rebuild(records).get(row.id))


async def list_completions(
    res: Resources,
    who: Principal,
    *,
    model: str | None,
    metadata: dict[str, str],
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> dict[str, Any]:
    rows = await store.list_page(
        res.pool,
        org_id=who.organization_id,
        model=model,
        metadata=check_metadata(metadata) or None,
        after=after,
        limit=limit + 1,
        descending=order == "desc",
    )
    return _page([stored_completion(r, detail=False) for r in rows], limit)


def _page(items: list[dict[str, Any]], limit: int) -> dict[str, Any]:
    """A cursor page from up to `limit + 1` items (the extra one only tells that more exist)."""
    has_more = len(items) > limit
    items = items[:limit]
    return {
        "object": "list",
        "data": items,
        "has_more": has_more,
        "first_id": items[0]["id"] if items else None,
        "last_id": items[-1]["id"] if items else None,
    }


async def retrieve(res: Resources, who: Principal, completion_id: str) -> dict[str, Any]:
    return stored_completion(await _get(res, who, completion_id), detail=True)


async def update(
    res: Resources, who: Principal, completion_id: str, metadata: dict[str, Any] | None
) -> dict[str, Any]:
    checked = check_metadata(metadata)
    row = await store.update_metadata(
        res.pool, org_id=who.organization_id, completion_id=completion_id, metadata=checked
    )
    if row is None:
        raise not_found("chat completion", completion_id, param="completion_id")
    return stored_completion(await _whole(res, row), detail=True)


async def delete(res: Resources, who: Principal, completion_id: str) -> dict[str, Any]:
    """Delete one record. The later turns of its episode that were stored as deltas on it are stored whole
    first, in the same transaction: they lose nothing."""
    org_id = who.organization_id
    async with res.pool.acquire() as conn, conn.transaction():
        row = await store.get(conn, org_id=org_id, completion_id=completion_id)
        if row is not None and row.episode_id is not None:
            records = await store.episode_records(conn, org_id=org_id, episode_id=row.episode_id)
            turns = rebuild(records)
            for later in records:
                turn = turns[later.id]
                if later.previous_id == row.id and (later.prompt_prefix_tokens or later.messages_prefix):
                    request = {**later.request, "messages": turn.messages}
                    await store.store_whole(
                        conn, org_id=org_id, completion_id=later.id, prompt=turn.prompt_ids, request=request
                    )
            res.capture.writer.turns.pop((org_id, row.episode_id), None)
        if row is None or not await store.delete(conn, org_id=org_id, completion_id=completion_id):
            raise not_found("chat completion", completion_id, param="completion_id")
    return deleted(completion_id)


async def messages(
    res: Resources,
    who: Principal,
    completion_id: str,
    *,
    after: str | None,
    limit: int,
    order: Literal["asc", "desc"],
) -> dict[str, Any]:
    items = stored_messages(await _get(res, who, completion_id))
    if order == "desc":
        items.reverse()
    if after is not None:
        ids = [m["id"] for m in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return _page(items[: limit + 1], limit)

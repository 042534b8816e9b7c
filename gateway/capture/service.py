"""Capture settings (admin API) and the stored-completions API over the organisation's captured calls.
Another organisation's ids are 404, as unknown ones are."""

from __future__ import annotations

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
    return row


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
    return stored_completion(row, detail=True)


async def delete(res: Resources, who: Principal, completion_id: str) -> dict[str, Any]:
    if not await store.delete(res.pool, org_id=who.organization_id, completion_id=completion_id):
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

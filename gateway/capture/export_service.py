"""Export of an organisation's captured episodes (`gateway.capture.export` builds the samples): one
episode's, or those a filter selects, as JSONL samples, Tinker `Datum`s, or a training file of token rows.
Another organisation's episodes are 404, as unknown ones are."""

from __future__ import annotations

from typing import Any

import orjson

from gateway.capture import episodes_store, store
from gateway.capture.episodes_store import EpisodeRow
from gateway.capture.export import (
    Sample,
    datum,
    drop_stale,
    episode_samples,
    jsonl_row,
    set_advantages,
)
from gateway.capture.protocol import ExportRequest, check_metadata
from gateway.deps import Resources
from gateway.errors import InvalidRequest, not_found
from gateway.files import service as files_service
from gateway.files.protocol import FileObject
from gateway.tenancy.keys import Principal

PAGE = 100


async def _samples(res: Resources, org_id: str, episode: EpisodeRow, reward: str | None) -> list[Sample]:
    async with res.pool.acquire() as conn:
        records = await store.episode_records(conn, org_id=org_id, episode_id=episode.id)
        rewards = await episodes_store.rewards(
            conn, org_id=org_id, episode_id=episode.id, after=None, limit=None, descending=False
        )
    # The episode's metadata, over that of its first call (an episode named by a header has none of its own).
    metadata = {**(records[0].metadata if records else {}), **episode.metadata}
    samples, _ = episode_samples(records, rewards, metadata, reward_name=reward)
    return samples


async def _episode(res: Resources, org_id: str, episode_id: str) -> EpisodeRow:
    row = await episodes_store.get(res.pool, org_id=org_id, episode_id=episode_id)
    if row is None:
        raise not_found("episode", episode_id, param="episode_id")
    return row


async def one(
    res: Resources, who: Principal, episode_id: str, *, fmt: str, reward: str | None
) -> dict[str, Any]:
    """`GET /v1/episodes/{id}/export`: the episode's samples (or datums), advantages within the episode."""
    org_id = who.organization_id
    samples = await _samples(res, org_id, await _episode(res, org_id, episode_id), reward)
    set_advantages(samples, None)
    out: dict[str, Any] = {"object": "episode.export", "episode_id": episode_id}
    if fmt == "tinker":
        out["datums"] = [datum(s) for s in samples]
    else:
        out["samples"] = [jsonl_row(s) for s in samples]
    return out


async def _selected_episodes(res: Resources, org_id: str, body: ExportRequest) -> list[EpisodeRow]:
    if body.episode_ids is not None:
        return [await _episode(res, org_id, eid) for eid in dict.fromkeys(body.episode_ids)]
    found: list[EpisodeRow] = []
    after = None
    while len(found) < body.limit:
        page = await episodes_store.list_page(
            res.pool,
            org_id=org_id,
            state=body.state,
            metadata=check_metadata(body.metadata) or None,
            model=body.model,
            created_after=body.created_after,
            created_before=body.created_before,
            after=after,
            limit=min(PAGE, body.limit - len(found)),
            descending=False,
        )
        found += page
        if len(page) < PAGE:
            break
        after = page[-1].id
    return found


def _keep(sample: Sample, body: ExportRequest) -> bool:
    if body.served_version is not None and sample.served_versions != [body.served_version]:
        return False
    if body.min_reward is not None and (sample.reward is None or sample.reward < body.min_reward):
        return False
    if body.thumbs is not None:
        thumbs = {
            r["value"] > 0
            for r in sample.rewards
            if r["name"] == "thumbs" and r["target"]["type"] != "episode"
        }
        return thumbs == {body.thumbs == "up"}
    return True


def _best_of_groups(samples: list[Sample], group_by: str | None) -> list[Sample]:
    best: dict[str | None, float] = {}
    for s in samples:
        if s.reward is not None:
            key = s.metadata.get(group_by) if group_by else None
            best[key] = max(best.get(key, s.reward), s.reward)
    return [
        s
        for s in samples
        if s.reward is not None and s.reward == best[s.metadata.get(group_by) if group_by else None]
    ]


async def select(res: Resources, who: Principal, body: ExportRequest) -> tuple[list[Sample], int]:
    """The samples `body` selects, with their advantages, and how many were dropped as stale
    (`max_staleness`: stale samples are dropped before advantages are computed over the rest)."""
    org_id = who.organization_id
    samples: list[Sample] = []
    for episode in await _selected_episodes(res, org_id, body):
        samples += await _samples(res, org_id, episode, body.reward)
    samples, stale = drop_stale(samples, body.max_staleness)
    set_advantages(samples, body.group_by)
    samples = [s for s in samples if _keep(s, body)]
    if body.best_of_group:
        samples = _best_of_groups(samples, body.group_by)
    return samples, stale


async def store_rows(res: Resources, who: Principal, rows: list[dict[str, Any]]) -> FileObject:
    """JSONL rows made from captured samples, stored as a training file of the organisation."""
    return await files_service.store_made(
        res.pool,
        res.blobs,
        org_id=who.organization_id,
        filename="captured-episodes.jsonl",
        purpose="fine-tune",
        data=b"".join(orjson.dumps(row) + b"\n" for row in rows),
        lines=len(rows),
    )


async def many(res: Resources, who: Principal, body: ExportRequest) -> bytes | FileObject:
    """`POST /v1/episodes/export`: the selected episodes' samples as JSONL (one sample or datum a line), or
    stored as a training file (`purpose`)."""
    if body.purpose is not None and body.format != "jsonl":
        raise InvalidRequest("A training file holds JSONL samples: give format 'jsonl'.", param="format")
    samples, _ = await select(res, who, body)
    make = datum if body.format == "tinker" else jsonl_row
    if body.purpose is None:
        return b"".join(orjson.dumps(make(s)) + b"\n" for s in samples)
    if not samples:
        raise InvalidRequest("No captured sample matches: no training file was made.", param="purpose")
    return await store_rows(res, who, [make(s) for s in samples])

"""The worker's cron for the Tinker API: what is kept is kept only as long as it is of use.

Answered requests (futures) are kept for `tinker_request_retention_s` (their data was dropped when they
were answered); checkpoints past their expiry (the SDK's `ttl_seconds`, or `tinker_ephemeral_ttl_s` for
those saved for a sampling client at once) are deleted with their served model and their files.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from gateway.blobstore import BlobStore
from gateway.serving.engines import AdapterLoader
from gateway.settings import Settings
from gateway.tinker import store
from gateway.tinker.paths import SEGMENT, checkpoint_key


async def tinker_housekeeping(ctx: dict[str, Any]) -> dict[str, int]:
    """Delete answered Tinker requests older than `tinker_request_retention_s`, and expired checkpoints:
    their rows and served models first (so that nothing is answered from them), then their adapters on the
    engines, then their files."""
    settings: Settings = ctx["settings"]
    pool: asyncpg.Pool = ctx["pool"]
    blobs: BlobStore = ctx["blobs"]
    requests = await store.forget_finished(pool, older_than_s=settings.tinker_request_retention_s)
    checkpoints = 0
    expired = await store.expired_checkpoints(pool)
    if expired:
        async with AdapterLoader(settings) as loader:
            for row in expired:
                versions = await store.delete_expired(pool, row)
                if versions is None:
                    continue
                for version in versions:
                    await loader.unload_everywhere(version)
                blobs.delete(checkpoint_key(row.organization_id, row.model_id, SEGMENT[row.kind], row.name))
                checkpoints += 1
    return {"requests": requests, "checkpoints": checkpoints}

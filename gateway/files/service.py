"""Files: upload (streamed, checked, then committed), list, retrieve, delete, content."""

from __future__ import annotations

import hashlib
import logging
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import anyio
import asyncpg

from gateway.blobstore import BlobStore
from gateway.errors import InvalidRequest, PayloadTooLarge, not_found
from gateway.files import store
from gateway.files.protocol import PURPOSES, FileObject
from gateway.files.store import FileRow
from gateway.files.upload import receive_upload
from gateway.files.validation import check_jsonl
from gateway.ids import new_id
from gateway.offload import Offload
from gateway.protocol import CursorPage
from gateway.settings import Settings
from gateway.wire import check_text

logger = logging.getLogger(__name__)

_MULTIPART_OVERHEAD = 64 * 1024


def blob_key(org_id: str, file_id: str) -> str:
    return f"files/{org_id}/{file_id}"


def _expires_at(fields: dict[str, str]) -> datetime | None:
    anchor = fields.get("expires_after[anchor]")
    seconds = fields.get("expires_after[seconds]")
    if anchor is None and seconds is None:
        return None
    if anchor != "created_at":
        raise InvalidRequest("expires_after[anchor] must be 'created_at'.", param="expires_after.anchor")
    try:
        secs = int(seconds or "")
    except ValueError as exc:
        raise InvalidRequest(
            "expires_after[seconds] must be an integer.", param="expires_after.seconds"
        ) from exc
    if not 3600 <= secs <= 2_592_000:
        raise InvalidRequest(
            "expires_after[seconds] must be between 3600 and 2592000.", param="expires_after.seconds"
        )
    return datetime.now(UTC) + timedelta(seconds=secs)


def _check_content(path: Path, purpose: str, filename: str, settings: Settings) -> int | None:
    """Purpose-specific checks, run in a thread. Returns the row count of JSONL files."""
    if purpose == "fine-tune":
        return check_jsonl(
            path, max_line_bytes=settings.max_jsonl_line_bytes, max_depth=settings.max_json_depth
        )
    if purpose == "environment":
        if path.stat().st_size > settings.max_environment_bytes:
            raise PayloadTooLarge(
                f"Environment packages are limited to {settings.max_environment_bytes} bytes.", param="file"
            )
        if not filename.endswith((".tar.gz", ".tgz")):
            raise InvalidRequest("An environment package must be a .tar.gz archive.", param="file")
        check_environment(path, settings)
    return None


def check_environment(path: Path, settings: Settings) -> None:
    """Inspect an uploaded environment package (blocking: run in a thread).

    ``envsdk.archive.inspect_package`` extracts it under the settings' caps (entries, unpacked bytes,
    compression ratio; no ``..``, absolute paths, links out or devices), validates ``environment.toml`` and
    starts the package in the sandbox to check that its entrypoint is an environment class. A package with
    ``requirements`` has their venv built first (``settings.venv_builder()``: cached once per set, shared
    with every package and organisation that declares the same). A refusal is a 400
    ``invalid_environment`` naming the problem (for requirements, pip's reason in one line).
    """
    from envsdk.archive import inspect_package
    from envsdk.errors import EnvSDKError
    from envsdk.sandbox import owned_workdir

    with owned_workdir("check") as workdir:  # removed at the next start if this process dies first
        workdir.chmod(0o755)  # the sandbox's own uid reads the extracted package
        try:
            manifest = inspect_package(
                path,
                workdir,
                max_entries=settings.environment_max_entries,
                max_total_bytes=settings.environment_max_unpacked_bytes,
                max_ratio=settings.environment_max_ratio,
                limits=settings.sandbox_maxima().as_limits(),  # the operator's caps, start-up included
                allow_unsandboxed=settings.allow_unsandboxed_environments,
                venvs=settings.venv_builder(),  # requirements: built here, once per set (cached)
            )
        except EnvSDKError as exc:
            raise InvalidRequest(
                f"The environment package was refused ({exc.code}): {exc.message}",
                param="file",
                code="invalid_environment",
            ) from None
    logger.info("environment package %s %s accepted", manifest.name, manifest.version)


async def upload(
    pool: asyncpg.Pool,
    blobs: BlobStore,
    settings: Settings,
    *,
    offload: Offload,
    org_id: str,
    content_type: str | None,
    content_length: int | None,
    body: AsyncIterator[bytes],
) -> FileObject:
    """Receive, check and store an upload. A refused upload leaves no row and no blob behind.

    An environment package's check starts it in the sandbox: one of the organisation's sandboxed calls,
    on the offload's threads (`gateway.offload`), never the thread pool that other uploads write with."""
    limit = settings.max_upload_bytes
    if content_length is not None and content_length > limit + _MULTIPART_OVERHEAD:
        # Refused before a byte of the body is read: the declared length alone is over the cap.
        raise PayloadTooLarge(
            f"The upload is {content_length} bytes; files are limited to {limit} bytes.",
            param="file",
            code="file_too_large",
        )
    temp = blobs.new_temp()
    received = await receive_upload(content_type, body, temp_path=temp, max_bytes=limit)
    try:
        purpose = received.fields.get("purpose")
        if not purpose:
            raise InvalidRequest("Missing required parameter: 'purpose'.", param="purpose")
        if purpose not in PURPOSES:
            raise InvalidRequest(
                f"Invalid purpose '{purpose}'; expected one of {', '.join(PURPOSES)}.", param="purpose"
            )
        filename = Path(received.filename or "upload").name or "upload"
        check_text(filename, "file")
        expires_at = _expires_at(received.fields)
        if purpose == "fine-tune" and not filename.endswith(".jsonl"):
            raise InvalidRequest(
                "Fine-tuning files must be .jsonl.", param="file", code="invalid_file_format"
            )
        if purpose == "environment":
            line_count = await offload.thread(org_id, _check_content, temp, purpose, filename, settings)
        else:
            line_count = await anyio.to_thread.run_sync(_check_content, temp, purpose, filename, settings)
        return await _keep(
            pool,
            blobs,
            temp,
            org_id=org_id,
            filename=filename,
            purpose=purpose,
            size=received.size,
            sha256=received.sha256,
            line_count=line_count,
            expires_at=expires_at,
        )
    finally:
        temp.unlink(missing_ok=True)


async def _keep(
    pool: asyncpg.Pool,
    blobs: BlobStore,
    temp: Path,
    *,
    org_id: str,
    filename: str,
    purpose: str,
    size: int,
    sha256: str,
    line_count: int | None,
    expires_at: datetime | None,
) -> FileObject:
    """The file's row, and its content (`temp`) committed to the blob store."""
    file_id = new_id("file-")
    key = blob_key(org_id, file_id)
    async with pool.acquire() as conn, conn.transaction():
        row = await store.insert(
            conn,
            file_id=file_id,
            org_id=org_id,
            filename=filename,
            purpose=purpose,
            size=size,
            sha256=sha256,
            blob_key=key,
            line_count=line_count,
            expires_at=expires_at,
        )
        blobs.commit(temp, key)  # inside the transaction: a failed commit rolls the row back
    return FileObject.from_row(row)


async def store_made(
    pool: asyncpg.Pool, blobs: BlobStore, *, org_id: str, filename: str, purpose: str, data: bytes, lines: int
) -> FileObject:
    """Store a file the gateway made for the organisation (such as captured episodes exported as training
    rows), as an upload is stored."""
    temp = blobs.new_temp()
    try:
        await anyio.to_thread.run_sync(temp.write_bytes, data)
        return await _keep(
            pool,
            blobs,
            temp,
            org_id=org_id,
            filename=filename,
            purpose=purpose,
            size=len(data),
            sha256=hashlib.sha256(data).hexdigest(),
            line_count=lines,
            expires_at=None,
        )
    finally:
        temp.unlink(missing_ok=True)


async def get(pool: asyncpg.Pool, *, org_id: str, file_id: str) -> FileRow:
    row = await store.get(pool, org_id=org_id, file_id=file_id)
    if row is None:
        raise not_found("file", file_id, param="file_id")
    return row


async def list_files(
    pool: asyncpg.Pool, *, org_id: str, purpose: str | None, after: str | None, limit: int, order: str
) -> CursorPage[FileObject]:
    rows = await store.list_page(
        pool, org_id=org_id, purpose=purpose, after=after, limit=limit + 1, order=order
    )
    return CursorPage[FileObject].of([FileObject.from_row(r) for r in rows], limit)


async def delete(pool: asyncpg.Pool, blobs: BlobStore, *, org_id: str, file_id: str) -> None:
    row = await store.delete(pool, org_id=org_id, file_id=file_id)
    if row is None:
        raise not_found("file", file_id, param="file_id")
    blobs.delete(row.blob_key)

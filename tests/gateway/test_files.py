"""Files API through the openai SDK: shapes, paging, tenancy, hostile uploads that leave nothing behind."""

from __future__ import annotations

import io
import json

import asyncpg
import openai
import pytest

from tests.support.stack import GatewayServer, Tenant

SFT_ROW = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


def jsonl(rows: list[dict], name: str = "train.jsonl") -> tuple[str, bytes]:
    return name, "\n".join(json.dumps(r) for r in rows).encode() + b"\n"


async def _count_rows(stack: GatewayServer, org_id: str) -> int:
    conn = await asyncpg.connect(stack.settings.database_url)
    try:
        return await conn.fetchval("SELECT count(*) FROM files WHERE organization_id = $1", org_id)
    finally:
        await conn.close()


def _blobs(stack: GatewayServer, org_id: str) -> list[str]:
    """This organisation's stored blobs, plus any temporary upload left in the store."""
    folder = stack.settings.blob_dir / "files" / org_id
    stored = [p.name for p in folder.iterdir()] if folder.exists() else []
    return stored + [str(t) for t in (stack.settings.blob_dir / "tmp").iterdir()]


def test_upload_retrieve_content_delete(tenant: Tenant) -> None:
    name, data = jsonl([SFT_ROW] * 3)
    f = tenant.client.files.create(file=(name, data), purpose="fine-tune")
    assert f.id.startswith("file-") and f.object == "file" and f.bytes == len(data)
    assert f.filename == "train.jsonl" and f.purpose == "fine-tune" and f.status == "processed"
    assert tenant.client.files.retrieve(f.id) == f
    assert tenant.client.files.content(f.id).read() == data
    done = tenant.client.files.wait_for_processing(f.id)
    assert done.status == "processed"
    deleted = tenant.client.files.delete(f.id)
    assert deleted.id == f.id and deleted.deleted is True and deleted.object == "file"
    with pytest.raises(openai.NotFoundError):
        tenant.client.files.retrieve(f.id)


def test_expiry_and_other_purposes(tenant: Tenant) -> None:
    f = tenant.client.files.create(
        file=("notes.txt", b"anything"),
        purpose="user_data",
        expires_after={"anchor": "created_at", "seconds": 3600},
    )
    assert f.expires_at is not None and f.expires_at - f.created_at in (3599, 3600, 3601)
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.files.create(file=("x.txt", b"x"), purpose="nonsense")  # type: ignore[arg-type]
    assert err.value.param == "purpose"


def test_pagination_over_pages(tenant: Tenant) -> None:
    ids = [tenant.client.files.create(file=(f"f{i}.txt", b"x"), purpose="user_data").id for i in range(7)]
    page = tenant.client.files.list(limit=3)
    assert [f.id for f in page.data] == ids[::-1][:3] and page.has_more is True
    seen = [f.id for f in tenant.client.files.list(limit=3)]  # the SDK follows `after` across pages
    assert seen == ids[::-1]
    asc = tenant.client.files.list(limit=100, order="asc")
    assert [f.id for f in asc.data] == ids and asc.has_more is False
    empty = tenant.client.files.list(after=ids[0], limit=3)
    assert empty.data == [] and empty.has_more is False
    assert [f.id for f in tenant.client.files.list(purpose="fine-tune").data] == []


def test_other_tenants_files_are_invisible(tenant: Tenant, other_tenant: Tenant) -> None:
    f = tenant.client.files.create(file=jsonl([SFT_ROW]), purpose="fine-tune")
    for call in (
        other_tenant.client.files.retrieve,
        other_tenant.client.files.delete,
        other_tenant.client.files.content,
    ):
        with pytest.raises(openai.NotFoundError):
            call(f.id)
    assert f.id not in [x.id for x in other_tenant.client.files.list().data]
    assert tenant.client.files.retrieve(f.id).id == f.id


@pytest.mark.parametrize(
    ("content", "needle"),
    [
        (b'{"a": 1}\n\xff\xfe\n', "Line 2 is not valid UTF-8"),
        (b"", "empty"),
        (b"\n\n  \n", "empty"),
        (b'{"a": 1}\n{"b": 2}\n{"c": \n', "Line 3 is not valid JSON"),
        (b'{"a": 1}\n[1, 2]\n', "Line 2 must be a JSON object"),
    ],
    ids=["non-utf8", "empty", "blank-lines", "bad-json-line-3", "not-an-object"],
)
async def test_bad_jsonl_is_refused_and_leaves_nothing(
    stack: GatewayServer, tenant: Tenant, content: bytes, needle: str
) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.files.create(file=("train.jsonl", content), purpose="fine-tune")
    assert needle in err.value.message and err.value.param == "file"
    assert await _count_rows(stack, tenant.org_id) == 0
    assert _blobs(stack, tenant.org_id) == []


async def test_huge_single_line_is_refused(stack: GatewayServer, tenant: Tenant) -> None:
    line = b'{"messages": "' + b"a" * (200 * 1024 * 1024) + b'"}\n'
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.files.create(file=("big.jsonl", io.BytesIO(line)), purpose="fine-tune")
    assert "Line 1 is longer than" in err.value.message
    assert await _count_rows(stack, tenant.org_id) == 0
    assert _blobs(stack, tenant.org_id) == []


async def test_file_over_the_cap_is_413(stack: GatewayServer, tenant: Tenant) -> None:
    cap = stack.settings.max_upload_bytes
    with pytest.raises(openai.APIStatusError) as err:
        tenant.client.files.create(file=("big.txt", io.BytesIO(b"x" * (cap + 1))), purpose="user_data")
    assert err.value.status_code == 413 and err.value.code == "file_too_large"
    assert await _count_rows(stack, tenant.org_id) == 0
    assert _blobs(stack, tenant.org_id) == []


def test_fine_tune_files_must_be_jsonl(tenant: Tenant) -> None:
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.files.create(file=("train.csv", b'{"a":1}\n'), purpose="fine-tune")
    assert err.value.param == "file"

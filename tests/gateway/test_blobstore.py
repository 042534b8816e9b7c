"""The blob store refuses every key that does not name a place inside it, whoever built the key: the last
line of defence behind the ids the gateway mints (`gateway.blobstore`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from gateway.blobstore import BlobKeyError, BlobStore

ESCAPING = [
    "",
    "/etc/passwd",
    "//etc/passwd",
    "..",
    "../outside",
    "tinker/../../outside",
    "tinker/org-a/../org-b/ts-x_train_0",  # inside the store once resolved, refused all the same
    "tinker/./..",
    "tinker/org-a/\x00",
    ".",
]


@pytest.mark.parametrize("key", ESCAPING)
def test_a_key_that_leaves_its_place_is_refused(tmp_path: Path, key: str) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    (tmp_path / "blobs" / "tinker" / "org-a").mkdir(parents=True)
    source = tmp_path / "adapter"
    source.mkdir()
    (source / "weights").write_bytes(b"b's weights")
    for use in (blobs.path, blobs.exists, blobs.delete):
        with pytest.raises(BlobKeyError):
            use(key)
    with pytest.raises(BlobKeyError):
        blobs.put_tree(source, key)
    temp = blobs.new_temp()
    temp.write_bytes(b"x")
    with pytest.raises(BlobKeyError):
        blobs.commit(temp, key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "blobs"]


def test_a_symlink_out_of_the_store_is_not_followed(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    outside = tmp_path / "outside"
    outside.mkdir()
    (tmp_path / "blobs" / "tinker").mkdir()
    (tmp_path / "blobs" / "tinker" / "org-b").symlink_to(outside)
    with pytest.raises(BlobKeyError, match="escapes the store"):
        blobs.path("tinker/org-b/ts-x_train_0/weights/a")
    source = tmp_path / "adapter"
    source.mkdir()
    (source / "weights").write_bytes(b"b's weights")
    with pytest.raises(BlobKeyError):
        blobs.put_tree(source, "tinker/org-b/ts-x_train_0/weights/a")
    assert list(outside.iterdir()) == []


def test_plain_keys_still_work(tmp_path: Path) -> None:
    blobs = BlobStore(tmp_path / "blobs")
    source = tmp_path / "adapter"
    source.mkdir()
    (source / "weights").write_bytes(b"a's weights")
    key = "tinker/org-a/ts-x_train_0/weights/v1..2"  # dots inside a name are no parent reference
    stored = blobs.put_tree(source, key)
    assert stored == (tmp_path / "blobs" / key).resolve() and blobs.exists(key)
    assert (stored / "weights").read_bytes() == b"a's weights"
    blobs.delete(key)
    assert not blobs.exists(key)

"""The blob store: uploaded files, environment packages, checkpoints and adapters.

One interface; a local directory by default. Writes land in `tmp/` first and become visible only when
committed (an atomic rename), so a refused or broken upload leaves nothing behind.

The store is private to the service's uid: directories 0700, files 0600 (the root is made so at start,
also when an older version left it open), so no other uid on the host -- a sandboxed environment's
included -- can read another tenant's uploads, checkpoints or adapters.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path, PurePosixPath

DIR_MODE = 0o700
FILE_MODE = 0o600


def _make_private(tree: Path) -> None:
    """Directories 0700 and files 0600 under (and including) `tree`."""
    if tree.is_dir():
        tree.chmod(DIR_MODE)
        for folder, dirs, files in os.walk(tree):
            for name in dirs:
                os.chmod(os.path.join(folder, name), DIR_MODE)
            for name in files:
                os.chmod(os.path.join(folder, name), FILE_MODE, follow_symlinks=False)
    else:
        tree.chmod(FILE_MODE)


def _make_dirs(path: Path) -> None:
    """`path` and every missing folder above it, each 0700 (`mkdir(parents=True)` makes parents 0755)."""
    missing = []
    while not path.exists():
        missing.append(path)
        path = path.parent
    for folder in reversed(missing):
        folder.mkdir(mode=DIR_MODE, exist_ok=True)


class BlobKeyError(ValueError):
    """A key that does not name a place inside the store."""


class BlobStore:
    """Blobs addressed by relative keys like `files/<org>/<file_id>`.

    Keys are made by the gateway from ids it minted, never from a client's string; the store still refuses
    any key that is empty, absolute, holds a `..` segment or a NUL, or resolves (through a symlink, say) to
    the root itself or outside it, so a key built wrongly fails instead of touching another tenant's files
    or the host's."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tmp = root / "tmp"
        _make_dirs(self._tmp)
        root.chmod(DIR_MODE)
        self._tmp.chmod(DIR_MODE)

    def path(self, key: str) -> Path:
        """Local path of a committed blob (the worker and engines read from it directly); `BlobKeyError`
        for a key that does not name a place inside the store."""
        relative = PurePosixPath(key)
        if not key or "\x00" in key or relative.is_absolute() or ".." in relative.parts:
            raise BlobKeyError(f"not a blob key: {key!r}")
        p = (self.root / relative).resolve()
        if self.root.resolve() not in p.parents:
            raise BlobKeyError(f"blob key escapes the store: {key!r}")
        return p

    def new_temp(self) -> Path:
        """A fresh temporary path inside the store (same filesystem, so commit is a rename)."""
        return self._tmp / uuid.uuid4().hex

    def commit(self, temp: Path, key: str) -> Path:
        """Make a temporary file visible under `key`."""
        dest = self.path(key)
        _make_dirs(dest.parent)
        temp.chmod(FILE_MODE)
        os.replace(temp, dest)
        return dest

    def exists(self, key: str) -> bool:
        return self.path(key).exists()

    def delete(self, key: str) -> None:
        """Remove a blob (file or directory); a missing blob is not an error."""
        p = self.path(key)
        if p.is_dir():
            shutil.rmtree(p, ignore_errors=True)
        else:
            p.unlink(missing_ok=True)

    def put_tree(self, source: Path, key: str) -> Path:
        """Copy a directory (an adapter, a checkpoint) into the store under `key`."""
        dest = self.path(key)
        staging = self.new_temp()
        shutil.copytree(source, staging)
        _make_private(staging)
        if dest.exists():
            shutil.rmtree(dest)
        _make_dirs(dest.parent)
        os.replace(staging, dest)
        return dest

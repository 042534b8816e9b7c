"""The blob store: uploaded files, environment packages, checkpoints and adapters.

One interface; a local directory by default. Writes land in `tmp/` first and become visible only when
committed (an atomic rename), so a refused or broken upload leaves nothing behind.
"""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


class BlobStore:
    """Blobs addressed by relative keys like `files/<org>/<file_id>`."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self._tmp = root / "tmp"
        self._tmp.mkdir(parents=True, exist_ok=True)

    def path(self, key: str) -> Path:
        """Local path of a committed blob (the worker and engines read from it directly)."""
        p = (self.root / key).resolve()
        if self.root.resolve() not in p.parents:
            raise ValueError(f"blob key escapes the store: {key!r}")
        return p

    def new_temp(self) -> Path:
        """A fresh temporary path inside the store (same filesystem, so commit is a rename)."""
        return self._tmp / uuid.uuid4().hex

    def commit(self, temp: Path, key: str) -> Path:
        """Make a temporary file visible under `key`."""
        dest = self.path(key)
        dest.parent.mkdir(parents=True, exist_ok=True)
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
        if dest.exists():
            shutil.rmtree(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        os.replace(staging, dest)
        return dest

"""What every stage of one claimed job shares: its row, the worker holding it, and the worker's resources.

A fine-tuning job run (`gateway.worker.runner` and its stages in `gateway.worker.job`) holds a
`JobContext[JobRow]`; an eval run (`gateway.worker.evals`) a `JobContext[RunRow]`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Generic, TypeVar

import asyncpg

from gateway.blobstore import BlobStore
from gateway.evals.rows import RunRow
from gateway.jobs.store import JobRow
from gateway.settings import Settings

RowT = TypeVar("RowT", JobRow, RunRow)


@dataclass(frozen=True, slots=True)
class JobContext(Generic[RowT]):
    """One claimed job or eval run, as its worker claimed it."""

    row: RowT
    """The row the claim returned."""
    worker_id: str
    """The worker holding it: every state change is guarded by it."""
    pool: asyncpg.Pool
    blobs: BlobStore
    settings: Settings

    @property
    def id(self) -> str:
        return self.row.id

    @property
    def org_id(self) -> str:
        """The organisation every row written for it carries."""
        return self.row.organization_id

    @property
    def workdir(self) -> Path:
        """The directory its trainer works in (and writes its checkpoints and adapter under)."""
        return self.settings.data_dir / "work" / self.id

    def trainer_path(self, reported: str) -> Path:
        """A directory the trainer reported (a checkpoint, the adapter), resolved, once it is inside the
        job's working directory: the worker copies it into the organisation's blobs, so a path elsewhere
        (another job's adapter, a host directory) is refused with `OutsideWorkdir`."""
        root = self.workdir.resolve()
        path = Path(reported).resolve()
        if not path.is_relative_to(root):
            raise OutsideWorkdir(f"the trainer reported {reported!r}, outside the job's working directory")
        return path


class OutsideWorkdir(ValueError):
    """A trainer reported a path outside its job's working directory."""

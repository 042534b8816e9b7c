"""Settings of where tunegate keeps its state: the data dir, PostgreSQL, Redis and the job queue."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path

from pydantic import BaseModel, Field


class StorageSettings(BaseModel):
    """Where state lives and how every process reaches it: the data dir, PostgreSQL, Redis, the arq queue and
    the log level every process logs at."""

    data_dir: Path = Field(default_factory=lambda: Path.home() / ".tunegate")
    """Where blobs, job work dirs, the tiny model and the embedded databases live."""
    database_url: str | None = None
    """PostgreSQL DSN. Unset: `tunegate up` starts an embedded PostgreSQL under the data dir."""
    redis_url: str | None = None
    """Redis URL. Unset: `tunegate up` starts an embedded Redis under the data dir."""
    db_pool_min: int = 1
    """Smallest size of the PostgreSQL connection pool."""
    db_pool_max: int = 10
    """Largest size of the PostgreSQL connection pool."""
    queue_name: str = "tunegate:jobs"
    """Name of the arq queue that carries fine-tuning jobs."""
    log_level: str = "info"
    """Log level of every process."""

    @cached_property
    def blob_dir(self) -> Path:
        """Root of the local blob store."""
        return self.data_dir / "blobs"

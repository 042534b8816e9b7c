"""The worker copies only directories inside a job's working directory into the organisation's blobs: a
trainer that reports a checkpoint or adapter elsewhere (another job's adapter, a host directory, a symlink
out) is refused, whatever it names."""

from __future__ import annotations

from datetime import UTC, datetime
from pathlib import Path

import pytest

from gateway.blobstore import BlobStore
from gateway.jobs.store import JobRow
from gateway.settings import BaseModelConfig
from gateway.worker.context import JobContext, OutsideWorkdir
from tunegate.stack import private_settings


def _context(data_dir: Path, job_id: str) -> JobContext[JobRow]:
    settings = private_settings(
        data_dir=data_dir,
        database_url="postgresql://127.0.0.1/unused",
        redis_url="redis://127.0.0.1:6379/0",
        base_models={"tiny-chat": BaseModelConfig(path=data_dir / "tiny-chat")},
    )
    now = datetime.now(UTC)
    row = JobRow(
        id=job_id, organization_id="org-a", api_key_id=None, model="tiny-chat", training_file="file-1",
        validation_file=None, status="running", method={"type": "supervised"}, seed=0, suffix=None,
        metadata=None, integrations=None, error=None, fine_tuned_model=None, trained_tokens=None,
        result_files=None, estimated_finish=None, created_at=now, queued_at=now, started_at=now,
        finished_at=None, queue_generation=1, attempts=1, worker_id="w", current_step=None,
        total_steps=None, last_checkpoint=None, request_hash=None,
    )  # fmt: skip
    return JobContext(row, "w", None, BlobStore(settings.blob_dir), settings)  # type: ignore[arg-type]


def test_a_trainer_path_inside_the_jobs_workdir_is_taken(tmp_path: Path) -> None:
    ctx = _context(tmp_path, "ftjob-a")
    adapter = ctx.workdir / "out" / "adapter"
    adapter.mkdir(parents=True)
    assert ctx.trainer_path(str(adapter)) == adapter.resolve()
    assert ctx.trainer_path(str(ctx.workdir / "out" / ".." / "out" / "adapter")) == adapter.resolve()


@pytest.mark.parametrize(
    "reported",
    [
        "{data}/work/ftjob-b/out/adapter",  # another job's adapter
        "{data}/work/ftjob-a/../ftjob-b/out",  # out through '..'
        "{data}/work/ftjob-ab/out",  # a sibling whose name starts with this job's
        "/etc",
        "{data}/blobs",
        "{data}/work/ftjob-a/out/link",  # a symlink inside that points out
    ],
)
def test_a_trainer_path_outside_the_jobs_workdir_is_refused(tmp_path: Path, reported: str) -> None:
    ctx = _context(tmp_path, "ftjob-a")
    (ctx.workdir / "out").mkdir(parents=True)
    (tmp_path / "work" / "ftjob-b" / "out").mkdir(parents=True)
    (ctx.workdir / "out" / "link").symlink_to(tmp_path / "work" / "ftjob-b" / "out")
    with pytest.raises(OutsideWorkdir, match="outside the job's working directory"):
        ctx.trainer_path(reported.format(data=tmp_path))

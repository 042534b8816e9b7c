"""Writing the spec: a claimed job's work dir and its `spec.json`, the `TrainerSpec` the trainer reads.

The training, validation and environment files are looked up by id when the attempt starts (a file deleted
since the job was created fails the attempt), and an environment package is unpacked again under the same
caps as its upload check. A job whose grader calls a model is pointed at the gateway's own `/v1`
(`inference_base_url`); the key for it travels in the trainer's environment, never in this file. The
names the job's models are registered under start from `fine_tuned_model_name`.
"""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from envsdk.graders import model_fields
from gateway.graders import packages
from gateway.jobs import running
from gateway.jobs.store import JobRow
from gateway.settings import Settings
from gateway.worker.context import JobContext
from trainer.contract import TrainerSpec


def calls_models(job: JobRow) -> bool:
    """Whether the job's grader calls a model (and so its trainer needs the gateway and a key)."""
    grader = job.method.grader
    return grader is not None and bool(model_fields(grader))


def fine_tuned_model_name(job: JobRow) -> str:
    """`ft:<base>:<org>:<suffix>:<job>` (an empty suffix leaves an empty field, as OpenAI does)."""
    return f"ft:{job.model}:{job.organization_id}:{job.suffix or ''}:{job.id}"


async def write_spec(ctx: JobContext[JobRow], *, workdir: Path, vllm_server: str | None = None) -> Path:
    """Make `workdir` (unpacking the environment package there) and write the job's `spec.json` in it;
    `vllm_server`: the `host:port` of the job's generation server (vLLM server mode)."""
    job, settings = ctx.row, ctx.settings

    async def file_path(file_id: str) -> Path:
        key = await running.file_blob_key(ctx.pool, file_id=file_id, org_id=ctx.org_id)
        if key is None:
            raise FileNotFoundError(f"file {file_id} was deleted before training started")
        return ctx.blobs.path(key)

    method = job.method
    archive, environment = None, None
    if method.environment is not None:
        archive = await file_path(method.environment.file_id)
        environment = {"package_dir": str(workdir / "environment"), "config": method.environment.config}
    validation = job.validation_file
    spec = TrainerSpec.model_validate(
        {
            "job_id": job.id,
            "method": method.type,
            "base_model": str(settings.base_model_path(job.model)),
            "training_file": str(await file_path(job.training_file)),
            "validation_file": str(await file_path(validation)) if validation else None,
            "output_dir": str(workdir / "out"),
            "resume_from_checkpoint": job.last_checkpoint,
            "seed": job.seed,
            "hyperparameters": method.hyperparameters.model_dump(exclude_none=True, exclude_unset=True),
            "grader": method.grader,
            "environment": environment,
            "inference_base_url": f"{settings.internal_gateway_url()}/v1" if calls_models(job) else None,
            "inference_api_key": None,  # in the trainer's environment, not in this file
            "allow_unsandboxed": settings.allow_unsandboxed_environments,
            "sandbox_maxima": settings.sandbox_maxima().as_dict(),
            "use_vllm": settings.use_vllm,
            "vllm_server": vllm_server,
            "collective_timeout_s": settings.collective_timeout_s,
        }
    )
    return await asyncio.to_thread(_write, settings, workdir, spec, archive)


def _write(settings: Settings, workdir: Path, spec: TrainerSpec, archive: Path | None) -> Path:
    """Make the work dir, unpack the environment package (again under the same caps as its upload check)
    and write `spec.json` (blocking; run in a thread)."""
    workdir.mkdir(parents=True, exist_ok=True)
    if archive is not None:
        package_dir = workdir / "environment"
        shutil.rmtree(package_dir, ignore_errors=True)
        workdir.chmod(0o755)  # the sandbox's own uid reads the package
        packages.unpack(settings, archive, package_dir)
    path = workdir / "spec.json"
    path.write_text(spec.model_dump_json(indent=2))
    return path

"""Fine-tuning jobs: create (validated, idempotent, enqueued), estimate, list, retrieve, cancel, pause,
resume, events and checkpoints."""

from __future__ import annotations

import hashlib
import logging
import secrets
from pathlib import Path

import anyio
import asyncpg
import orjson

from envsdk.graders import model_fields
from gateway.deps import Resources
from gateway.errors import Conflict, InvalidRequest, not_found
from gateway.files import store as files_store
from gateway.files.store import FileRow
from gateway.graders.checks import check_grader
from gateway.jobs import cost, guards, projection, sources, store
from gateway.jobs.method import JobMethod
from gateway.jobs.protocol import FineTuningJob, JobCheckpoint, JobCreate, JobEvent
from gateway.jobs.store import JobRow
from gateway.jobs.validation import (
    DatasetSummary,
    RowError,
    check_metadata,
    check_servable_rank,
    check_suffix,
    check_training_file,
    resolve_hyperparameters,
)
from gateway.protocol import CursorPage
from gateway.queue import enqueue
from gateway.serving.calls import check_models
from gateway.tenancy.keys import Principal
from gateway.usage import service as usage_service
from gateway.work import store as work_store
from gateway.work.devices import generation_devices
from trainer.contract import AnyHyperparameters, devices_for, model_defaults, total_steps

logger = logging.getLogger(__name__)


def _request_hash(body: JobCreate) -> str:
    return hashlib.sha256(
        orjson.dumps(body.model_dump(exclude_none=True), option=orjson.OPT_SORT_KEYS)
    ).hexdigest()


async def _owned_file(res: Resources, org_id: str, file_id: str, purpose: str, param: str) -> FileRow:
    row = await files_store.get(res.pool, org_id=org_id, file_id=file_id)
    if row is None:
        raise InvalidRequest(f"File '{file_id}' does not exist.", param=param, code="invalid_file")
    if row.purpose != purpose:
        raise InvalidRequest(
            f"File '{file_id}' has purpose '{row.purpose}'; expected '{purpose}'.",
            param=param,
            code="invalid_file_purpose",
        )
    return row


async def create(
    res: Resources, who: Principal, body: JobCreate, idempotency_key: str | None
) -> FineTuningJob:
    """Validate the request, insert the job, check its files row by row, and queue it (its `"auto"`
    hyperparameters resolved from the files). A file that does not fit the method fails the job (it stays
    listed with its error). With an `Idempotency-Key`, the same body answers the same job; an empty one is
    no key (it names nothing to replay, and stored it would collide with the organisation's next)."""
    idempotency_key = idempotency_key or None
    request_hash = _request_hash(body)
    replayed = await _replayed(res, who, idempotency_key, request_hash)
    if replayed is not None:
        return replayed
    body = await sources.with_training_file(res, who, body)
    method, files, training = await validate(res, who, body)
    await cost.check_budget(
        res, who.organization_id, who.api_key_id, body.model, training.bytes, cost.given_epochs(method)
    )
    row = await _insert(res, who, body, method, idempotency_key, request_hash)
    if row is None:  # a concurrent create with the same key was first
        replayed = await _replayed(res, who, idempotency_key, request_hash)
        if replayed is None:  # and its job is gone already: nothing to replay, nothing made
            raise Conflict(
                "Another request with this Idempotency-Key was being processed; retry the request.",
                param="Idempotency-Key",
                code="idempotency_conflict",
            )
        return replayed
    events = JobEvents(res.pool, row.id, who.organization_id)
    await events.add(f"Created fine-tuning job: {row.id}", "created")
    try:
        summaries = await _check_files(res, events, body, method.type, files)
        method = method.with_hyperparameters(resolve_for_files(res, body, method, summaries))
    except FileRejected as exc:
        return await _fail_validation(res, events, row, body, exc)
    return await _queue(res, events, row, method, summaries)


async def _replayed(
    res: Resources, who: Principal, idempotency_key: str | None, request_hash: str
) -> FineTuningJob | None:
    """The job an earlier create with this `Idempotency-Key` made (409 for another body); None if none."""
    if not idempotency_key:
        return None
    existing = await store.by_idempotency_key(res.pool, org_id=who.organization_id, key=idempotency_key)
    return None if existing is None else _replay(existing, request_hash)


async def _insert(
    res: Resources,
    who: Principal,
    body: JobCreate,
    method: JobMethod,
    idempotency_key: str | None,
    request_hash: str,
) -> JobRow | None:
    """The new job's row, `validating_files`; None when another create took its `Idempotency-Key` first."""
    try:
        return await store.insert(
            res.pool,
            org_id=who.organization_id,
            api_key_id=who.api_key_id,
            model=body.model,
            training_file=body.training_file,
            validation_file=body.validation_file,
            method=method,
            seed=body.seed if body.seed is not None else secrets.randbelow(2**31),
            suffix=body.suffix,
            metadata=body.metadata,
            integrations=body.integrations,
            idempotency_key=idempotency_key,
            request_hash=request_hash,
            max_cost=body.max_cost,
            guards=guards.resolve(body.guards, method=method.type),
        )
    except asyncpg.UniqueViolationError:
        if idempotency_key is None:  # no key to collide on: not a concurrent create
            raise
        return None


async def _check_files(
    res: Resources, events: JobEvents, body: JobCreate, kind: str, files: list[Path]
) -> list[DatasetSummary]:
    """The training (and validation) file checked row by row against the method; raises `FileRejected`."""
    await events.add(f"Validating training file: {body.training_file}", "validating")
    return [
        await check_rows(res, path, kind, which)
        for path, which in zip(files, ("training_file", "validation_file"), strict=False)
    ]


def resolve_for_files(
    res: Resources, body: JobCreate, method: JobMethod, summaries: list[DatasetSummary]
) -> AnyHyperparameters:
    """The hyperparameters resolved from the files' sizes. What only the files' sizes make impossible (a
    reinforcement batch larger than the training file) rejects the training file: the job fails with the
    reason, as for a row that does not fit, and is not left validating."""
    try:
        return resolve_hyperparameters(
            method,
            body.hyperparameters_param,
            summaries[0],
            summaries[1] if len(summaries) > 1 else None,
            res.settings.base_model_path(body.model),
        )
    except InvalidRequest as exc:
        raise FileRejected("training_file", exc.message) from None


async def _queue(
    res: Resources,
    events: JobEvents,
    row: JobRow,
    method: JobMethod,
    summaries: list[DatasetSummary],
) -> FineTuningJob:
    """Store the resolved hyperparameters with the job's steps, and queue the job."""
    hp = method.hyperparameters
    assert isinstance(hp, AnyHyperparameters)
    steps = total_steps(method.type, summaries[0].rows, hp.batch_size, hp.n_epochs, hp.max_steps)
    valid = projection.approximate(summaries[1].rows, summaries[1].chars) if len(summaries) > 1 else None
    expected = projection.estimate(
        res.settings,
        base_model=row.model,
        kind=method.type,
        hp=hp,
        train=projection.approximate(summaries[0].rows, summaries[0].chars),
        valid=valid,
        grader=method.grader,
        throughput=default_throughput(method),
    ).cost.expected
    queued = await store.to_queued(
        res.pool, job_id=row.id, method=method, total_steps=steps, estimated_cost=expected
    )
    if queued is None:  # cancelled while validating
        current = await store.get(res.pool, org_id=row.organization_id, job_id=row.id)
        assert current is not None
        return FineTuningJob.from_row(current)
    await events.add("Files validated, moving job to queued state", "queued:1")
    await enqueue(res.queue, res.settings.queue_name, row.id, queued.queue_generation)
    return FineTuningJob.from_row(queued)


class JobEvents:
    """Adds one job's events (each at most once per dedup key)."""

    def __init__(self, pool: asyncpg.Pool, job_id: str, org_id: str) -> None:
        self.pool, self.job_id, self.org_id = pool, job_id, org_id

    async def add(self, message: str, dedup_key: str | None = None, *, level: str = "info") -> None:
        await store.add_event(
            self.pool,
            job_id=self.job_id,
            org_id=self.org_id,
            message=message,
            dedup_key=dedup_key,
            level=level,
        )


async def _check_devices(res: Resources, body: JobCreate) -> None:
    """A job that needs more devices than any live worker owns is refused now, not left queued for ever.
    With no worker seen lately nothing is known, and the job waits for one."""
    method = body.job_method
    given = getattr(method.hyperparameters, "gpus", "auto")
    gpus = (
        given
        if isinstance(given, int)
        else devices_for(model_defaults(res.settings.base_model_path(body.model)))
    )
    generation = generation_devices(res.settings, method.type)
    within = max(60.0, 3.0 * res.settings.requeue_interval_s)
    largest = await work_store.largest_worker(res.pool, within_s=within)
    if largest is not None and gpus + generation > largest:
        also = f" and {generation} for vLLM generation" if generation else ""
        raise InvalidRequest(
            f"This job needs {gpus + generation} devices ({gpus} for training{also}), but the largest "
            f"worker has {largest}.",
            param=f"{body.hyperparameters_param}.gpus",
            code="too_many_devices",
        )


async def validate(res: Resources, who: Principal, body: JobCreate) -> tuple[JobMethod, list[Path], FileRow]:
    """Everything a create can be refused for before it is inserted but the budget (`cost.check_budget`);
    returns the method, the paths of the training (and validation) file and the training file's row. A model
    a grader calls must be one the organisation may chat with (the trainer calls it through the gateway with
    a key of the organisation): else the chat route's 404."""
    org = who.organization_id
    if body.model not in res.settings.base_models:
        raise InvalidRequest(
            f"Model '{body.model}' is not available for fine-tuning; choose one of "
            f"{', '.join(sorted(res.settings.base_models))}.",
            param="model",
            code="model_not_available",
        )
    check_suffix(body.suffix)
    check_metadata(body.metadata)
    method = body.job_method
    guards.resolve(body.guards, method=method.type)
    await _check_devices(res, body)
    if method.grader is not None:
        await check_grader(res, org, method.grader, "method.reinforcement.grader")
        await check_models(res, who, model_fields(method.grader, param="method.reinforcement.grader"))
    # What cannot be honoured whatever the files hold (evaluation settings without a validation file).
    probe = DatasetSummary(1_000_000, 0)
    param = body.hyperparameters_param
    probed = resolve_hyperparameters(
        method,
        param,
        probe,
        probe if body.validation_file else None,
        res.settings.base_model_path(body.model),
    )
    check_servable_rank(probed, param, res.settings.engine_max_lora_rank)
    if not body.training_file:  # `from_capture` made it, or refused the body
        raise InvalidRequest("Missing required parameter: 'training_file'.", param="training_file")
    training = await _owned_file(res, org, body.training_file, "fine-tune", "training_file")
    files = [res.blobs.path(training.blob_key)]
    if body.validation_file:
        validation = await _owned_file(res, org, body.validation_file, "fine-tune", "validation_file")
        files.append(res.blobs.path(validation.blob_key))
    if method.environment is not None:
        await _owned_file(
            res, org, method.environment.file_id, "environment", "method.reinforcement.environment.file_id"
        )
    return method, files, training


class FileRejected(Exception):
    """A training or validation file that does not fit the job's method."""

    def __init__(self, param: str, message: str) -> None:
        super().__init__(message)
        self.param = param
        self.message = message


async def check_rows(res: Resources, path: Path, kind: str, param: str) -> DatasetSummary:
    """A training or validation file checked row by row against the method (in a thread)."""
    limit = res.settings.max_jsonl_line_bytes
    try:
        return await anyio.to_thread.run_sync(lambda: check_training_file(path, kind, max_line_bytes=limit))
    except RowError as exc:
        raise FileRejected(param, str(exc)) from None
    except InvalidRequest as exc:
        raise FileRejected(param, exc.message) from None


async def _fail_validation(
    res: Resources, events: JobEvents, row: JobRow, body: JobCreate, exc: FileRejected
) -> FineTuningJob:
    name, file_id = (
        ("Validation", body.validation_file)
        if exc.param == "validation_file"
        else ("Training", body.training_file)
    )
    error = {
        "code": f"invalid_{exc.param}",
        "message": f"{name} file {file_id}: {exc.message}",
        "param": exc.param,
    }
    failed = await store.to_failed(res.pool, job_id=row.id, error=error, from_states=("validating_files",))
    await events.add(error["message"], "validation_failed", level="error")
    return FineTuningJob.from_row(failed or row)


async def _with_usage(res: Resources, org_id: str, rows: list[JobRow]) -> list[FineTuningJob]:
    """Jobs with their training usage so far (extension field `usage`) and their cost, accrued and projected
    (`cost`, `gateway.jobs.cost`)."""
    jobs = [FineTuningJob.from_row(r) for r in rows]
    if not jobs:
        return jobs
    found = await usage_service.job_usage(res.pool, res.settings, org_id, [j.id for j in jobs])
    costs = await cost.job_costs(res.pool, res.settings, rows)
    for job in jobs:
        # Extension fields (extra="allow"): OpenAI's job shape is otherwise unchanged.
        job.usage = found.get(  # type: ignore[attr-defined]
            job.id, {"trained_tokens": 0, "training_seconds": 0.0, "steps": 0, "cost_usd": 0.0}
        )
        job.cost = costs[job.id]  # type: ignore[attr-defined]
    return jobs


def default_throughput(method: JobMethod) -> projection.Throughput:
    """The throughput assumed without a measured one: `DEFAULT_TOKENS_PER_SECOND` a device."""
    return projection.Throughput(projection.DEFAULT_TOKENS_PER_SECOND * method.gpus, measured=False)


def _replay(existing: JobRow, request_hash: str) -> FineTuningJob:
    if existing.request_hash != request_hash:
        raise Conflict(
            "This Idempotency-Key was already used with a different request body.",
            param="Idempotency-Key",
            code="idempotency_key_reused",
        )
    return FineTuningJob.from_row(existing)


async def get(res: Resources, who: Principal, job_id: str) -> FineTuningJob:
    row = await store.get(res.pool, org_id=who.organization_id, job_id=job_id)
    if row is None:
        raise not_found("fine-tuning job", job_id, param="fine_tuning_job_id")
    return (await _with_usage(res, who.organization_id, [row]))[0]


async def list_jobs(
    res: Resources, who: Principal, *, after: str | None, limit: int, metadata: dict[str, str] | None
) -> CursorPage[FineTuningJob]:
    rows = await store.list_page(
        res.pool, org_id=who.organization_id, after=after, limit=limit + 1, metadata=metadata
    )
    jobs = await _with_usage(res, who.organization_id, rows)
    return CursorPage[FineTuningJob].of(jobs, limit)


async def _transition(res: Resources, who: Principal, job_id: str, action: str) -> JobRow:
    fn = {"cancel": store.cancel, "pause": store.pause, "resume": store.resume}[action]
    row = await fn(res.pool, org_id=who.organization_id, job_id=job_id)
    if row is None:
        current = await get(res, who, job_id)  # 404 for unknown or foreign ids
        raise InvalidRequest(
            f"Cannot {action} a job whose status is '{current.status}'.",
            param="fine_tuning_job_id",
            code="invalid_state",
        )
    return row


async def cancel(res: Resources, who: Principal, job_id: str) -> FineTuningJob:
    row = await _transition(res, who, job_id, "cancel")
    await JobEvents(res.pool, job_id, who.organization_id).add("Job cancelled", "cancelled")
    return FineTuningJob.from_row(row)


async def pause(res: Resources, who: Principal, job_id: str) -> FineTuningJob:
    row = await _transition(res, who, job_id, "pause")
    await JobEvents(res.pool, job_id, who.organization_id).add("Job paused")
    return FineTuningJob.from_row(row)


async def resume(res: Resources, who: Principal, job_id: str) -> FineTuningJob:
    row = await _transition(res, who, job_id, "resume")
    await JobEvents(res.pool, job_id, who.organization_id).add(
        "Job resumed", f"queued:{row.queue_generation}"
    )
    await enqueue(res.queue, res.settings.queue_name, job_id, row.queue_generation)
    return FineTuningJob.from_row(row)


async def events(
    res: Resources, who: Principal, job_id: str, *, after: str | None, limit: int
) -> CursorPage[JobEvent]:
    await get(res, who, job_id)
    rows = await store.list_events(
        res.pool, org_id=who.organization_id, job_id=job_id, after=after, limit=limit + 1
    )
    return CursorPage[JobEvent].of([JobEvent.from_row(r) for r in rows], limit)


async def checkpoints(
    res: Resources, who: Principal, job_id: str, *, after: str | None, limit: int
) -> CursorPage[JobCheckpoint]:
    await get(res, who, job_id)
    rows = await store.list_checkpoints(
        res.pool, org_id=who.organization_id, job_id=job_id, after=after, limit=limit + 1
    )
    return CursorPage[JobCheckpoint].of([JobCheckpoint.from_row(r) for r in rows], limit)

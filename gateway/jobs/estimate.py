"""`POST /v1/fine_tuning/jobs/estimate`: what a job create with the same body would cost, before it runs.

The body is validated as a create validates it (`service.validate`: the same 400s, and another organisation's
file is refused as at create), its files are checked row by row and its `"auto"` hyperparameters resolved as
the create resolves them; then its files are tokenised with the base model's tokenizer and priced
(`gateway.jobs.projection`). A reinforcement estimate first samples its pilot (`gateway.jobs.pilot`: a few
training prompts through the chat route with the caller's key) to measure the completions' length. Whether
the job would be let start is the create's own budget check (`gateway.jobs.cost.budget_verdict`). Nothing
is stored.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import anyio

from gateway.deps import Caller, Resources
from gateway.errors import InvalidRequest
from gateway.jobs import cost, guards, pilot, projection, service, sources
from gateway.jobs.protocol import JobCreate, JobEstimate
from gateway.jobs.validation import RowError
from trainer.contract import AnyHyperparameters, ReinforcementHyperparameters

logger = logging.getLogger(__name__)


def _file_ids(body: JobCreate) -> tuple[str, str | None]:
    return body.training_file or "", body.validation_file


async def _pilot(
    res: Resources, caller: Caller, body: JobCreate, hp: AnyHyperparameters, training: Path
) -> pilot.Pilot | None:
    """A reinforcement job's pilot (None for the other methods, and for one trained offline on captured
    episodes: it samples nothing)."""
    if not isinstance(hp, ReinforcementHyperparameters) or body.capture is not None:
        return None
    settings = res.settings
    pick = functools.partial(pilot.pick_prompts, training, max_line_bytes=settings.max_jsonl_line_bytes)
    return await pilot.run(
        settings,
        caller.key,
        model=body.model,
        prompts=await anyio.to_thread.run_sync(pick),
        hp=hp,
        seed=body.seed,
        count=functools.partial(projection.count_texts, settings.base_model_path(body.model)),
    )


async def estimate(res: Resources, caller: Caller, body: JobCreate) -> JobEstimate:
    """The estimate of a create with this body (see the module)."""
    who = caller.principal
    org = who.organization_id
    body = await sources.with_training_file(res, who, body)
    method, files, training = await service.validate(res, who, body)
    try:
        summaries = [
            await service.check_rows(res, path, method.type, which)
            for path, which in zip(files, ("training_file", "validation_file"), strict=False)
        ]
        hp = service.resolve_for_files(res, body, method, summaries)
    except service.FileRejected as exc:
        file_id = _file_ids(body)[exc.param == "validation_file"]
        raise InvalidRequest(
            f"File {file_id}: {exc.message}", param=exc.param, code=f"invalid_{exc.param}"
        ) from None
    counted = []
    names = ("training_file", "validation_file")
    for path, which, file_id in zip(files, names, _file_ids(body), strict=False):
        count = functools.partial(
            projection.count_file,
            res.settings.base_model_path(body.model),
            method.type,
            path,
            max_length=getattr(hp, "max_length", None),
            max_line_bytes=res.settings.max_jsonl_line_bytes,
        )
        try:
            counted.append(await anyio.to_thread.run_sync(count))
        except RowError as exc:
            raise InvalidRequest(f"File {file_id}: {exc}", param=which, code=f"invalid_{which}") from None
    sampled = await _pilot(res, caller, body, hp, files[0])
    rate = await cost.throughput(res.pool, org_id=org, base_model=body.model, method=method.type)
    arithmetic = functools.partial(  # in a thread: a large file's counts are sorted
        projection.estimate,
        res.settings,
        base_model=body.model,
        kind=method.type,
        hp=hp,
        train=counted[0],
        valid=counted[1] if len(counted) > 1 else None,
        grader=method.grader,
        measured=sampled.completion() if sampled is not None and sampled.ran else None,
        throughput=(
            projection.Throughput(rate, measured=True)
            if rate is not None
            else service.default_throughput(method)
        ),
    )
    out = await anyio.to_thread.run_sync(arithmetic)
    assumptions = list(out.assumptions)
    if sampled is not None:  # beside the completions' length it measured
        at = next(i for i, a in enumerate(assumptions) if a.name == "completion_tokens") + 1
        assumptions.insert(at, sampled.assumption(res.settings))
    epochs = cost.given_epochs(method)  # as the create's check counts them
    verdict = await cost.budget_verdict(
        res, org, who.api_key_id, body.model, training.bytes, epochs, read_spend=True
    )
    return JobEstimate(
        model=body.model,
        method=method.type,
        hyperparameters=hp.model_dump(),
        steps=out.steps,
        examples=len(counted[0].counts),
        tokens=out.tokens,
        compute_seconds=out.compute_seconds,
        cost=out.cost,
        budget=cost.budget_state(verdict),
        allowed=verdict.allowed,
        refusal=verdict.refusal,
        max_cost=body.max_cost,
        guards=guards.resolve(body.guards, method=method.type),
        assumptions=assumptions,
    )

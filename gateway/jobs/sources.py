"""Where a job's training data comes from: the file it names, or captured episodes (`capture` in its create
body), exported as a training file of their sampled token ids when the job is made."""

from __future__ import annotations

from pydantic import ValidationError

from gateway.capture import export_service
from gateway.capture.protocol import ExportRequest
from gateway.deps import Resources
from gateway.errors import InvalidRequest, validation_failure
from gateway.jobs.protocol import JobCreate
from gateway.tenancy.keys import Principal


async def with_training_file(res: Resources, who: Principal, body: JobCreate) -> JobCreate:
    """The body with its training file: that given, or the captured episodes its `capture` selects,
    exported as a training file of token rows (`gateway.capture.export_service`; supervised jobs)."""
    if body.capture is None:
        if not body.training_file:
            raise InvalidRequest("Missing required parameter: 'training_file'.", param="training_file")
        return body
    if body.training_file:
        raise InvalidRequest(
            "Give either a training_file or capture (the captured episodes to train on), not both.",
            param="capture",
        )
    if body.job_method.type != "supervised":
        raise InvalidRequest(
            "Captured episodes train supervised jobs: give method.type 'supervised', or export the "
            "episodes (POST /v1/episodes/export) and make a file of your own.",
            param="capture",
            code="unsupported_method",
        )
    try:
        selection = ExportRequest.model_validate({**body.capture, "format": "jsonl", "purpose": "fine-tune"})
    except ValidationError as exc:
        raise validation_failure(exc.errors(), root="capture") from None
    made = await export_service.many(res, who, selection)
    assert not isinstance(made, bytes)
    return body.model_copy(update={"training_file": made.id})

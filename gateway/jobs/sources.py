"""Where a job's training data comes from: the file it names, or captured episodes (`capture` in its create
body), exported as a training file of their sampled token ids when the job is made.

What the captured episodes become depends on the method (`gateway.capture.export`):

- `supervised`: the selected samples (`input_ids`, `completion_mask`), trained on as given;
- `dpo`: preference pairs within each group (`dpo_pairs`: a higher-rewarded sample chosen over a
  lower-rewarded one with the same prompt ids), the loss on their sampled tokens;
- `reinforcement`: the samples whose group-relative advantage is not 0, with the sampler's logged
  `logprobs`: trained offline (`trainer.offline_rl`), on the rewards already posted, so the job needs no
  grader or environment. `capture.max_staleness` drops samples served by a model version too old.

A selection that gives nothing to train on (no pair of different rewards in any group) is a 400.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from gateway.capture import export_service
from gateway.capture.export import Sample, dpo_pairs, jsonl_row
from gateway.capture.protocol import ExportRequest
from gateway.deps import Resources
from gateway.errors import InvalidRequest, validation_failure
from gateway.jobs.protocol import JobCreate
from gateway.tenancy.keys import Principal


async def with_training_file(res: Resources, who: Principal, body: JobCreate) -> JobCreate:
    """The body with its training file: that given, or the captured episodes its `capture` selects,
    exported as a training file of token rows for its method (`gateway.capture.export_service`)."""
    if body.capture is None:
        if not body.training_file:
            raise InvalidRequest("Missing required parameter: 'training_file'.", param="training_file")
        return body
    if body.training_file:
        raise InvalidRequest(
            "Give either a training_file or capture (the captured episodes to train on), not both.",
            param="capture",
        )
    kind = body.job_method.type
    if kind != "supervised" and body.validation_file:
        raise InvalidRequest(
            f"A {kind} job from captured episodes takes no validation_file (it trains on rewards already "
            "posted, and has nothing to score one with).",
            param="validation_file",
        )
    try:
        selection = ExportRequest.model_validate({**body.capture, "format": "jsonl", "purpose": "fine-tune"})
    except ValidationError as exc:
        raise validation_failure(exc.errors(), root="capture") from None
    if kind == "supervised":
        made = await export_service.many(res, who, selection)
        assert not isinstance(made, bytes)
        return body.model_copy(update={"training_file": made.id})
    samples, stale = await export_service.select(res, who, selection)
    rows = dpo_pairs(samples, selection.group_by) if kind == "dpo" else _reinforcement_rows(samples)
    if not rows:
        raise _nothing_to_learn(kind, samples, stale, selection)
    made = await export_service.store_rows(res, who, rows)
    return body.model_copy(update={"training_file": made.id})


def _reinforcement_rows(samples: list[Sample]) -> list[dict[str, Any]]:
    """The samples that carry a learning signal: rewarded, with an advantage, and logprobs for the sampled
    tokens (the behaviour policy of the importance ratio)."""
    rows = []
    for s in samples:
        sampled = [lp for lp, m in zip(s.logprobs, s.completion_mask, strict=True) if m]
        if s.reward is None or s.advantage == 0.0 or not any(lp is not None for lp in sampled):
            continue
        rows.append(jsonl_row(s))
    return rows


def _nothing_to_learn(
    kind: str, samples: list[Sample], stale: int, selection: ExportRequest
) -> InvalidRequest:
    rewarded = sum(s.reward is not None for s in samples)
    groups = f"group (by '{selection.group_by}')" if selection.group_by else "group (all the samples)"
    what = "no pair of samples with the same prompt" if kind == "dpo" else "no sample"
    also = f"; {stale} were dropped as stale (max_staleness)" if stale else ""
    return InvalidRequest(
        f"Nothing to train a {kind} job on: {what} differs in reward from the others of its {groups}. "
        f"The selection holds {len(samples)} samples, {rewarded} of them rewarded{also}. Post rewards that "
        "tell the episodes of a group apart, or select other episodes.",
        param="capture",
        code="no_reward_differences",
    )

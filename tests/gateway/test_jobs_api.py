"""Fine-tuning jobs API through the openai SDK: create validation, shapes, paging, tenancy, idempotency,
state changes. (Training itself is tested in test_training.py.)"""

from __future__ import annotations

import json
from typing import Any

import httpx
import openai
import pytest

from tests.support.data import RFT, SAYS_YES
from tests.support.stack import GatewayServer, Tenant

SFT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}
DPO = {
    "input": {"messages": [{"role": "user", "content": "hi"}]},
    "preferred_output": [{"role": "assistant", "content": "hello"}],
    "non_preferred_output": [{"role": "assistant", "content": "go away"}],
}


def upload(t: Tenant, rows: list[dict], name: str = "train.jsonl") -> str:
    data = "\n".join(json.dumps(r) for r in rows).encode()
    return t.client.files.create(file=(name, data), purpose="fine-tune").id


def create(t: Tenant, **kw: Any) -> Any:
    return t.client.fine_tuning.jobs.create(**kw)


def test_supervised_job_shape_and_resolved_hyperparameters(tenant: Tenant) -> None:
    fid = upload(tenant, [SFT] * 8)
    job = create(tenant, model="tiny-chat", training_file=fid, suffix="first", metadata={"team": "a"})
    assert job.id.startswith("ftjob-") and job.object == "fine_tuning.job"
    assert job.status == "queued" and job.model == "tiny-chat" and job.training_file == fid
    assert job.organization_id == tenant.org_id and job.error is None and job.fine_tuned_model is None
    assert isinstance(job.seed, int) and job.result_files == [] and job.metadata == {"team": "a"}
    assert job.method is not None and job.method.type == "supervised"
    hp = job.method.supervised.hyperparameters
    assert isinstance(hp.n_epochs, int) and isinstance(hp.batch_size, int)
    assert hp.learning_rate_multiplier == 1.0
    assert job.hyperparameters.n_epochs == hp.n_epochs
    again = tenant.client.fine_tuning.jobs.retrieve(job.id)
    assert again.id == job.id and again.status == "queued"
    events = tenant.client.fine_tuning.jobs.list_events(job.id)
    messages = [e.message for e in events.data]
    assert messages[0] == "Files validated, moving job to queued state"  # newest first
    assert any(m.startswith("Created fine-tuning job") for m in messages)
    assert all(e.object == "fine_tuning.job.event" and e.level == "info" for e in events.data)
    assert tenant.client.fine_tuning.jobs.checkpoints.list(job.id).data == []


def test_dpo_and_reinforcement_creates(tenant: Tenant) -> None:
    dpo = create(
        tenant,
        model="tiny-chat",
        training_file=upload(tenant, [DPO] * 4),
        method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 0.2, "n_epochs": 2}}},
    )
    assert dpo.status == "queued" and dpo.method.dpo.hyperparameters.beta == 0.2
    rl = create(
        tenant,
        model="tiny-chat",
        training_file=upload(tenant, RFT[:4]),
        seed=7,
        method={
            "type": "reinforcement",
            "reinforcement": {"grader": SAYS_YES, "hyperparameters": {"num_generations": 4, "batch_size": 2}},
        },
    )
    assert rl.status == "queued" and rl.seed == 7
    assert rl.method.reinforcement.grader.type == "string_check"
    body = rl.method.reinforcement.model_dump()
    assert body["hyperparameters"]["num_generations"] == 4


def test_legacy_hyperparameters_mean_supervised(tenant: Tenant) -> None:
    job = create(
        tenant, model="tiny-chat", training_file=upload(tenant, [SFT] * 4), hyperparameters={"n_epochs": 3}
    )
    assert job.method.type == "supervised" and job.hyperparameters.n_epochs == 3


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"model": "gpt-17"}, "model"),
        ({"training_file": "file-nope"}, "training_file"),
        ({"validation_file": "file-nope"}, "validation_file"),
        ({"suffix": "x" * 65}, "suffix"),
        ({"suffix": "a:b"}, "suffix"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata"),
        ({"method": {"type": "magic"}}, "method.type"),
        ({"hyperparameters": {"n_epochs": 0}}, "hyperparameters.n_epochs"),
        ({"hyperparameters": {"batch_size": 257}}, "hyperparameters.batch_size"),
        ({"hyperparameters": {"learning_rate_multiplier": 0}}, "hyperparameters.learning_rate_multiplier"),
        (
            {"method": {"type": "dpo", "dpo": {"hyperparameters": {"beta": 3}}}},
            "method.dpo.hyperparameters.beta",
        ),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 1.5}}}},
            "method.supervised.hyperparameters.n_epochs",
        ),
        (
            {"method": {"type": "supervised", "supervised": {"hyperparameters": {"num_generations": 4}}}},
            "method.supervised.hyperparameters.num_generations",
        ),
        (
            {"method": {"type": "dpo", "dpo": {"hyperparameters": {"batch_size": "8"}}}},
            "method.dpo.hyperparameters.batch_size",
        ),
        (
            {
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {"grader": SAYS_YES, "hyperparameters": {"reasoning_effort": "high"}},
                }
            },
            "method.reinforcement.hyperparameters.reasoning_effort",
        ),
        (
            {
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {"grader": SAYS_YES, "hyperparameters": {"eval_interval": 2}},
                }
            },
            "method.reinforcement.hyperparameters.eval_interval",
        ),
        ({"method": {"type": "reinforcement", "reinforcement": {}}}, "method.reinforcement.grader"),
        (
            {
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {"grader": SAYS_YES, "environment": {"file_id": "f"}},
                }
            },
            "method.reinforcement.grader",
        ),
        (
            {"method": {"type": "reinforcement", "reinforcement": {"grader": {"type": "string_check"}}}},
            "method.reinforcement.grader.input",
        ),
        (
            {
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {
                        "grader": {
                            "type": "text_similarity",
                            "input": "a",
                            "reference": "b",
                            "evaluation_metric": "cosine",
                        }
                    },
                }
            },
            "method.reinforcement.grader.evaluation_metric",
        ),
        (
            {
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {
                        "grader": {"type": "python", "source": "def not_grade(sample, item):\n    return 1\n"}
                    },
                }
            },
            "method.reinforcement.grader.source",
        ),
        (
            {
                "method": {
                    "type": "reinforcement",
                    "reinforcement": {
                        "grader": {
                            "type": "multi",
                            "graders": {"a": SAYS_YES},
                            "calculate_output": "__import__('os')",
                        }
                    },
                }
            },
            "method.reinforcement.grader.calculate_output",
        ),
        (
            {"method": {"type": "reinforcement", "reinforcement": {"environment": {"file_id": "file-nope"}}}},
            "method.reinforcement.environment.file_id",
        ),
    ],
)
def test_invalid_create_fields(tenant: Tenant, kwargs: dict[str, Any], param: str) -> None:
    body = {"model": "tiny-chat", "training_file": upload(tenant, [SFT]), **kwargs}
    with pytest.raises(openai.BadRequestError) as err:
        create(tenant, **body)
    assert err.value.param == param, err.value.message
    assert tenant.client.fine_tuning.jobs.list().data == []


def test_non_finite_hyperparameters_are_refused(stack: GatewayServer, tenant: Tenant) -> None:
    """JSON has no NaN or Infinity, yet parsers take them: a hyperparameter may never be one."""
    fid = upload(tenant, [SFT])
    for literal in ("NaN", "Infinity", "-Infinity"):
        hp = {"learning_rate_multiplier": "LITERAL"}
        method = {"type": "supervised", "supervised": {"hyperparameters": hp}}
        body = json.dumps({"model": "tiny-chat", "training_file": fid, "method": method})
        body = body.replace('"LITERAL"', literal)
        resp = httpx.post(
            f"{stack.url}/v1/fine_tuning/jobs",
            content=body,
            headers={"Authorization": f"Bearer {tenant.key}", "Content-Type": "application/json"},
        )
        assert resp.status_code == 400, resp.text
        error = resp.json()["error"]
        assert error["param"] == "method.supervised.hyperparameters.learning_rate_multiplier", error
    assert tenant.client.fine_tuning.jobs.list().data == []


def test_file_purpose_and_ownership_are_checked(tenant: Tenant, other_tenant: Tenant) -> None:
    notes = tenant.client.files.create(file=("n.txt", b"x"), purpose="user_data").id
    with pytest.raises(openai.BadRequestError) as err:
        create(tenant, model="tiny-chat", training_file=notes)
    assert err.value.param == "training_file"
    foreign = upload(other_tenant, [SFT])
    with pytest.raises(openai.BadRequestError) as err:
        create(tenant, model="tiny-chat", training_file=foreign)
    assert err.value.param == "training_file"


@pytest.mark.parametrize(
    ("method", "rows", "needle"),
    [
        (None, [SFT, {"messages": [{"role": "user", "content": "no answer"}]}], "Line 2"),
        (None, [{"prompt": "x"}], "Line 1"),
        ({"type": "dpo"}, [DPO, DPO, {"input": {"messages": []}}], "Line 3"),
        (
            {"type": "reinforcement", "reinforcement": {"grader": SAYS_YES}},
            [RFT[0], {"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}],
            "Line 2",
        ),
    ],
    ids=["sft-no-assistant", "sft-no-messages", "dpo-empty", "rft-not-ending-with-user"],
)
def test_rows_checked_against_the_method(
    tenant: Tenant, method: dict | None, rows: list[dict], needle: str
) -> None:
    kw: dict[str, Any] = {"model": "tiny-chat", "training_file": upload(tenant, rows)}
    if method:
        kw["method"] = method
    job = create(tenant, **kw)
    assert job.status == "failed" and job.error is not None
    assert job.error.code == "invalid_training_file" and job.error.param == "training_file"
    assert needle in job.error.message and job.finished_at is not None


def test_list_paging_and_metadata_filter(tenant: Tenant) -> None:
    fid = upload(tenant, [SFT] * 2)
    ids = [
        create(tenant, model="tiny-chat", training_file=fid, metadata={"n": str(i % 2)}).id for i in range(5)
    ]
    first = tenant.client.fine_tuning.jobs.list(limit=2)
    assert [j.id for j in first.data] == ids[::-1][:2] and first.has_more
    assert [j.id for j in tenant.client.fine_tuning.jobs.list(limit=2)] == ids[::-1]
    assert tenant.client.fine_tuning.jobs.list(after=ids[0]).data == []
    odd = tenant.client.fine_tuning.jobs.list(metadata={"n": "1"})
    assert [j.id for j in odd.data] == [ids[3], ids[1]]


def test_other_tenants_jobs_are_404(tenant: Tenant, other_tenant: Tenant) -> None:
    job = create(tenant, model="tiny-chat", training_file=upload(tenant, [SFT]))
    jobs = other_tenant.client.fine_tuning.jobs
    for call in (
        jobs.retrieve,
        jobs.cancel,
        jobs.pause,
        jobs.resume,
        jobs.list_events,
        jobs.checkpoints.list,
    ):
        with pytest.raises(openai.NotFoundError):
            call(job.id)
    assert jobs.list().data == []


def test_idempotent_create(stack: GatewayServer, tenant: Tenant) -> None:
    fid = upload(tenant, [SFT] * 2)
    h = {"Authorization": f"Bearer {tenant.key}", "Idempotency-Key": "abc-123"}
    body = {"model": "tiny-chat", "training_file": fid, "suffix": "once"}
    a = httpx.post(f"{stack.url}/v1/fine_tuning/jobs", json=body, headers=h)
    b = httpx.post(f"{stack.url}/v1/fine_tuning/jobs", json=body, headers=h)
    assert a.status_code == b.status_code == 200 and a.json()["id"] == b.json()["id"]
    c = httpx.post(f"{stack.url}/v1/fine_tuning/jobs", json={**body, "suffix": "twice"}, headers=h)
    assert c.status_code == 409 and c.json()["error"]["code"] == "idempotency_key_reused"
    assert len(tenant.client.fine_tuning.jobs.list().data) == 1
    sdk = tenant.client.fine_tuning.jobs.create(**body, extra_headers={"Idempotency-Key": "abc-123"})
    assert sdk.id == a.json()["id"]


def test_cancel_pause_resume_transitions(tenant: Tenant) -> None:
    jobs = tenant.client.fine_tuning.jobs
    job = create(tenant, model="tiny-chat", training_file=upload(tenant, [SFT]))
    assert jobs.pause(job.id).status == "paused"
    with pytest.raises(openai.BadRequestError):
        jobs.pause(job.id)
    assert jobs.resume(job.id).status == "queued"
    cancelled = jobs.cancel(job.id)
    assert cancelled.status == "cancelled" and cancelled.finished_at is not None
    for call in (jobs.cancel, jobs.pause, jobs.resume):
        with pytest.raises(openai.BadRequestError) as err:
            call(job.id)
        assert err.value.code == "invalid_state"
    assert jobs.list_events(job.id).data[0].message == "Job cancelled"

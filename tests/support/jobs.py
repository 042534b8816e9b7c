"""Helpers for tests that train through a running stack: upload rows, wait for states, read events, and look
for trainer processes."""

from __future__ import annotations

import json
import time
from typing import Any

from tests.support.data import BASE, RFT, SAYS_YES
from tests.support.stack import Tenant, command_lines

FINAL_STATES = ("succeeded", "failed", "cancelled")


def upload_rows(t: Tenant, rows: list[dict[str, Any]], name: str = "train.jsonl") -> str:
    """A `fine-tune` JSONL file of these rows; returns its id."""
    data = "\n".join(json.dumps(r) for r in rows).encode()
    return t.client.files.create(file=(name, data), purpose="fine-tune").id


def wait_for(t: Tenant, job_id: str, states: tuple[str, ...] = FINAL_STATES, timeout: float = 240) -> Any:
    """Poll the job until its status is one of `states`; returns the job."""
    deadline = time.monotonic() + timeout
    job = t.client.fine_tuning.jobs.retrieve(job_id)
    while job.status not in states:
        if time.monotonic() >= deadline:
            said = [f"{e.level}: {e.message}" for e in all_events(t, job_id)[:8]]
            raise AssertionError(f"job {job_id} stuck in {job.status}; its latest events: {said}")
        time.sleep(0.3)
        job = t.client.fine_tuning.jobs.retrieve(job_id)
    return job


def all_events(t: Tenant, job_id: str) -> list[Any]:
    """Every event of the job, newest first (the SDK follows the pages)."""
    return list(t.client.fine_tuning.jobs.list_events(job_id, limit=100))


def metrics(t: Tenant, job_id: str) -> list[dict[str, Any]]:
    """The data of the job's metrics events, by step."""
    return sorted((e.data for e in all_events(t, job_id) if e.type == "metrics"), key=lambda d: d["step"])


def metrics_steps(t: Tenant, job_id: str) -> list[int]:
    """The steps that have a metrics event, sorted (a step recorded twice would show twice)."""
    return sorted(e.data["step"] for e in all_events(t, job_id) if e.type == "metrics")


def trainer_processes(job_id: str) -> list[int]:
    """Pids of `python -m trainer run` processes of this job."""
    return [pid for pid, cmd in command_lines().items() if "trainer run" in cmd and job_id in cmd]


def wait_trainer_gone(job_id: str, timeout: float = 30) -> None:
    """Wait until no trainer process of the job is left."""
    deadline = time.monotonic() + timeout
    while trainer_processes(job_id):
        assert time.monotonic() < deadline, f"the trainer of {job_id} is still running"
        time.sleep(0.2)


def long_sft_job(
    t: Tenant, rows: list[dict[str, Any]], *, steps: int, checkpoint_every: int = 3, **hyperparameters: Any
) -> Any:
    """A supervised job of `steps` single-example steps over `rows` (many epochs), to interrupt mid-run;
    `hyperparameters` over those."""
    return t.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=upload_rows(t, rows),
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {
                    "n_epochs": 50,
                    "batch_size": 1,
                    "max_steps": steps,
                    "checkpoint_every": checkpoint_every,
                    **hyperparameters,
                }
            },
        },
    )


def rl_job(
    t: Tenant, *, steps: int, checkpoint_every: int = 3, suffix: str | None = None, **hyperparameters: Any
) -> Any:
    """A reinforcement job of `steps` steps of 2 prompts x 4 answers on `RFT`, graded by `SAYS_YES`;
    `hyperparameters` over those."""
    return t.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=upload_rows(t, RFT),
        **({"suffix": suffix} if suffix is not None else {}),
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": SAYS_YES,
                "hyperparameters": {
                    "n_epochs": 50,
                    "batch_size": 2,
                    "num_generations": 4,
                    "max_completion_length": 16,
                    "max_steps": steps,
                    "checkpoint_every": checkpoint_every,
                    **hyperparameters,
                },
            },
        },
    )


def graded_rl_job(t: Tenant, grader: dict[str, Any], **hyperparameters: Any) -> Any:
    """A reinforcement job on four arithmetic questions graded by `grader` (each row carries its `question`
    for the grader's templates): one step of 2 prompts x 2 answers of up to 4 tokens; `hyperparameters` over
    those."""
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} + {i}?"}], "question": f"What is {i} + {i}?"}
        for i in range(4)
    ]
    return t.client.fine_tuning.jobs.create(
        model=BASE,
        training_file=upload_rows(t, rows),
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": grader,
                "hyperparameters": {
                    "batch_size": 2,
                    "num_generations": 2,
                    "max_completion_length": 4,
                    "max_steps": 1,
                    **hyperparameters,
                },
            },
        },
    )

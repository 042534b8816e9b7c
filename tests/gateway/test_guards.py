"""Guards: the signals over synthetic metric series, the job's `guards` and their bad input through the SDK,
and failures injected into real training runs (a learning rate 100 times too high, a trainer that stops
making progress, a grader that errors on a tenth of its calls, a sampler that draws from another
distribution than the one the trainer scores), each caught within a few steps with its action taken and an
event that gives the numbers.
"""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import openai
import pytest

from gateway.blobstore import BlobStore
from gateway.db import create_pool
from gateway.errors import InvalidRequest
from gateway.jobs import guards as job_guards
from gateway.jobs import store as jobs_store
from gateway.worker.context import JobContext
from gateway.worker.job import guards
from gateway.worker.job.guards import GUARD_PAUSED, GUARD_WARNING
from gateway.worker.job.ingest import Progress
from tests.support.data import BASE, RFT, SFT
from tests.support.fixtures import worker_fixture
from tests.support.jobs import (
    all_events,
    metrics,
    metrics_steps,
    upload_rows,
    wait_for,
    wait_trainer_gone,
)
from tests.support.stack import GatewayServer, Services, Tenant, WorkerProcess, admin_of, start_gateway
from tunegate.services import scratch_database

ESTIMATE = "/fine_tuning/jobs/estimate"
DEFAULTS = job_guards.defaults()

guard_worker = worker_fixture(of="stack", TUNEGATE_HEARTBEAT_INTERVAL_S="0.5", TUNEGATE_STOP_GRACE_S="30")


def _points(**series: list[Any]) -> list[dict[str, Any]]:
    """Metrics points, step by step, from one list of values per key (None: the key left out)."""
    n = max(len(v) for v in series.values())
    return [
        {"step": i + 1, **{k: v[i] for k, v in series.items() if i < len(v) and v[i] is not None}}
        for i in range(n)
    ]


def _settings(name: str) -> dict[str, Any]:
    return {k: v for k, v in DEFAULTS[name].items() if k != "action"}


# ---- the signals, over synthetic series ----------------------------------------------------------------


def test_non_finite_loss_or_gradient() -> None:
    assert guards.non_finite(_points(train_loss=[2.0, 1.5], grad_norm=[1.0, 0.9])) is None
    assert guards.non_finite([{"step": 3}]) is None  # a step that reports neither
    for key in ("train_loss", "grad_norm"):
        fired = guards.non_finite([{"step": 1, key: None}])  # the trainer writes NaN and inf as null
        assert fired is not None and key in fired.what and fired.numbers == {key: None}
        assert guards.non_finite([{"step": 1, key: math.inf}]) is not None


def test_explosion_against_the_running_median() -> None:
    calm = [1.0, 1.2, 0.9, 1.1, 1.0]
    assert guards.explosion(_points(grad_norm=[*calm, 5.0]), **_settings("explosion")) is None
    fired = guards.explosion(_points(grad_norm=[*calm, 50.0]), **_settings("explosion"))
    assert fired is not None and fired.numbers["median"] == 1.0 and fired.numbers["ratio"] == 50.0
    # Too few steps known: no median to judge by.
    early = _points(grad_norm=[1.0, 50.0])
    assert guards.explosion(early, factor=10, window=20, min_steps=3) is None
    assert guards.explosion(early, **_settings("explosion")) is not None  # one step is enough by default
    # but for reinforcement, whose gradient norm moves several-fold from one step to the next
    rl = {k: v for k, v in job_guards.defaults("reinforcement")["explosion"].items() if k != "action"}
    assert rl["min_steps"] == 3 and guards.explosion(early, **rl, kind="reinforcement") is None
    assert rl["factor"] == 30.0  # and a step many times its median is a reinforcement step's variance
    assert guards.explosion(_points(grad_norm=[0.2, 0.9, 0.5, 9.0]), **rl, kind="reinforcement") is None
    assert guards.explosion(_points(grad_norm=[0.2, 0.9, 0.5, 20.0]), **rl, kind="reinforcement") is not None
    # Steps that trained nothing (a zero norm) are not part of the median.
    assert (
        guards.explosion(_points(grad_norm=[0, 0, 0, 1.0, 1.0, 1.0, 8.0]), **_settings("explosion")) is None
    )
    # The loss too, but not a reinforcement job's (it sits near 0).
    losses = _points(train_loss=[2.0, 1.9, 1.8, 1.7, 40.0])
    assert guards.explosion(losses, **_settings("explosion")) is not None
    assert guards.explosion(losses, **_settings("explosion"), kind="reinforcement") is None
    # A loss near 0 that jumps many times over but stays below where training started is no explosion.
    assert (
        guards.explosion(_points(train_loss=[2.0, 0.01, 0.01, 0.01, 0.5]), **_settings("explosion")) is None
    )


def test_length_runaway() -> None:
    settings = {"clipped_ratio": 0.9, "growth": 4.0, "steps": 3}
    assert (
        guards.length_runaway(_points(**{"completions/clipped_ratio": [1, 1, 0.5, 1, 1]}), **settings) is None
    )
    fired = guards.length_runaway(_points(**{"completions/clipped_ratio": [0.2, 0.95, 1, 1]}), **settings)
    assert fired is not None and fired.numbers["clipped_ratio"] == [0.95, 1, 1]
    grows = _points(completion_length_mean=[10, 12, 11, 30, 45, 50, 60])
    fired = guards.length_runaway(grows, **settings)
    assert fired is not None and fired.numbers["baseline"] == 11
    assert (
        guards.length_runaway(_points(completion_length_mean=[10, 12, 11, 30, 35, 50, 60]), **settings)
        is None
    )


def test_entropy_collapse() -> None:
    settings = {"fraction": 0.1, "steps": 3}
    fired = guards.entropy_collapse(_points(entropy=[2.0, 2.1, 1.9, 0.1, 0.05, 0.01]), **settings)
    assert fired is not None and fired.numbers["baseline"] == 2.0
    assert guards.entropy_collapse(_points(entropy=[2.0, 2.1, 1.9, 0.1, 0.5, 0.01]), **settings) is None
    assert guards.entropy_collapse(_points(train_loss=[1.0] * 8), **settings) is None  # no entropy reported


def test_sampler_mismatch() -> None:
    settings = {"max_kl": 0.02, "min_ratio": 0.8, "max_ratio": 1.25, "steps": 3}
    clean = _points(**{"mismatch/kl": [1e-7, -8e-8, 2e-7], "mismatch/ratio_mean": [1.0, 1.0, 1.0]})
    assert guards.sampler_mismatch(clean, **settings) is None
    skewed = _points(
        **{
            "mismatch/kl": [0.001, 0.045, 0.06, 0.039],
            "mismatch/ratio_mean": [1.0, 0.958, 0.95, 0.963],
            "mismatch/logprob_diff_mean": [0.001, 0.045, 0.06, 0.039],
            "mismatch/ratio_min": [0.99, 0.82, 0.66, 0.77],
        }
    )
    fired = guards.sampler_mismatch(skewed, **settings)
    assert fired is not None and "KL 0.039 per token" in fired.what
    assert fired.numbers == {
        "steps": [2, 3, 4],
        "kl": [0.045, 0.06, 0.039],
        "ratio_mean": [0.958, 0.95, 0.963],
        "logprob_diff_mean": [0.045, 0.06, 0.039],
        "ratio_min": 0.77,
        "ratio_max": None,
    }
    assert guards.sampler_mismatch(skewed[:3], **settings) is None  # two steps off, one within
    # The ratio alone, either way out of range; steps that measure nothing are not counted.
    low = _points(**{"mismatch/ratio_mean": [0.7, None, 0.75, 0.6]})
    assert guards.sampler_mismatch(low, **settings) is not None
    assert guards.sampler_mismatch(low[:3], **settings) is None  # the newest step measured nothing
    high = _points(**{"mismatch/ratio_mean": [1.3, 2.0, 1.5]})
    assert guards.sampler_mismatch(high, **settings) is not None
    assert guards.sampler_mismatch(high, **{**settings, "max_ratio": 1.6}) is None
    assert guards.sampler_mismatch(_points(entropy=[0.4] * 5), **settings) is None  # no numbers: no signal


def test_error_rate_over_its_window() -> None:
    settings = {"max_rate": 0.05, "window": 3}
    # One failure in eight at two of three steps: 8.3% on average.
    fired = guards.error_rate(_points(grader_error_rate=[0, 0.125, 0.125]), **settings)
    assert fired is not None and fired.numbers["error_rate"] == pytest.approx(0.25 / 3)
    assert guards.error_rate(_points(grader_error_rate=[0, 0, 0.125]), **settings) is None  # 4.2%
    assert (
        guards.error_rate(_points(grader_error_rate=[0.5, 0.5]), **settings) is None
    )  # a window not full yet
    assert guards.error_rate(_points(env_error_rate=[0.1, 0.1, 0.1]), **settings) is not None
    assert guards.error_rate(_points(train_loss=[1.0, 1.0, 1.0]), **settings) is None
    # One batch lost whole (a sandbox call that timed out) is one failure, not a rate; two are.
    assert guards.error_rate(_points(env_error_rate=[0, 1.0, 0]), **settings) is None
    assert guards.error_rate(_points(env_error_rate=[0, 1.0, 0.5]), **settings) is not None
    assert guards.error_rate(_points(env_error_rate=[0.5]), max_rate=0.05, window=1) is not None


def test_validation_divergence() -> None:
    # Evaluations at steps 2, 4, 6: the reward rises while validation falls at both of the last two.
    hacked = _points(
        reward_mean=[0.1, 0.2, 0.4, 0.5, 0.7, 0.8], valid_reward_mean=[None, 0.5, None, 0.4, None, 0.3]
    )
    fired = guards.validation_divergence(hacked, evaluations=2, kind="reinforcement")
    assert fired is not None and fired.numbers["steps"] == [2, 4, 6]
    # Validation rose once in between: no divergence over two evaluations (one is enough with evaluations=1).
    mixed = _points(
        reward_mean=[0.1, 0.2, 0.4, 0.5, 0.7, 0.8], valid_reward_mean=[None, 0.5, None, 0.6, None, 0.3]
    )
    assert guards.validation_divergence(mixed, evaluations=2, kind="reinforcement") is None
    assert guards.validation_divergence(mixed, evaluations=1, kind="reinforcement") is not None
    # Supervised: the training loss falls while the validation loss rises (overfitting).
    overfit = _points(train_loss=[2.0, 1.8, 1.5, 1.2, 1.0, 0.8], valid_loss=[None, 1.9, None, 2.0, None, 2.2])
    assert guards.validation_divergence(overfit, evaluations=2, kind="supervised") is not None
    assert (
        guards.validation_divergence(overfit[:-1], evaluations=2, kind="supervised") is None
    )  # not at an eval


def test_hang_and_best_checkpoint() -> None:
    assert guards.hang(10.0, seconds=30) is None
    fired = guards.hang(31.5, seconds=30)
    assert fired is not None and fired.numbers == {"idle_s": 31.5}
    ckpts = [(3, {"full_valid_reward_mean": 0.4}), (6, {"full_valid_reward_mean": 0.7}), (9, {}), (12, None)]
    assert guards.best_checkpoint(ckpts, "reinforcement") == 6
    assert guards.best_checkpoint([(3, {"full_valid_loss": 2.0}), (6, {"full_valid_loss": 1.5})], "dpo") == 6
    assert guards.best_checkpoint([(3, {}), (6, None)], "supervised") is None


def test_evaluate_honours_off() -> None:
    nan = [{"step": 1, "train_loss": None}]
    assert set(guards.evaluate(nan, DEFAULTS, "supervised")) == {"non_finite"}
    off = job_guards.resolve({"non_finite": {"action": "off"}})
    assert guards.evaluate(nan, off, "supervised") == {}


def test_resolve_checks_every_setting() -> None:
    assert job_guards.resolve(None) == DEFAULTS
    given = job_guards.resolve({"hang": {"seconds": 60, "action": "warn"}, "explosion": {"window": 5.0}})
    assert given["hang"] == {"seconds": 60.0, "action": "warn"} and given["explosion"]["window"] == 5
    assert given["non_finite"] == {"action": "pause"}
    # A stored row's guards win over the defaults (a job keeps what it was created with).
    assert job_guards.resolve(None, given) == given
    bad: list[tuple[Any, str]] = [
        ([1], "guards"),
        ({"speed": {}}, "guards.speed"),
        ({"hang": 5}, "guards.hang"),
        ({"hang": {"minutes": 5}}, "guards.hang.minutes"),
        ({"hang": {"seconds": 0}}, "guards.hang.seconds"),
        ({"hang": {"seconds": "5"}}, "guards.hang.seconds"),
        ({"hang": {"seconds": True}}, "guards.hang.seconds"),
        ({"error_rate": {"max_rate": 1.5}}, "guards.error_rate.max_rate"),
        ({"explosion": {"window": 2.5}}, "guards.explosion.window"),
        ({"hang": {"action": "explode"}}, "guards.hang.action"),
        ({"sampler_mismatch": {"max_kl": -0.1}}, "guards.sampler_mismatch.max_kl"),
        ({"sampler_mismatch": {"min_ratio": 1.5}}, "guards.sampler_mismatch.min_ratio"),
        ({"sampler_mismatch": {"max_ratio": 0.5}}, "guards.sampler_mismatch.max_ratio"),
        ({"sampler_mismatch": {"steps": 0}}, "guards.sampler_mismatch.steps"),
        ({"sampler_mismatch": {"ratio": 1.1}}, "guards.sampler_mismatch.ratio"),
    ]
    for body, param in bad:
        with pytest.raises(InvalidRequest) as caught:
            job_guards.resolve(body)
        assert caught.value.param == param, body


# ---- through the SDK -----------------------------------------------------------------------------------


def _refusal(call: Any) -> tuple[int, dict[str, Any]]:
    with pytest.raises(openai.APIStatusError) as caught:
        call()
    return caught.value.status_code, caught.value.response.json()["error"]


def test_guards_on_the_job_and_bad_input(guard_worker: WorkerProcess, tenant: Tenant) -> None:
    training = upload_rows(tenant, SFT)
    for body, param in [
        ({"nope": {}}, "guards.nope"),
        ({"hang": {"seconds": -1}}, "guards.hang.seconds"),
        ({"error_rate": {"max_rate": 2}}, "guards.error_rate.max_rate"),
        ({"non_finite": {"action": "ignore"}}, "guards.non_finite.action"),
        ({"hang": {"seconds": 10, "x": 1}}, "guards.hang.x"),
        ({"sampler_mismatch": {"max_kl": 101}}, "guards.sampler_mismatch.max_kl"),
        ({"sampler_mismatch": {"kl": 0.1}}, "guards.sampler_mismatch.kl"),
        ([], "guards"),
    ]:
        full = {"model": BASE, "training_file": training, "guards": body}
        for path in ("/fine_tuning/jobs", ESTIMATE):
            status, error = _refusal(lambda b=full, p=path: tenant.client.post(p, body=b, cast_to=object))
            assert status == 400 and error["param"] == param and error["type"] == "invalid_request_error", (
                error
            )
            assert set(error) == {"message", "type", "param", "code"}
    assert tenant.client.fine_tuning.jobs.list().data == []
    given = {"hang": {"seconds": 120, "action": "warn"}, "sampler_mismatch": {"max_kl": 0.5, "steps": 2}}
    expected = {
        **DEFAULTS,
        "hang": {"seconds": 120.0, "action": "warn"},
        "sampler_mismatch": {
            "max_kl": 0.5,
            "min_ratio": 0.8,
            "max_ratio": 1.25,
            "steps": 2,
            "action": "warn",
        },
    }
    body = {"model": BASE, "training_file": training, "guards": given}
    estimate: Any = tenant.client.post(ESTIMATE, body=body, cast_to=object)
    assert estimate["guards"] == expected
    job = tenant.client.fine_tuning.jobs.create(
        model=BASE, training_file=training, extra_body={"guards": given}
    )
    assert (tenant.client.fine_tuning.jobs.retrieve(job.id).model_extra or {})["guards"] == expected
    # A clean run at the base learning rate trips no guard (8 steps).
    done = wait_for(tenant, job.id, timeout=60)
    assert done.status == "succeeded", done.error
    tripped = [
        e.message
        for e in all_events(tenant, job.id)
        if e.message.startswith((GUARD_WARNING + " ", GUARD_PAUSED))
    ]
    assert tripped == []


def _guard_event(t: Tenant, job_id: str, prefix: str) -> Any:
    found = [e for e in all_events(t, job_id) if e.message.startswith(prefix)]
    assert len(found) == 1, [e.message for e in all_events(t, job_id)]
    return found[0]


def _rl_job(t: Tenant, source: str, guards_given: dict[str, Any], steps: int = 12, **more: Any) -> Any:
    """A reinforcement job of 2 prompts x 4 answers a step on `RFT`, graded by a python grader `source`."""
    hp = {
        "n_epochs": 50,
        "batch_size": 2,
        "num_generations": 4,
        "max_completion_length": 8,
        "max_steps": steps,
        "checkpoint_every": 1,
        **more,
    }
    return t.client.fine_tuning.jobs.create(
        model=BASE,
        training_file=upload_rows(t, RFT),
        seed=7,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": {"type": "python", "name": "py", "source": source},
                "hyperparameters": hp,
            },
        },
        extra_body={"guards": guards_given},
    )


def _too_high(
    t: Tenant,
    checkpoint_every: int,
    validation: str | None = None,
    guards_given: dict[str, Any] | None = None,
) -> Any:
    """A supervised job of 40 one-example steps at 100 times the base learning rate (a fixed seed: the same
    run every time)."""
    hp = {
        "n_epochs": 50,
        "batch_size": 1,
        "max_steps": 40,
        "checkpoint_every": checkpoint_every,
        "learning_rate_multiplier": 100,
    }
    return t.client.fine_tuning.jobs.create(
        model=BASE,
        training_file=upload_rows(t, SFT),
        validation_file=validation,
        seed=7,
        method={"type": "supervised", "supervised": {"hyperparameters": hp}},
        extra_body={"guards": guards_given or {}},
    )


async def test_a_resumed_attempt_judges_the_steps_it_kept(
    guard_worker: WorkerProcess, stack: GatewayServer, tenant: Tenant
) -> None:
    """The guards of a job's second attempt read the steps its first one trained: a loss and gradient norm
    that are many times the one step of the new attempt before them, but ordinary for the run, pause
    nothing (on that one step alone they would)."""
    job = tenant.client.fine_tuning.jobs.create(
        model=BASE,
        training_file=upload_rows(tenant, SFT),
        method={"type": "supervised", "supervised": {"hyperparameters": {"batch_size": 1, "max_steps": 4}}},
    )
    assert wait_for(tenant, job.id, ("succeeded", "failed", "cancelled"), timeout=120).status == "succeeded"
    kept = [(m["step"], m["train_loss"], m["grad_norm"]) for m in metrics(tenant, job.id)]
    assert [k[0] for k in kept] == [1, 2, 3, 4] and all(k[1] > 0 and k[2] > 0 for k in kept), kept
    first_loss, norms = kept[0][1], sorted(k[2] for k in kept)
    # Step 5 learned its row (tiny numbers); step 6 is an ordinary step of the run.
    tiny = {"step": 5, "train_loss": first_loss / 1000, "grad_norm": norms[0] / 1000}
    ordinary = {"step": 6, "train_loss": first_loss / 2, "grad_norm": norms[len(norms) // 2]}
    paused: list[str] = []

    async def pause(message: str, reason: str, data: dict[str, Any]) -> bool:
        paused.append(message)
        return True

    pool = await create_pool(stack.settings.database_url, min_size=1, max_size=1)
    try:
        row = await jobs_store.get(pool, org_id=tenant.org_id, job_id=job.id)
        assert row is not None
        for attempt, fires in ((2, False), (1, True)):
            this = dataclasses.replace(row, attempts=attempt)
            ctx = JobContext(this, "w", pool, BlobStore(stack.settings.blob_dir), stack.settings)
            judge = guards.Guards(ctx, progress=Progress(step=4, start_step=4), pause=pause)
            assert await judge.on_metrics(dict(tiny)) is False
            assert await judge.on_metrics(dict(ordinary)) is fires, paused
            assert [p["step"] for p in judge.points] == ([1, 2, 3, 4, 5, 6] if attempt == 2 else [5, 6])
    finally:
        await pool.close()
    assert len(paused) == 1 and "explosion" in paused[0]


@pytest.mark.slow
def test_a_learning_rate_100_times_too_high_pauses_resumably(
    guard_worker: WorkerProcess, tenant: Tenant
) -> None:
    jobs = tenant.client.fine_tuning.jobs
    job = _too_high(tenant, checkpoint_every=1000)
    paused = wait_for(tenant, job.id, ("paused", "succeeded", "failed", "cancelled"), timeout=60)
    seen = [(m["step"], m.get("train_loss"), m.get("grad_norm")) for m in metrics(tenant, job.id)]
    assert paused.status == "paused", seen
    wait_trainer_gone(job.id)
    event = _guard_event(tenant, job.id, GUARD_PAUSED)
    data = event.data or {}
    assert (
        event.level == "warn" and data["guard"] in ("non_finite", "explosion") and data["action"] == "pause"
    )
    assert data["step"] <= 10 and data["signal"] and data["settings"] == _settings(data["guard"])
    ckpts = jobs.checkpoints.list(job.id).data
    assert len(ckpts) == 1 and data["step"] <= ckpts[0].step_number <= data["step"] + 2
    # Resumable: going on is the user's choice, and that guard only warns in later attempts.
    saved = ckpts[0].step_number
    assert jobs.resume(job.id).status == "queued"
    deadline = time.monotonic() + 45
    while max(metrics_steps(tenant, job.id)) <= saved:
        assert time.monotonic() < deadline, "the resumed job did not progress"
        assert jobs.retrieve(job.id).status in ("queued", "running")
        time.sleep(0.3)
    # It runs to its end (40 steps go fast), unless another guard pauses it: never the one that paused it.
    ended = wait_for(tenant, job.id, ("paused", "succeeded", "failed", "cancelled"), timeout=120)
    pauses = [
        (e.data or {}).get("guard") for e in all_events(tenant, job.id) if e.message.startswith(GUARD_PAUSED)
    ]
    assert ended.status in ("succeeded", "paused") and pauses.count(data["guard"]) == 1, (
        ended.status,
        pauses,
    )
    assert (ended.status == "paused") == (len(pauses) == 2), pauses
    warned = [e for e in all_events(tenant, job.id) if e.message.startswith(GUARD_WARNING + " ")]
    assert all((e.data or {})["action"] == "warn" for e in warned)


@pytest.mark.slow
def test_rollback_resumes_from_the_best_validation_checkpoint(
    guard_worker: WorkerProcess, tenant: Tenant
) -> None:
    jobs = tenant.client.fine_tuning.jobs
    rollback = {"action": "rollback"}
    validation = upload_rows(tenant, SFT[:2], "valid.jsonl")
    job = _too_high(tenant, 1, validation, {"non_finite": rollback, "explosion": rollback})
    paused = wait_for(tenant, job.id, ("paused", "succeeded", "failed", "cancelled"), timeout=60)
    seen = [(m["step"], m.get("train_loss"), m.get("grad_norm")) for m in metrics(tenant, job.id)]
    assert paused.status == "paused", seen
    wait_trainer_gone(job.id)
    data = _guard_event(tenant, job.id, GUARD_PAUSED).data or {}
    assert data["action"] == "rollback"
    scored = {
        c.step_number: c.metrics.full_valid_loss
        for c in jobs.checkpoints.list(job.id, limit=100).data
        if c.metrics.full_valid_loss is not None and math.isfinite(c.metrics.full_valid_loss)
    }
    best = min(scored, key=lambda step: scored[step])
    assert data["resume_from_step"] == best and best < max(scored), scored
    # Resumed, it starts from that checkpoint, not the last one.
    assert jobs.resume(job.id).status == "queued"
    started = f"Fine-tuning job started (attempt 2), resuming from step {best}"
    deadline = time.monotonic() + 30
    while started not in [e.message for e in all_events(tenant, job.id)]:
        assert time.monotonic() < deadline, [e.message for e in all_events(tenant, job.id)][:5]
        time.sleep(0.3)
    assert jobs.cancel(job.id).status == "cancelled"


@pytest.mark.slow
def test_a_trainer_that_stops_making_progress_is_paused(guard_worker: WorkerProcess, tenant: Tenant) -> None:
    # The grader's 17th call (the third step's first) sleeps 9 s: no step for longer than the 4 s allowed.
    sleepy = (
        "import time\nCALLS = [0]\n"
        "def grade(sample, item):\n"
        "    CALLS[0] += 1\n"
        "    if CALLS[0] == 17:\n"
        "        time.sleep(9)\n"
        "    return 1.0\n"
    )
    job = _rl_job(tenant, sleepy, {"hang": {"seconds": 4}})
    paused = wait_for(tenant, job.id, ("paused", "succeeded", "failed", "cancelled"), timeout=60)
    assert paused.status == "paused", paused.error
    event = _guard_event(tenant, job.id, GUARD_PAUSED)
    data = event.data or {}
    assert data["guard"] == "hang" and data["settings"] == {"seconds": 4.0} and data["signal"]["idle_s"] > 4
    wait_trainer_gone(job.id)
    assert tenant.client.fine_tuning.jobs.checkpoints.list(job.id).data  # resumable from its last checkpoint


@pytest.mark.slow
def test_a_grader_that_errors_on_a_tenth_of_its_calls(guard_worker: WorkerProcess, tenant: Tenant) -> None:
    flaky = (
        "CALLS = [0]\n"
        "def grade(sample, item):\n"
        "    CALLS[0] += 1\n"
        "    if CALLS[0] % 10 == 0:\n"
        "        raise RuntimeError('grader down')\n"
        "    return 1.0\n"
    )
    job = _rl_job(tenant, flaky, {"length_runaway": {"action": "off"}})
    paused = wait_for(tenant, job.id, ("paused", "succeeded", "failed", "cancelled"), timeout=60)
    assert paused.status == "paused", paused.error
    assert (paused.model_extra or {})["guards"]["explosion"]["min_steps"] == 3  # reinforcement's default
    data = _guard_event(tenant, job.id, GUARD_PAUSED).data or {}
    assert data["guard"] == "error_rate" and data["step"] <= 5
    assert data["signal"]["error_rate"] > 0.05 and len(data["signal"]["rates"]) == 3
    wait_trainer_gone(job.id)


@pytest.mark.slow
def test_a_reward_gameable_by_length(guard_worker: WorkerProcess, tenant: Tenant) -> None:
    # Longer is better: the policy is paid to run into `max_completion_length` (at 20 times the base learning
    # rate it learns that within a few steps; the untrained tiny-chat already hits the limit on most answers).
    longer = "def grade(sample, item):\n    return min(len(sample['output_text']) / 40, 1.0)\n"
    job = _rl_job(
        tenant,
        longer,
        {"length_runaway": {"action": "pause", "steps": 3}},
        steps=30,
        learning_rate_multiplier=20,
        checkpoint_every=1000,
    )
    paused = wait_for(tenant, job.id, ("paused", "succeeded", "failed", "cancelled"), timeout=60)
    seen = [
        (m["step"], m.get("completions/clipped_ratio"), m.get("completion_length_mean"), m.get("reward_mean"))
        for m in metrics(tenant, job.id)
    ]
    assert paused.status == "paused", seen
    data = _guard_event(tenant, job.id, GUARD_PAUSED).data or {}
    assert data["guard"] == "length_runaway" and data["step"] <= 15, seen
    assert len(data["signal"]["clipped_ratio"]) == 3 and min(data["signal"]["clipped_ratio"]) >= 0.9
    wait_trainer_gone(job.id)


@pytest.fixture(scope="module")
def skewed(
    services: Services, tiny_model_dir: Path, venv_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Tenant]:
    """A tenant of a stack of its own (its own database: no other module's worker trains its jobs) whose
    `tiny-chat` folder's `generation_config.json` carries `"min_p": 0.3`, as a model folder may carry its
    publisher's sampling defaults. The trainer's `generate` applies it (TRL's generation settings leave
    `min_p` unset, so the model folder's applies), the loss's log-probabilities do not: the sampler
    truncates the distribution the trainer scores."""
    model = tmp_path_factory.mktemp("skewed-model") / "tiny-chat"
    shutil.copytree(tiny_model_dir, model)
    config = model / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "min_p": 0.3}))
    with ExitStack() as stack:
        database = stack.enter_context(scratch_database(services.pg_dsn, "tunegate_test_skewed"))
        data_dir = tmp_path_factory.mktemp("skewed-data")
        gateway = start_gateway(services, database, model, data_dir, env_venv_dir=venv_dir)
        stack.callback(gateway.stop)
        log = tmp_path_factory.mktemp("skewed-worker") / "worker.log"
        worker = WorkerProcess(gateway.settings, log, TUNEGATE_HEARTBEAT_INTERVAL_S="0.5")
        stack.callback(worker.stop)
        yield admin_of(gateway).tenant("skewed")


SAYS_YES_PY = "def grade(sample, item):\n    return 1.0 if 'yes' in sample['output_text'].lower() else 0.0\n"


def _mismatch(t: Tenant, job_id: str) -> list[tuple[int, float, float]]:
    return [(m["step"], m["mismatch/kl"], m["mismatch/ratio_mean"]) for m in metrics(t, job_id) if m["step"]]


@pytest.mark.slow
def test_a_sampler_that_differs_from_the_trainer(
    skewed: Tenant, guard_worker: WorkerProcess, tenant: Tenant
) -> None:
    # The same job (8 steps, the default guards) on the skewed stack and on the stack's own tiny-chat.
    job = _rl_job(skewed, SAYS_YES_PY, {}, steps=8, checkpoint_every=1000)
    clean = _rl_job(tenant, SAYS_YES_PY, {}, steps=8, checkpoint_every=1000)
    done = wait_for(skewed, job.id, timeout=90)
    seen = _mismatch(skewed, job.id)
    assert done.status == "succeeded", (done.error, seen)
    assert len(seen) == 8 and all(kl > 0.02 and ratio < 1 for _, kl, ratio in seen), seen
    event = _guard_event(skewed, job.id, GUARD_WARNING + " 'sampler_mismatch'")
    data = event.data or {}
    assert event.level == "warn" and data["action"] == "warn" and data["guard"] == "sampler_mismatch"
    assert data["step"] == 3 and data["settings"] == _settings("sampler_mismatch"), data
    signal = data["signal"]
    assert signal["steps"] == [1, 2, 3] and signal["kl"] == [kl for _, kl, _ in seen[:3]]
    assert signal["ratio_mean"] == [r for _, _, r in seen[:3]] and 0 < signal["ratio_min"] < 1
    assert all(d > 0 for d in signal["logprob_diff_mean"])
    # Sampled as the trainer scores: the numbers are rounding away from none, and nothing fires.
    done = wait_for(tenant, clean.id, timeout=90)
    assert done.status == "succeeded", done.error
    seen = _mismatch(tenant, clean.id)
    assert len(seen) == 8 and all(abs(kl) < 1e-4 and abs(ratio - 1) < 1e-4 for _, kl, ratio in seen), seen
    tripped = [
        e.message
        for e in all_events(tenant, clean.id)
        if e.message.startswith((GUARD_WARNING + " ", GUARD_PAUSED))
    ]
    assert tripped == []

"""Jobs from captured episodes that cannot train, refused at create with OpenAI's envelope, through the
official `openai` SDK against a gateway whose engine serves tiny-chat: a selection with no reward difference
in any group (dpo and reinforcement), a negative `max_staleness`, a grader or an environment on a
reinforcement job from capture (its rewards are posted already), a validation file; another organisation's
episodes are 404. A reinforcement job from capture is made without a grader, and estimated without a pilot.

The jobs that train on captured episodes, and what they learn, are in `test_learning.py` (on the same
captured arithmetic traffic as the supervised job from capture); the trainers alone in
`tests/trainer/test_trainer_capture.py`.
"""

from __future__ import annotations

import json
import secrets
from typing import Any, cast

import httpx
import openai
import pytest

from tests.support.capture import capture_on, eventually
from tests.support.data import BASE
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, Tenant

gw = gateway_fixture("capture-training", own_database=True)
"""A database of its own: the job made here is never claimed by another module's worker."""

TASK = [{"role": "user", "content": "What is 2 + 3? Reply with the number only."}]


def _episode(t: Tenant, task_id: str, reward: float) -> str:
    """One captured call in an episode of group `task_id`, closed, and its reward posted."""
    episode: Any = t.client.post("/episodes", body={"metadata": {"task_id": task_id}}, cast_to=object)
    agent = t.client.with_options(api_key=episode["key"])
    agent.chat.completions.create(
        model=BASE, messages=cast(Any, TASK), max_tokens=4, temperature=1.0, seed=len(task_id)
    )
    t.client.post(f"/episodes/{episode['id']}/close", cast_to=object)
    t.client.post(
        f"/episodes/{episode['id']}/rewards", cast_to=object, body={"name": "correct", "value": reward}
    )
    return str(episode["id"])


@pytest.fixture(scope="module")
def same_rewards(gw_admin: Admin) -> tuple[Tenant, list[str]]:
    """An organisation whose two groups of episodes each got one reward for all (nothing to prefer)."""
    t = gw_admin.tenant("same-" + secrets.token_hex(3))
    capture_on(gw_admin, t)
    ids = [_episode(t, "a", 1.0), _episode(t, "a", 1.0), _episode(t, "b", 0.0), _episode(t, "b", 0.0)]

    def exported() -> list[Any] | None:
        resp = t.client.post(
            "/episodes/export", body={"episode_ids": ids, "reward": "correct"}, cast_to=httpx.Response
        )
        rows = [json.loads(line) for line in resp.text.splitlines()]
        return rows if len(rows) == 4 and all(r["reward"] is not None for r in rows) else None

    eventually(exported, "the episodes captured and rewarded")
    return t, ids


def _refused(t: Tenant, status: int = 400, **create: Any) -> dict[str, Any]:
    """The error of a job create that must be refused, as OpenAI's envelope."""
    body = {"model": BASE, **create}
    resp = httpx.post(
        f"{t.client.base_url}fine_tuning/jobs",
        json=body,
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=60,
    )
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    return dict(error)


@pytest.mark.parametrize("kind", ["dpo", "reinforcement"])
def test_no_reward_difference_in_any_group_is_a_400(
    same_rewards: tuple[Tenant, list[str]], kind: str
) -> None:
    t, ids = same_rewards
    capture = {"episode_ids": ids, "reward": "correct", "group_by": "task_id"}
    error = _refused(t, method={"type": kind}, capture=capture)
    assert error["param"] == "capture" and error["code"] == "no_reward_differences", error
    assert "4 samples, 4 of them rewarded" in error["message"]
    # the SDK sees the same
    with pytest.raises(openai.BadRequestError) as raised:
        t.client.fine_tuning.jobs.create(
            model=BASE,
            training_file=cast(Any, openai.omit),  # captured episodes instead
            method=cast(Any, {"type": kind}),
            extra_body={"capture": capture},
        )
    assert raised.value.code == "no_reward_differences"


def test_max_staleness_must_not_be_negative(same_rewards: tuple[Tenant, list[str]]) -> None:
    t, ids = same_rewards
    capture = {"episode_ids": ids, "reward": "correct", "max_staleness": -1}
    error = _refused(t, method={"type": "reinforcement"}, capture=capture)
    assert error["param"] == "capture.max_staleness", error
    export = httpx.post(
        f"{t.client.base_url}episodes/export",
        json=capture,
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=60,
    )
    assert export.status_code == 400 and export.json()["error"]["param"] == "max_staleness", export.text


def test_reinforcement_from_capture_takes_no_grader_nor_validation_file(
    same_rewards: tuple[Tenant, list[str]],
) -> None:
    t, ids = same_rewards
    capture = {"episode_ids": ids, "reward": "correct"}
    grader = {
        "type": "string_check",
        "name": "x",
        "input": "{{ sample.output_text }}",
        "reference": "5",
        "operation": "eq",
    }
    error = _refused(
        t, method={"type": "reinforcement", "reinforcement": {"grader": grader}}, capture=capture
    )
    assert error["param"] == "method.reinforcement.grader" and "rewards already posted" in error["message"]
    # without capture, a reinforcement job still needs one
    error = _refused(t, method={"type": "reinforcement"}, training_file="file-x")
    assert error["param"] == "method.reinforcement.grader"
    error = _refused(t, method={"type": "dpo"}, capture=capture, validation_file="file-x")
    assert error["param"] == "validation_file", error


def test_reinforcement_from_capture_is_made_without_a_grader(gw_admin: Admin) -> None:
    """Two attempts of one task, one right: a job is made (and estimated, with no pilot), its training file
    the two samples with advantages +0.5 and -0.5 and the engine's logprobs."""
    t = gw_admin.tenant("made-" + secrets.token_hex(3))
    capture_on(gw_admin, t)
    ids = [_episode(t, "a", 1.0), _episode(t, "a", 0.0)]
    capture = {"episode_ids": ids, "reward": "correct", "group_by": "task_id"}

    def exported() -> list[Any] | None:
        resp = t.client.post(
            "/episodes/export", body={"episode_ids": ids, "reward": "correct"}, cast_to=httpx.Response
        )
        rows = [json.loads(line) for line in resp.text.splitlines()]
        return rows if len(rows) == 2 and all(r["reward"] is not None for r in rows) else None

    eventually(exported, "the episodes captured and rewarded")
    estimate = httpx.post(
        f"{t.client.base_url}fine_tuning/jobs/estimate",
        json={"model": BASE, "method": {"type": "reinforcement"}, "capture": capture},
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=60,
    )
    assert estimate.status_code == 200, estimate.text
    job = t.client.fine_tuning.jobs.create(
        model=BASE,
        training_file=cast(Any, openai.omit),  # captured episodes instead
        method=cast(Any, {"type": "reinforcement"}),
        extra_body={"capture": capture},
    )
    try:
        assert job.method is not None and job.method.type == "reinforcement"
        assert job.status in ("validating_files", "queued")
        shown = job.method.reinforcement
        assert shown is not None and shown.grader is None
        rows = [json.loads(line) for line in t.client.files.content(job.training_file).text.splitlines()]
        assert sorted(r["advantage"] for r in rows) == [-0.5, 0.5]
        for r in rows:
            sampled = [lp for lp, m in zip(r["logprobs"], r["completion_mask"], strict=True) if m]
            assert sampled and all(isinstance(lp, float) and lp <= 0 for lp in sampled)
    finally:
        t.client.fine_tuning.jobs.cancel(job.id)


def test_another_organisations_episodes_are_404(
    gw_admin: Admin, same_rewards: tuple[Tenant, list[str]]
) -> None:
    _, ids = same_rewards
    other = gw_admin.tenant("other-" + secrets.token_hex(3))
    error = _refused(other, 404, method={"type": "dpo"}, capture={"episode_ids": ids[:1]})
    assert error["param"] == "episode_id", error

"""Learning that shows: each method, through the whole stack with its default hyperparameters, makes
`tiny-chat` measurably better on held-out problems it never trained on.

The problems are the arithmetic example's: single-digit additions asked as "What is 3 + 4? Reply with the
number only.", 70 to train on (`tasks.jsonl`) and 30 held out (`heldout.jsonl`). `tiny-chat` knows its sums
but answers many of them in a sentence, so greedy decoding gets under half of them exactly right (see
`trainer.tinydata`). Held-out exact match is measured on answers served by the gateway (greedy, through the
engine).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Any

import pytest

from tests.support.fixtures import gateway_fixture, worker_fixture
from tests.support.jobs import all_events, metrics, upload_rows, wait_for
from tests.support.stack import Admin, Tenant

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
ARITHMETIC = ROOT / "examples" / "envs" / "arithmetic"


def rows(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (ARITHMETIC / name).read_text().splitlines() if line.strip()]


TRAIN, HELDOUT = rows("tasks.jsonl"), rows("heldout.jsonl")


def question(task: dict[str, Any]) -> str:
    return str(task["messages"][0]["content"])


def sentence(task: dict[str, Any]) -> str:
    return f"The answer is {task['answer']}."


gw = gateway_fixture("learn", own_database=True)
worker = worker_fixture(autouse=True)


@pytest.fixture(scope="module")
def lab(gw_admin: Admin) -> Tenant:
    """An organisation on a gateway, engine and worker with a database of their own."""
    return gw_admin.tenant("learning")


def heldout_exact(t: Tenant, model: str) -> float:
    """Share of held-out problems `model` answers with exactly the number (greedy, served by the gateway)."""
    right = 0
    for task in HELDOUT:
        reply = t.client.chat.completions.create(
            model=model,
            messages=[{"role": "user", "content": question(task)}],
            max_tokens=16,
            temperature=0.0,
        )
        right += (reply.choices[0].message.content or "").strip() == task["answer"]
    return right / len(HELDOUT)


def train(t: Tenant, method: dict[str, Any], training: list[Any], validation: list[Any]) -> Any:
    job = t.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=upload_rows(t, training),
        validation_file=upload_rows(t, validation, "valid.jsonl"),
        method=method,  # type: ignore[arg-type]
        seed=1,
    )
    done = wait_for(t, job.id, ("succeeded", "failed", "cancelled"), timeout=900)
    assert done.status == "succeeded", done.error
    return done


def used_hyperparameters(t: Tenant, job_id: str) -> dict[str, Any]:
    """The hyperparameters the trainer reported using."""
    event = next(e for e in all_events(t, job_id) if e.message.startswith("Hyperparameters: "))
    assert isinstance(event.data, dict)
    return event.data


def readme_block(section: str) -> str:
    """The first python block of a README section."""
    readme = (ROOT / "README.md").read_text()
    return readme.split(section, 1)[1].split("```python\n", 1)[1].split("```", 1)[0]


def readme_example(t: Tenant, tmp_path: Path) -> Any:
    """The README's RL example, run as written (with this tenant's client and the archive in `tmp_path`)."""
    block = readme_block("## With the `openai` SDK")
    setup = 'client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="sk-tg-...")\n'
    assert setup in block and '"arithmetic.tar.gz"' in block
    code = block.replace(setup, "").replace('"arithmetic.tar.gz"', repr(str(tmp_path / "arithmetic.tar.gz")))
    scope: dict[str, Any] = {"client": t.client}
    with contextlib.chdir(ROOT):
        exec(compile(code, "README.md", "exec"), scope)
    return scope["job"]


def test_reinforcement_with_defaults_raises_heldout_exact_match(lab: Tenant, tmp_path: Path) -> None:
    """The README's RL example as written: the arithmetic environment, every hyperparameter "auto".

    Recipe (the defaults tiny-chat ships with): 8 prompts x 8 answers a step, 7 epochs over the 70 tasks
    (64 steps), LoRA r 8 at lr 5e-4, 16 new tokens, temperature 1, partial credit on. Measured over seeds
    0-2: held-out exact went from 43% to 83-93% (+40 to +50 points); the gate is +25.
    """
    created = readme_example(lab, tmp_path)
    job = wait_for(lab, created.id, ("succeeded", "failed", "cancelled"), timeout=900)
    assert job.status == "succeeded", job.error
    shown = job.method.reinforcement.hyperparameters.model_dump()
    used = used_hyperparameters(lab, job.id)
    assert all(shown.get(name) == value for name, value in used.items()), (shown, used)
    points = metrics(lab, job.id)
    assert points[0]["step"] == 0 and "full_valid_reward_mean" in points[0]  # the base model, scored
    assert all(p["reward_mean"] is not None for p in points[1:])
    valid = [p["valid_reward_mean"] for p in points if "valid_reward_mean" in p]
    assert valid[-1] > valid[0]
    base, tuned = heldout_exact(lab, "tiny-chat"), heldout_exact(lab, job.fine_tuned_model)
    assert tuned >= base + 0.25, (base, tuned)
    checkpoints = lab.client.fine_tuning.jobs.checkpoints.list(job.id).data
    assert all("full_valid_reward_mean" in c.metrics.model_dump() for c in checkpoints)
    best = next(e for e in all_events(lab, job.id) if e.message.startswith("Best checkpoint"))
    assert best.data["best_checkpoint_step"] in [c.step_number for c in checkpoints]


def test_supervised_with_defaults_raises_heldout_exact_and_lowers_valid_loss(lab: Tenant) -> None:
    """SFT on the 70 problems answered with the number only, defaults, seed 1.

    Recipe: batch 8, 1 epoch (9 steps), lr 2e-3 (tiny-chat's measured SFT rate). Measured over seeds 0-2:
    held-out exact 43% -> 67-77%; full_valid_loss 0.64 -> 0.22-0.23.
    """

    def chat(task: dict[str, Any]) -> dict[str, Any]:
        return {"messages": [*task["messages"], {"role": "assistant", "content": task["answer"]}]}

    sft = {"type": "supervised", "supervised": {}}
    job = train(lab, sft, [chat(t) for t in TRAIN], [chat(t) for t in HELDOUT])
    points = metrics(lab, job.id)
    first, last = points[0], points[-1]
    assert first["step"] == 0 and last["full_valid_loss"] < first["full_valid_loss"], (first, last)
    assert "valid_mean_token_accuracy" in last
    base, tuned = heldout_exact(lab, "tiny-chat"), heldout_exact(lab, job.fine_tuned_model)
    assert tuned >= base + 0.25, (base, tuned)


def test_dpo_with_defaults_raises_heldout_preference_accuracy(lab: Tenant) -> None:
    """DPO preferring the bare number to a sentence holding it, defaults, seed 1.

    Preference accuracy: the share of held-out pairs whose preferred answer the model finds more likely
    (summed log-probabilities), reported as `full_valid_preference_accuracy` before the first step and at
    the end. Recipe: batch 8, 1 epoch (9 steps), lr 2e-3, beta 0.1. Measured over seeds 0-2: 0.47 -> 0.93-0.97
    (held-out exact 43% -> 57-67%).
    """

    def pair(task: dict[str, Any]) -> dict[str, Any]:
        return {
            "input": {"messages": task["messages"]},
            "preferred_output": [{"role": "assistant", "content": task["answer"]}],
            "non_preferred_output": [{"role": "assistant", "content": sentence(task)}],
        }

    job = train(lab, {"type": "dpo", "dpo": {}}, [pair(t) for t in TRAIN], [pair(t) for t in HELDOUT])
    points = metrics(lab, job.id)
    before, after = points[0]["full_valid_preference_accuracy"], points[-1]["full_valid_preference_accuracy"]
    assert after >= before + 0.25 and after >= 0.8, (before, after)
    assert heldout_exact(lab, job.fine_tuned_model) > heldout_exact(lab, "tiny-chat")


def test_supervised_on_captured_episodes_raises_heldout_exact(gw_admin: Admin) -> None:
    """The README's capture example as written: an agent asks each of the 70 tasks 4 times (sampled, each
    attempt an episode of its own), the arithmetic environment's scorer posts rewards afterwards, and a
    supervised job with default hyperparameters trains on the exact token ids of each task's best answers.

    Measured: 70 best answers (of 280), held-out exact 43% -> 83%; the gate is +20 points.
    """
    t = gw_admin.tenant("learning-capture")
    resp = gw_admin.http.post(f"/v1/admin/organizations/{t.org_id}/capture", json={"enabled": True})
    assert resp.status_code == 200, resp.text
    scope: dict[str, Any] = {"client": t.client}
    with contextlib.chdir(ROOT):
        exec(compile(readme_block("## Learn from your agents' traffic"), "README.md", "exec"), scope)
    best = scope["best"]
    assert best["purpose"] == "fine-tune" and 0 < best["bytes"]
    rows = [json.loads(line) for line in t.client.files.content(best["id"]).text.splitlines()]
    assert rows and all(r["reward"] == 1.0 and sum(r["completion_mask"]) > 0 for r in rows)
    assert {r["metadata"]["task_id"] for r in rows} <= {str(i) for i in range(len(TRAIN))}
    job = wait_for(t, scope["job"].id, ("succeeded", "failed", "cancelled"), timeout=900)
    assert job.status == "succeeded", job.error
    base, tuned = heldout_exact(t, "tiny-chat"), heldout_exact(t, job.fine_tuned_model)
    assert tuned >= base + 0.20, (base, tuned)

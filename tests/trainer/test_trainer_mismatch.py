"""The sampler/trainer mismatch numbers (``trainer.mismatch``) of ``python -m trainer run``, on both of the
paths that sample with ``generate``: TRL's own single-turn generation (a grader) and tunegate's multi-turn
episodes (the guess_number example). With tiny-chat as it is, the sampler draws from the distribution the
loss scores: the numbers are rounding. With ``"min_p": 0.3`` in its folder's ``generation_config.json``
(which both paths' ``generate`` applies and the loss does not), every step shows the gap; a folder's
repetition penalty, which both paths set aside, shows none.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import pytest

from tests.trainer.conftest import make_spec, run_trainer
from tests.trainer.test_trainer_environments import EXAMPLES, rows_of
from tests.trainer.test_trainer_runs import EXACT_GRADER, addition_rows

pytestmark = pytest.mark.slow

HP = {"max_steps": 3, "batch_size": 2, "num_generations": 4, "checkpoint_every": 10}
KEYS = {f"mismatch/{k}" for k in ("kl", "ratio_mean", "ratio_min", "ratio_max", "logprob_diff_mean")} | {
    "mismatch/logprob_diff_max"
}


def _with_generation_config(tiny: Path, tmp: Path, **settings: Any) -> Path:
    """A copy of tiny-chat whose folder's `generation_config.json` carries `settings`."""
    model = tmp / ("tiny-" + "-".join(settings))
    shutil.copytree(tiny, model)
    config = model / "generation_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), **settings}))
    return model


def _mismatch(tmp: Path, model: Path, multi_turn: bool) -> list[dict[str, Any]]:
    tmp.mkdir()
    if multi_turn:
        spec = make_spec(
            tmp,
            model,
            "reinforcement",
            rows_of("guess_number"),
            hyperparameters={**HP, "max_completion_length": 40},
            environment={"package_dir": str(EXAMPLES / "guess_number"), "config": {}},
        )
    else:
        spec = make_spec(
            tmp,
            model,
            "reinforcement",
            addition_rows(),
            grader=EXACT_GRADER,
            hyperparameters={**HP, "max_completion_length": 8},
        )
    job = run_trainer(spec)
    assert job.rc == 0, job.stderr[-3000:]
    data = [m["data"] for m in job.of("metrics")]
    assert len(data) == 3 and all(KEYS <= set(d) for d in data), data
    return [{k.removeprefix("mismatch/"): d[k] for k in KEYS} for d in data]


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_the_sampler_and_the_trainer_compared(tiny: Path, tmp_path: Path, multi_turn: bool) -> None:
    for step in _mismatch(tmp_path / "clean", tiny, multi_turn):
        assert abs(step["kl"]) < 1e-4 and abs(step["ratio_mean"] - 1) < 1e-4, step
        assert step["logprob_diff_max"] < 1e-3 and step["ratio_min"] <= 1 <= step["ratio_max"], step
    for step in _mismatch(tmp_path / "min_p", _with_generation_config(tiny, tmp_path, min_p=0.3), multi_turn):
        # min_p only removes tokens: the sampler's probabilities of what it draws are higher than the
        # trainer's, so every ratio is at most 1 and the KL is the mean log-probability gap.
        assert step["kl"] > 0.01 and step["ratio_mean"] < 0.99 and step["ratio_max"] <= 1 + 1e-4, step
        assert step["kl"] == pytest.approx(step["logprob_diff_mean"], rel=1e-3), step


@pytest.mark.parametrize("multi_turn", [False, True], ids=["single-turn", "multi-turn"])
def test_a_folders_repetition_penalty_does_not_reach_the_sampler(
    tiny: Path, tmp_path: Path, multi_turn: bool
) -> None:
    """Both samplers set the repetition penalty the loss assumes (none), whatever the model's folder says."""
    model = _with_generation_config(tiny, tmp_path, repetition_penalty=3.0)
    for step in _mismatch(tmp_path / "penalty", model, multi_turn):
        assert abs(step["kl"]) < 1e-4 and abs(step["ratio_mean"] - 1) < 1e-4, step

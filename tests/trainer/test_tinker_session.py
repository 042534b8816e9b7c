"""The Tinker training process on its own: its losses, and its requests through `serve` on tiny-chat."""

from __future__ import annotations

import io
import json
import math
from pathlib import Path

import pytest
import torch

from trainer.tinker_losses import LossInputError, per_token_loss
from trainer.tinker_session import serve
from trainer.tiny import shipped_model_dir


def test_the_losses_follow_tinkers_formulas() -> None:
    new = torch.tensor([-1.0, -2.0])
    old = torch.tensor([-1.5, -1.0])
    adv = torch.tensor([1.0, -1.0])
    ratio = torch.exp(new - old)
    inputs = {"logprobs": old, "advantages": adv}
    assert torch.allclose(per_token_loss("cross_entropy", new, {"weights": torch.tensor([1.0, 0.5])}, {}),
                          torch.tensor([1.0, 1.0]))  # fmt: skip
    assert torch.allclose(per_token_loss("importance_sampling", new, inputs, {}), -ratio * adv)
    clipped = torch.clamp(ratio, 0.8, 1.2)
    assert torch.allclose(per_token_loss("ppo", new, inputs, {}), -torch.minimum(ratio * adv, clipped * adv))
    assert torch.allclose(per_token_loss("cispo", new, inputs, {}), -clipped * new * adv)
    assert torch.allclose(
        per_token_loss("dro", new, inputs, {"beta": 0.1}), -(new * adv - 0.05 * (new - old) ** 2)
    )
    with pytest.raises(LossInputError, match="needs the loss_fn_input 'advantages'"):
        per_token_loss("ppo", new, {"logprobs": old}, {})
    with pytest.raises(LossInputError, match="not supported"):
        per_token_loss("stable_reinforce", new, inputs, {})


def _run(requests: list[dict]) -> list[dict]:
    out = io.StringIO()
    serve(io.StringIO("".join(json.dumps(r) + "\n" for r in requests)), out)
    return [json.loads(line) for line in out.getvalue().splitlines()]


def test_a_session_trains_saves_and_resumes(tmp_path: Path) -> None:
    datum = {"tokens": [5, 17, 42, 9], "inputs": {"target_tokens": [17, 42, 9, 33]}}
    fb = {"op": "forward_backward", "loss_fn": "cross_entropy", "data": [datum]}
    fwd = {**fb, "forward_only": True}
    replies = _run(
        [
            {"op": "init", "base_path": str(shipped_model_dir()), "rank": 4, "seed": 0},
            fwd,
            fb,
            {"op": "optim_step", "learning_rate": 0.02},
            fwd,
            {"op": "load_state", "dir": str(tmp_path / "missing"), "optimizer": False},
            {"op": "save_state", "dir": str(tmp_path / "stepped"), "optimizer": True},
            {"op": "forward_backward", "loss_fn": "hinge", "data": [datum]},
        ]
    )
    assert all(r["ok"] for r in replies[:5]), replies
    before, after = (replies[i]["result"]["metrics"]["loss:sum"] for i in (1, 4))
    assert after < before
    assert replies[5] == {"ok": False, "error": replies[5]["error"], "category": "user"}
    assert replies[6]["ok"] and (tmp_path / "stepped" / "optimizer.pt").exists()
    assert replies[7]["category"] == "user" and "Unknown loss function 'hinge'" in replies[7]["error"]

    # a model let go before any optim step has no optimizer state: its resume loads the weights alone
    fresh = _run(
        [
            {"op": "init", "base_path": str(shipped_model_dir()), "rank": 4, "seed": 0},
            {"op": "save_state", "dir": str(tmp_path / "idle"), "optimizer": True},
            {"op": "load_state", "dir": str(tmp_path / "idle"), "optimizer": "if_saved"},
            {"op": "load_state", "dir": str(tmp_path / "idle"), "optimizer": True},
            {"op": "load_state", "dir": str(tmp_path / "stepped"), "optimizer": True},
            fwd,
        ]
    )
    assert [r["ok"] for r in fresh] == [True, True, True, False, True, True]
    assert "without optimizer state" in fresh[3]["error"]
    assert math.isclose(fresh[5]["result"]["metrics"]["loss:sum"], after, rel_tol=1e-5)

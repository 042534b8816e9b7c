"""Training on captured episodes' token ids, as ``python -m trainer run`` does it: preference pairs of sampled
ids (``trainer.token_dpo``) and logged episodes trained offline with their sampler's logprobs
(``trainer.offline_rl``). The rows are made here as a capture export makes them, with the tiny model's own
tokenizer and log-probabilities standing in for the engine's."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.trainer.conftest import lora_tensors, make_spec, run_trainer
from trainer.offline_rl import OfflineRLConfig, collate, loss_inputs
from trainer.tinker_losses import per_token_loss


def _sampled_rows(tiny: Path) -> list[dict[str, Any]]:
    """Four questions, two answers each (the bare number rewarded 1, a sentence 0): samples with the ids
    of the chat template's prompt and the answer, the answer's tokens marked, and the model's own logprobs
    of them as the sampler would have logged them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tiny))
    model = AutoModelForCausalLM.from_pretrained(str(tiny), dtype=torch.float32)
    rows = []
    for i, (a, b) in enumerate([(2, 3), (4, 1), (3, 3), (5, 2)]):
        text = tok.apply_chat_template(
            [{"role": "user", "content": f"What is {a} + {b}? Reply with the number only."}],
            add_generation_prompt=True,
            tokenize=False,
        )
        prompt = list(tok(text, add_special_tokens=False)["input_ids"])
        for answer, reward in ((str(a + b), 1.0), (f"The answer is {a + b}.", 0.0)):
            completion = tok(answer, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = prompt + completion
            with torch.no_grad():
                logits = model(input_ids=torch.tensor([ids])).logits[0, :-1]
            lps = torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
            logprobs: list[float | None] = [None] * len(prompt) + [float(x) for x in lps[len(prompt) - 1 :]]
            rows.append(
                {
                    "input_ids": ids,
                    "completion_mask": [0] * len(prompt) + [1] * len(completion),
                    "logprobs": logprobs,
                    "reward": reward,
                    "advantage": reward - 0.5,
                    "metadata": {"task_id": str(i)},
                }
            )
    return rows


def test_loss_inputs_are_the_logged_logprobs_on_sampled_tokens() -> None:
    rows = [
        {
            "input_ids": [5, 6, 7, 8],
            "completion_mask": [0, 0, 1, 1],
            "logprobs": [0.0, 0.0, -0.5, -1.25],
            "advantage": 0.75,
            "reward": 1.0,
        },
        {
            "input_ids": [5, 9, 4],
            "completion_mask": [0, 1, 1],
            "logprobs": [0.0, -2.0, -0.125],
            "advantage": -0.75,
            "reward": 0.0,
        },
    ]
    batch = collate(rows, pad_token_id=0)
    inputs, mask = loss_inputs(batch)
    # Position t predicts token t+1: the logged logprob of each sampled token, the advantage on it.
    assert mask.tolist() == [[0, 1, 1], [1, 1, 0]]
    assert inputs["logprobs"].tolist() == [[0.0, -0.5, -1.25], [-2.0, -0.125, 0.0]]
    assert inputs["advantages"].tolist() == [[0.0, 0.75, 0.75], [-0.75, -0.75, 0.0]]
    # Tinker's ppo at the logged policy: ratio 1, loss -A; past the clip range the gain stops.
    import torch

    same = per_token_loss("ppo", inputs["logprobs"], inputs, OfflineRLConfig().loss_config)
    assert torch.allclose(same * mask, -inputs["advantages"])
    # A ratio of e: clipped to 1.2 where it would gain (A > 0), kept whole where it loses (A < 0).
    far = per_token_loss("ppo", inputs["logprobs"] + 1.0, inputs, OfflineRLConfig().loss_config)
    adv = inputs["advantages"]
    assert torch.allclose(far * mask, torch.where(adv > 0, -1.2 * adv, -torch.e * adv) * mask)


@pytest.mark.slow
def test_offline_reinforcement_on_logged_episodes(tiny: Path, tmp_path: Path) -> None:
    """No grader, no environment: the rows carry rewards and logprobs. At the first step the trainer's
    logprobs equal the logged ones (the rows were logged by this very model); the adapter moves, the
    bare numbers gain on the sentences, and the events are a reinforcement job's."""
    rows = _sampled_rows(tiny)
    hp = {"n_epochs": 4, "batch_size": 4, "learning_rate": 0.002, "checkpoint_every": 4}
    job = run_trainer(make_spec(tmp_path, tiny, "reinforcement", rows, hyperparameters=hp))
    assert job.rc == 0, job.stderr[-3000:]
    metrics = [m["data"] for m in job.of("metrics")]
    assert [m["step"] for m in metrics] == list(range(1, 9))  # 8 samples / 4 a step x 4 epochs
    first = metrics[0]
    assert first["mismatch/logprob_diff_mean"] < 1e-4 and abs(first["ratio_mean"] - 1) < 1e-4, first
    assert first["reward_mean"] == pytest.approx(0.5) and first["advantage_abs_mean"] == pytest.approx(0.5)
    assert all(isinstance(m["train_loss"], float) and m["tokens"] > 0 for m in metrics)
    assert metrics[-1]["mismatch/logprob_diff_mean"] > 0  # the policy moved away from the logged one
    assert [c["step"] for c in job.of("checkpoint")] == [4, 8]
    (result,) = job.of("result")
    tensors = lora_tensors(Path(result["adapter_path"]))
    assert all(float(t.abs().max()) > 0 for name, t in tensors.items() if "lora_B" in name)


@pytest.mark.slow
def test_offline_reinforcement_reads_the_logged_logprobs(tiny: Path, tmp_path: Path) -> None:
    """Logged logprobs shifted by 0.5 are what the ratio is taken against: the first step's mean
    |new - logged| is 0.5, and every sampled token's ratio is outside PPO's clip range."""
    rows = _sampled_rows(tiny)
    for r in rows:
        r["logprobs"] = [None if lp is None else lp - 0.5 for lp in r["logprobs"]]
    hp = {"n_epochs": 1, "batch_size": 8, "learning_rate": 0.002}
    job = run_trainer(make_spec(tmp_path, tiny, "reinforcement", rows, hyperparameters=hp))
    assert job.rc == 0, job.stderr[-3000:]
    (first,) = [m["data"] for m in job.of("metrics")]
    assert first["mismatch/logprob_diff_mean"] == pytest.approx(0.5, abs=1e-4)
    assert first["clip_fraction"] == pytest.approx(1.0)


@pytest.mark.slow
def test_dpo_on_pairs_of_sampled_ids(tiny: Path, tmp_path: Path) -> None:
    """Pairs of ids (what a dpo job from captured episodes gets): the chosen continuations gain on the
    rejected ones, the loss only on the masked tokens."""
    rows = _sampled_rows(tiny)
    pairs = []
    for good, bad in zip(rows[::2], rows[1::2], strict=True):
        n = good["completion_mask"].index(1)
        pairs.append(
            {
                "prompt_ids": good["input_ids"][:n],
                "chosen_ids": good["input_ids"][n:],
                "rejected_ids": bad["input_ids"][n:],
                "chosen_mask": good["completion_mask"][n:],
                "rejected_mask": bad["completion_mask"][n:],
            }
        )
    hp = {"n_epochs": 2, "batch_size": 2, "learning_rate": 0.01, "checkpoint_every": 2, "beta": 0.1}
    job = run_trainer(make_spec(tmp_path, tiny, "dpo", pairs, hyperparameters=hp))
    assert job.rc == 0, job.stderr[-3000:]
    metrics = [m["data"] for m in job.of("metrics")]
    assert len(metrics) == 4 and metrics[-1]["rewards/margins"] > 0
    (result,) = job.of("result")
    assert any(float(t.abs().max()) > 0 for n, t in lora_tensors(Path(result["adapter_path"])).items())

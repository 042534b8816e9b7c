"""The tiny offline chat model: tokenizer, chat template, generation, determinism."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest

from trainer.tiny import SPECIAL_TOKENS, make_tiny_model, qwen2_5_chat_template


def test_tokenizer_round_trips_and_knows_special_tokens(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    text = "Hello world! Order 48213 costs 37.50 euros.\n  Done?"
    ids = tok(text)["input_ids"]
    assert tok.decode(ids) == text
    assert 900 <= len(tok) <= 1024  # the recipe's vocab_size is a ceiling: BPE stops when no pair repeats
    assert [tok.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == [0, 1, 2, 3, 4]
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.padding_side == "left"
    assert tok("<tool_call>")["input_ids"] == [3]
    assert tok.tokenize("12345") == ["1", "2", "3", "4", "5"]  # digits one by one, as Qwen2 splits them


def test_chat_template_is_qwen2_5_chatml(tiny: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    assert tok.chat_template == qwen2_5_chat_template()
    text = tok.apply_chat_template(
        [{"role": "system", "content": "S"}, {"role": "user", "content": "Hi"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"


def test_model_generates_and_config_is_tiny(tiny: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny)
    cfg = model.config
    assert cfg.architectures == ["Qwen2ForCausalLM"]
    assert (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (
        128,
        4,
        2,
        4,
    )
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    assert cfg.head_dim == 32 and cfg.tie_word_embeddings and cfg.vocab_size == len(tok)
    assert cfg.eos_token_id == tok.eos_token_id and cfg.pad_token_id == tok.pad_token_id
    enc: Any = tok.apply_chat_template(
        [{"role": "user", "content": "Hello!"}],
        add_generation_prompt=True,
        return_tensors="pt",
        return_dict=True,
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    new = out[0, enc["input_ids"].shape[1] :]
    assert 1 <= len(new) <= 12
    # Fitted to the corpus, the model greets back in chat format and closes its turn.
    assert str(tok.decode(new, skip_special_tokens=True)).strip()
    assert tok.eos_token_id in new.tolist()


def test_make_tiny_is_deterministic_and_idempotent(tiny: Path, tmp_path: Path) -> None:
    again = make_tiny_model(tmp_path / "again", seed=0)
    assert (again / "model.safetensors").read_bytes() == (tiny / "model.safetensors").read_bytes()
    assert (again / "tokenizer.json").read_bytes() == (tiny / "tokenizer.json").read_bytes()
    mtime = (again / "model.safetensors").stat().st_mtime_ns
    started = time.monotonic()
    assert make_tiny_model(again) == again
    assert time.monotonic() - started < 0.5
    assert (again / "model.safetensors").stat().st_mtime_ns == mtime


@pytest.mark.parametrize("seed", [1])
def test_other_seed_other_weights(tiny: Path, tmp_path: Path, seed: int) -> None:
    other = make_tiny_model(tmp_path / "other", seed=seed, steps=0)
    assert (other / "model.safetensors").read_bytes() != (tiny / "model.safetensors").read_bytes()


def test_shipped_weights_answer_some_sums_exactly(tiny: Path) -> None:
    """The stated quality of the shipped model: competent but imperfect on the arithmetic example (10-50% of
    the 30 held-out problems answered exactly under greedy decoding)."""
    from trainer.tiny import addition_exact
    from trainer.tinydata import heldout_split

    recipe = json.loads((tiny / "recipe.json").read_text())
    assert addition_exact(tiny) == recipe["addition_greedy_exact"]
    heldout = addition_exact(tiny, heldout_split()[1])
    assert heldout == recipe["heldout_greedy_exact"]
    assert 0.1 <= heldout <= 0.5


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_the_recipe_still_makes_a_model_of_the_stated_quality(tmp_path: Path) -> None:
    """`python -m trainer make-tiny --from-scratch` (the script that made the shipped weights) still makes a
    model that answers 10-70% of the held-out single-digit sums exactly under greedy decoding (the shipped
    one: see its recipe.json). The same recipe lands at different points of that band on different CPUs (the
    order of float sums differs): 43% on the machine that made the shipped weights, 57% on another."""
    import subprocess
    import sys

    out = tmp_path / "rebuilt"
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "make-tiny", "--from-scratch", str(out)],
        capture_output=True,
        text=True,
        timeout=1800,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    recipe = json.loads((out / "recipe.json").read_text())
    assert 0.1 <= recipe["heldout_greedy_exact"] <= 0.7, recipe

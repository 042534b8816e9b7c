"""A tiny Qwen2-style chat model made offline, for tests, the CPU quickstart and the default base model.

Nothing is downloaded: a byte-level BPE tokenizer is trained on the corpus shipped in ``trainer/data``,
wrapped as a fast tokenizer carrying the exact Qwen2.5 chat template (TRL recognises templates by their
text, so tool-calling code paths work), and a randomly initialised ``Qwen2ForCausalLM`` of about 100k
parameters, fitted for a moment to the same corpus so it answers in chat format, is saved beside it. The
result is deterministic for a seed and takes a few seconds to build.

    make_tiny_model("/tmp/tiny-chat")        # -> Path("/tmp/tiny-chat")
    python -m trainer make-tiny /tmp/tiny-chat
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from importlib import resources
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

VOCAB_SIZE = 1024
"""Size of the trained BPE vocabulary, special tokens included."""

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
"""Special tokens, in id order (ids 0..4)."""

PRETRAIN_STEPS = 120
"""Default next-token steps on the corpus after initialisation (0 leaves the weights random)."""
PRETRAIN_BATCH = 16
PRETRAIN_SEQ_LEN = 64
PRETRAIN_LR = 6e-3

CORPUS_RESOURCE = "corpus.txt"
"""Name of the shipped tokenizer corpus inside ``trainer/data``."""


_EXTRA_CONFIG: dict[str, Any] = {"head_dim": 32}
"""Config fields Qwen2Config takes through ``**kwargs`` (head dim 32 keeps the model loadable by vLLM)."""


def corpus_path() -> Path:
    """Path of the plain-text corpus the tokenizer is trained on."""
    return Path(str(resources.files("trainer").joinpath("data", CORPUS_RESOURCE)))


def qwen2_5_chat_template() -> str:
    """The exact Qwen2.5 chat template text, as TRL ships it (TRL matches templates by identity)."""
    import trl

    path = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    return path.read_text(encoding="utf-8")


def build_tokenizer():  # -> transformers.PreTrainedTokenizerFast (kept untyped: heavy import)
    """Train the byte-level BPE tokenizer on the shipped corpus and wrap it for transformers."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    text = corpus_path().read_text(encoding="utf-8")
    # One paragraph per line keeps the byte-pair counts (and so the merges) independent of batching.
    tok.train_from_iterator(text.splitlines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
        padding_side="left",
        model_max_length=2048,
    )
    fast.chat_template = qwen2_5_chat_template()
    return fast


def pretrain(model: Any, tokenizer: Any, *, steps: int, seed: int) -> float:
    """Fit the model to the shipped corpus for a few steps; returns the last loss.

    A few steps of next-token training turn random weights into a model that answers in the corpus's chat
    format and ends its turns with ``<|im_end|>``: enough for a quickstart to show sensible text and for
    reinforcement tests to have rewards that move. One thread and a private generator keep it deterministic.
    """
    import torch

    ids = torch.tensor(tokenizer.backend_tokenizer.encode(corpus_path().read_text(encoding="utf-8")).ids)
    gen = torch.Generator().manual_seed(seed)
    optim = torch.optim.AdamW(model.parameters(), lr=PRETRAIN_LR, weight_decay=0.0)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    loss = float("nan")
    try:
        model.train()
        for _ in range(steps):
            starts = torch.randint(0, len(ids) - PRETRAIN_SEQ_LEN - 1, (PRETRAIN_BATCH,), generator=gen)
            batch = torch.stack([ids[i : i + PRETRAIN_SEQ_LEN] for i in starts.tolist()])
            out = model(input_ids=batch, labels=batch)
            out.loss.backward()
            optim.step()
            optim.zero_grad(set_to_none=True)
            loss = out.loss.item()
    finally:
        torch.set_num_threads(threads)
        model.eval()
    return loss


def make_tiny_model(out_dir: str | Path, *, seed: int = 0, pretrain_steps: int = PRETRAIN_STEPS) -> Path:
    """Build the tiny chat model into ``out_dir`` and return it; a folder with ``config.json`` is kept as is.

    The folder is a normal Hugging Face checkpoint: ``config.json`` (``Qwen2ForCausalLM``),
    ``model.safetensors``, ``generation_config.json`` and the tokenizer files with the chat template.
    """
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    tokenizer = build_tokenizer()
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=64,
        num_attention_heads=2,
        num_key_value_heads=1,
        **_EXTRA_CONFIG,
        num_hidden_layers=2,
        intermediate_size=128,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # Initialise under a private RNG state so building the model does not disturb the caller's seeds.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
    loss = pretrain(model, tokenizer, steps=pretrain_steps, seed=seed) if pretrain_steps > 0 else float("nan")
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, max_new_tokens=64
    )
    # Written beside the target and moved in one step, so a folder with config.json is always complete.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    n_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "Built tiny chat model (%d parameters, vocab %d, corpus loss %.3f) in %s",
        n_params,
        len(tokenizer),
        loss,
        out,
    )
    return out

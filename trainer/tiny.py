"""`tiny-chat`: a small Qwen2-style chat model made offline, the default base model of tests and quickstart.

Nothing is downloaded. A byte-level BPE tokenizer (digits split one by one, as Qwen2's are) is trained on the
corpus shipped in ``trainer/data`` plus a sample of the synthetic chats of :mod:`trainer.tinydata`, wrapped
as a fast tokenizer carrying the exact Qwen2.5 chat template (TRL recognises templates by their text, so
tool-calling code paths work). A ``Qwen2ForCausalLM`` of about a million parameters is then fitted with the
loss on the assistant's answers of those chats, plus plain next-token windows of the corpus.

The result answers in chat format and knows its single-digit sums, but often answers them in a sentence
where the arithmetic example asks for the number only (see :mod:`trainer.tinydata`): about one problem in
five is exactly right under greedy decoding, which leaves reinforcement learning a signal to climb.

Building takes a few minutes on two cores, so the weights are shipped in ``trainer/data/tiny-chat`` (with
``recipe.json``: the recipe and the quality it measured) and :func:`make_tiny_model` copies them. They are
made by this module and nothing else::

    python -m trainer make-tiny --from-scratch trainer/data/tiny-chat

    make_tiny_model("/tmp/tiny-chat")              # the shipped weights, copied
    make_tiny_model("/tmp/x", seed=1)              # built from scratch with another seed
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass
from importlib import resources
from pathlib import Path
from typing import Any

from trainer.contract import DEFAULTS_FILE

logger = logging.getLogger(__name__)

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool_call>", "</tool_call>"]
"""Special tokens, in id order (ids 0..4)."""

CORPUS_RESOURCE = "corpus.txt"
"""Name of the shipped plain-text corpus inside ``trainer/data``."""
SHIPPED_RESOURCE = "tiny-chat"
"""Folder of the shipped weights inside ``trainer/data``."""
TRAINING_DEFAULTS: dict[str, Any] = {
    "learning_rates": {"supervised": 2e-3, "dpo": 2e-3, "reinforcement": 5e-4},
    "hyperparameters": {
        "reinforcement": {"batch_size": 8, "num_generations": 8, "max_completion_length": 16, "min_steps": 60}
    },
}
"""What "auto" means for `tiny-chat` (``tunegate_defaults.json``, see ``trainer.contract``), measured on
it."""
MODEL_FILES = (
    "config.json",
    "tunegate_defaults.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",
    "recipe.json",
)
"""The files of a built model folder (``recipe.json`` records how it was made and what it measured)."""


@dataclass(frozen=True)
class TinyRecipe:
    """How `tiny-chat` is made. The defaults made the shipped weights."""

    seed: int = 0
    """Seeds the weights' initialisation and the order and content of the fitted data."""
    vocab_size: int = 1024
    """Size of the trained BPE vocabulary, special tokens included."""
    hidden_size: int = 128
    """Width of the residual stream."""
    num_hidden_layers: int = 4
    """Transformer blocks."""
    num_attention_heads: int = 4
    """Query heads (head dim 32, which keeps the model loadable by vLLM)."""
    num_key_value_heads: int = 2
    """Key/value heads (grouped-query attention, as Qwen2)."""
    intermediate_size: int = 512
    """Width of each block's MLP."""
    steps: int = 900
    """Optimiser steps of fitting (0 leaves the weights random)."""
    batch_size: int = 32
    """Sequences per step."""
    learning_rate: float = 3e-3
    """Peak AdamW learning rate (linear warm-up, then linear decay to 0)."""
    warmup_steps: int = 30
    """Steps of linear warm-up."""
    corpus_share: float = 0.15
    """Share of the sequences that are plain next-token windows of the corpus (the rest are chats)."""
    corpus_window: int = 64
    """Tokens in one corpus window."""


def corpus_path() -> Path:
    """Path of the plain-text corpus shipped with the trainer."""
    return Path(str(resources.files("trainer").joinpath("data", CORPUS_RESOURCE)))


def shipped_model_dir() -> Path:
    """Folder of the shipped `tiny-chat` weights (made by ``make-tiny --from-scratch``)."""
    return Path(str(resources.files("trainer").joinpath("data", SHIPPED_RESOURCE)))


def qwen2_5_chat_template() -> str:
    """The exact Qwen2.5 chat template text, as TRL ships it (TRL matches templates by identity)."""
    import trl

    path = Path(trl.__file__).parent / "chat_templates" / "qwen2_5.jinja"
    return path.read_text(encoding="utf-8")


def _render(tokenizer: Any, messages: list[dict[str, str]]) -> tuple[str, str]:
    """A chat as (prompt text up to the assistant's turn, the assistant's answer closed by <|im_end|>)."""
    prompt = tokenizer.apply_chat_template(messages[:-1], tokenize=False, add_generation_prompt=True)
    return prompt, messages[-1]["content"] + "<|im_end|>"


def build_tokenizer(recipe: TinyRecipe = TinyRecipe()):  # -> transformers.PreTrainedTokenizerFast
    """Train the byte-level BPE tokenizer on the corpus and a sample of chats, wrapped for transformers."""
    import random

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    from trainer.tinydata import chat

    tok = Tokenizer(models.BPE())
    # Digits one by one (as Qwen2 splits them): a number's tokens are its digits, whatever its size.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=recipe.vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )

    def wrapped() -> PreTrainedTokenizerFast:
        """`tok` as transformers sees it: special tokens, left padding, the chat template."""
        return PreTrainedTokenizerFast(
            tokenizer_object=tok,
            bos_token=None,
            eos_token="<|im_end|>",
            pad_token="<|endoftext|>",
            additional_special_tokens=SPECIAL_TOKENS[1:2] + SPECIAL_TOKENS[3:],
            padding_side="left",
            model_max_length=2048,
            chat_template=qwen2_5_chat_template(),
        )

    # Chats are rendered through the template before training so that its own text gets merges too.
    fast = wrapped()
    rng = random.Random(recipe.seed)
    lines = corpus_path().read_text(encoding="utf-8").splitlines()
    for _ in range(2000):  # the template's own text (its default system prompt) gets merges too
        lines.extend("".join(_render(fast, chat(rng))).splitlines())
    # One line at a time keeps the byte-pair counts (and so the merges) independent of batching.
    tok.train_from_iterator(lines, trainer=trainer)
    return wrapped()


def fit(model: Any, tokenizer: Any, recipe: TinyRecipe) -> float:
    """Fit the model to the chats (loss on the answers) and corpus windows; returns the last loss."""
    import random

    import torch

    from trainer.tinydata import chats

    rng = random.Random(recipe.seed + 1)
    stream = chats(recipe.seed)
    corpus = tokenizer.backend_tokenizer.encode(corpus_path().read_text(encoding="utf-8")).ids
    pad = tokenizer.pad_token_id
    optim = torch.optim.AdamW(model.parameters(), lr=recipe.learning_rate, weight_decay=0.0)

    def factor(step: int) -> float:
        return min(1.0, (step + 1) / recipe.warmup_steps) * max(0.0, 1.0 - step / recipe.steps)

    schedule = torch.optim.lr_scheduler.LambdaLR(optim, factor)
    loss = float("nan")
    model.train()
    try:
        for step in range(recipe.steps):
            rows: list[tuple[list[int], list[int]]] = []  # (ids, labels)
            for _ in range(recipe.batch_size):
                if rng.random() < recipe.corpus_share:
                    start = rng.randrange(len(corpus) - recipe.corpus_window)
                    window = corpus[start : start + recipe.corpus_window]
                    rows.append((window, window))
                else:
                    prompt, answer = _render(tokenizer, next(stream))
                    p_ids, a_ids = tokenizer(prompt)["input_ids"], tokenizer(answer)["input_ids"]
                    rows.append((p_ids + a_ids, [-100] * len(p_ids) + a_ids))
            length = max(len(ids) for ids, _ in rows)
            ids = torch.full((len(rows), length), pad)
            labels = torch.full((len(rows), length), -100)
            mask = torch.zeros((len(rows), length), dtype=torch.long)
            for i, (row_ids, row_labels) in enumerate(rows):
                ids[i, : len(row_ids)] = torch.tensor(row_ids)
                labels[i, : len(row_labels)] = torch.tensor(row_labels)
                mask[i, : len(row_ids)] = 1
            logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
            targets = labels[:, 1:]
            token_loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]), targets.reshape(-1), reduction="none", ignore_index=-100
            ).view(targets.shape)
            counted = (targets != -100).sum(dim=1).clamp(min=1)
            # Each sequence weighs the same, however many of its tokens carry loss: a corpus window's 64
            # tokens would otherwise outweigh the few tokens of a chat's answer.
            batch_loss = ((token_loss * (targets != -100)).sum(dim=1) / counted).mean()
            batch_loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optim.step()
            schedule.step()
            optim.zero_grad(set_to_none=True)
            loss = batch_loss.item()
            if step % 100 == 0 or step == recipe.steps - 1:
                logger.info("fitting tiny-chat: step %d/%d, loss %.3f", step + 1, recipe.steps, loss)
    finally:
        model.eval()
    return loss


def addition_exact(
    model_dir: str | Path, pairs: list[tuple[int, int]] | None = None, *, adapter: str | Path | None = None
) -> float:
    """Greedy exact-match rate of a model folder (with a LoRA ``adapter`` on it) on single-digit additions
    asked as the arithmetic example asks them."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from trainer.tinydata import ADDITION_PROMPT, addition_pairs

    pairs = pairs or addition_pairs()
    tok = AutoTokenizer.from_pretrained(model_dir)
    tok.padding_side = "left"
    model: Any = AutoModelForCausalLM.from_pretrained(model_dir)
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(adapter))
    model.eval()
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": ADDITION_PROMPT.format(a=a, b=b)}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for a, b in pairs
    ]
    enc = tok(prompts, return_tensors="pt", padding=True)
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=12, do_sample=False)
    answers = tok.batch_decode(out[:, enc["input_ids"].shape[1] :], skip_special_tokens=True)
    return sum(text.strip() == str(a + b) for text, (a, b) in zip(answers, pairs, strict=True)) / len(pairs)


def build_tiny_model(out_dir: str | Path, recipe: TinyRecipe = TinyRecipe()) -> Path:
    """Build `tiny-chat` from nothing into ``out_dir`` (replacing what is there) and return it."""
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    from trainer.tinydata import heldout_split

    started = time.monotonic()
    out = Path(out_dir)
    tokenizer = build_tokenizer(recipe)
    pad_id = tokenizer.convert_tokens_to_ids("<|endoftext|>")
    eos_id = tokenizer.convert_tokens_to_ids("<|im_end|>")
    config = Qwen2Config(  # type: ignore[call-arg]  # head_dim is taken through **kwargs
        vocab_size=len(tokenizer),
        hidden_size=recipe.hidden_size,
        num_attention_heads=recipe.num_attention_heads,
        num_key_value_heads=recipe.num_key_value_heads,
        head_dim=recipe.hidden_size // recipe.num_attention_heads,
        num_hidden_layers=recipe.num_hidden_layers,
        intermediate_size=recipe.intermediate_size,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        architectures=["Qwen2ForCausalLM"],
        bos_token_id=pad_id,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        dtype="float32",
    )
    # Initialise and fit under a private RNG state so building does not disturb the caller's seeds.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(recipe.seed)
        model = Qwen2ForCausalLM(config)
        loss = fit(model, tokenizer, recipe) if recipe.steps > 0 else float("nan")
    model.generation_config = GenerationConfig(
        bos_token_id=pad_id, eos_token_id=[eos_id, pad_id], pad_token_id=pad_id, max_new_tokens=64
    )
    # Written beside the target and moved in one step, so a folder with config.json is always complete.
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tokenizer.save_pretrained(tmp)
        model.save_pretrained(tmp)
        (tmp / "special_tokens_map.json").unlink(missing_ok=True)
        exact = addition_exact(tmp) if recipe.steps > 0 else 0.0
        heldout = addition_exact(tmp, heldout_split()[1]) if recipe.steps > 0 else 0.0
        n_params = sum(p.numel() for p in model.parameters())
        record = {
            "recipe": asdict(recipe),
            "parameters": n_params,
            "final_loss": round(loss, 4),
            "addition_greedy_exact": exact,
            "heldout_greedy_exact": heldout,
            "build_seconds": round(time.monotonic() - started, 1),
        }
        (tmp / "recipe.json").write_text(json.dumps(record, indent=2) + "\n")
        (tmp / DEFAULTS_FILE).write_text(json.dumps(TRAINING_DEFAULTS, indent=2) + "\n")
        for path in [tmp, *tmp.iterdir()]:
            path.chmod(0o755 if path.is_dir() else 0o644)  # readable by the engine and sandbox uids
        shutil.rmtree(out, ignore_errors=True)
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    logger.info("Built tiny-chat in %s: %s", out, record)
    return out


def make_tiny_model(out_dir: str | Path, *, seed: int = 0, steps: int | None = None) -> Path:
    """`tiny-chat` in ``out_dir``: the shipped weights copied (seed 0, default steps), else built from
    scratch. A folder that already has ``config.json`` is kept as it is."""
    out = Path(out_dir)
    if (out / "config.json").exists():
        return out
    recipe = TinyRecipe(seed=seed, steps=TinyRecipe.steps if steps is None else steps)
    shipped = shipped_model_dir()
    if recipe != TinyRecipe() or not (shipped / "config.json").is_file():
        return build_tiny_model(out, recipe)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        for name in MODEL_FILES:
            shutil.copy2(shipped / name, tmp / name)
        if out.is_dir() and not any(out.iterdir()):
            out.rmdir()
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out

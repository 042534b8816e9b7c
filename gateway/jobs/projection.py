"""What a job will cost before it runs: its tokens (trained, evaluated, sampled, judged), its compute time and
its price, each as low / expected / high, with what was assumed named beside them.

Tokens are counted with the base model's own tokenizer and chat template, as the trainer counts what it trains
on (`trained_tokens`, TRL's `num_tokens`):

- supervised: each example's chat tokenised whole, cut at `max_length`;
- dpo: the prompt with the preferred answer, and the prompt with the other one, each cut at `max_length`;
- reinforcement: each of a prompt's `num_generations` completions with the prompt before it. A completion's
  length is measured by the estimate's pilot (`gateway.jobs.pilot`: a few training prompts sampled by the base
  model with the job's sampling settings): its mean expected, its 10th and 90th percentiles low and high.
  Without a pilot (it was refused, or no engine answered) the length is only bounded: one token at least,
  `max_completion_length` at most, half of it expected.

A run trains on `steps` batches (`trainer.contract.total_steps`): the whole file `n_epochs` times, or fewer
when `max_steps` cuts it. Which examples a cut epoch trains on is the shuffle's choice, so low and high take
the shortest and the longest ones. Model graders are called once per completion, and billed as chat
completions of their model. Compute time is tokens over a throughput: the organisation's own recorded training
of the base model and method when there is some, else `DEFAULT_TOKENS_PER_SECOND` per device.

`count_file` runs in a thread (it loads the tokenizer once per model folder); everything else is arithmetic.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any

from envsdk.graders.scoring import model_sampling
from gateway.files.validation import read_rows
from gateway.jobs.protocol import Assumption, CostRange, TokenEstimate
from gateway.jobs.validation import RowError
from gateway.settings import Settings
from gateway.usage.pricing import completion_cost, training_time_cost, training_tokens_cost
from trainer.contract import AnyHyperparameters, ReinforcementHyperparameters, total_steps

DEFAULT_TOKENS_PER_SECOND = 2_000.0
"""Trained tokens a second, per device, assumed when the organisation has recorded no training of the base
model with the method yet."""
CHARS_PER_TOKEN = 4
"""Characters a token, for counts made without the tokenizer (a job's estimate when it is queued)."""
TEMPLATE_TOKENS = 8
"""Tokens of chat template per example, for counts made without the tokenizer."""


@dataclass(frozen=True)
class FileTokens:
    """Token counts of one file's examples, as the trainer sees them."""

    counts: list[int]
    """Per example: the tokens trained on (supervised, dpo), or its prompt's (reinforcement)."""
    exact: bool = True
    """Counted with the tokenizer (else from characters, `CHARS_PER_TOKEN`)."""

    @property
    def total(self) -> int:
        return sum(self.counts)

    @property
    def mean(self) -> float:
        return self.total / len(self.counts) if self.counts else 0.0


@dataclass(frozen=True)
class Throughput:
    """Trained tokens a second the run is assumed to make."""

    tokens_per_second: float
    measured: bool
    """From the organisation's recorded training (else `DEFAULT_TOKENS_PER_SECOND` per device)."""


@dataclass(frozen=True)
class Estimate:
    """The arithmetic's result (`gateway.jobs.protocol.JobEstimate` adds the budget)."""

    steps: int
    tokens: TokenEstimate
    compute_seconds: CostRange
    cost: CostRange
    assumptions: list[Assumption]


# ---- counting ------------------------------------------------------------------------------------


_TOKENIZING = threading.Lock()
"""One file tokenised at a time: a fast tokenizer is not safe to share between threads, and the estimate's
threads share the cached one."""


@lru_cache(maxsize=8)
def _tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer  # heavy, and only the estimate needs it

    return AutoTokenizer.from_pretrained(path)


def _text(content: Any) -> str:
    if isinstance(content, list):
        return "".join(p.get("text", "") if isinstance(p, dict) else str(p) for p in content)
    return content or ""


def _tool_call(call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    fn = fn if isinstance(fn, dict) else {}
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            args = {}
    return {"type": "function", "function": {"name": fn.get("name", ""), "arguments": args}}


def chat(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Messages as the trainer hands them to the chat template (`trainer.data.normalize_messages`)."""
    out = []
    for m in messages:
        role = "system" if m["role"] == "developer" else m["role"]
        msg: dict[str, Any] = {"role": role, "content": _text(m.get("content"))}
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_tool_call(c) for c in m["tool_calls"]]
        out.append(msg)
    return out


def _length(tokenizer: Any, messages: list[dict[str, Any]], **kw: Any) -> int:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True, **kw)
    return len(out["input_ids"])


def _row_counts(tokenizer: Any, kind: str, rows: Iterator[tuple[int, dict]], max_length: int) -> list[int]:
    counts = []
    for line, row in rows:
        try:
            counts.append(_row_count(tokenizer, kind, row, max_length))
        except Exception as exc:  # the template refused the row (jinja, a type it cannot render)
            raise RowError(line, f"the model's chat template cannot render it ({exc})") from None
    return counts


def _row_count(tokenizer: Any, kind: str, row: dict[str, Any], max_length: int) -> int:
    if "input_ids" in row:  # token ids (captured episodes): counted as they are
        return min(len(row["input_ids"]), max_length)
    if "prompt_ids" in row:  # a preference pair of token ids
        n = len(row["prompt_ids"])
        return sum(min(n + len(row[key]), max_length) for key in ("chosen_ids", "rejected_ids"))
    if kind == "supervised":
        return min(_length(tokenizer, chat(row["messages"]), tools=row.get("tools") or None), max_length)
    if kind == "dpo":
        prompt = chat(row["input"]["messages"])
        return sum(
            min(_length(tokenizer, prompt + chat(row[key])), max_length)
            for key in ("preferred_output", "non_preferred_output")
        )
    prompt = [{"role": m["role"], "content": m["content"]} for m in chat(row["messages"])]
    return _length(tokenizer, prompt, add_generation_prompt=True)


def count_file(
    model_path: Path, kind: str, path: Path, *, max_length: int | None, max_line_bytes: int
) -> FileTokens:
    """Every example of a checked file, tokenised with the base model's tokenizer (call in a thread); a row
    its chat template cannot render is a `RowError`."""
    tokenizer = _tokenizer(str(model_path))
    with _TOKENIZING:
        rows = read_rows(path, max_line_bytes=max_line_bytes)
        return FileTokens(_row_counts(tokenizer, kind, rows, max_length or 2**31))


def count_texts(model_path: Path, texts: list[str]) -> list[int]:
    """Tokens of each text with the base model's tokenizer, without special tokens (call in a thread)."""
    tokenizer = _tokenizer(str(model_path))
    with _TOKENIZING:
        return [len(tokenizer.encode(t, add_special_tokens=False)) for t in texts]


def approximate(rows: int, chars: int) -> FileTokens:
    """Counts from a file's size alone (`DatasetSummary`), without the tokenizer: the estimate stored when a
    job is queued."""
    per = chars // max(rows, 1) // CHARS_PER_TOKEN + TEMPLATE_TOKENS
    return FileTokens([per] * rows, exact=False)


# ---- arithmetic ----------------------------------------------------------------------------------


def _examples(k: int, counts: list[int]) -> CostRange:
    """Tokens of `k` examples drawn epoch by epoch from `counts`: whole epochs exactly, the part of a cut
    epoch between its shortest and its longest examples."""
    n = len(counts)
    if not n or k <= 0:
        return CostRange(low=0, expected=0, high=0)
    whole, part = divmod(k, n)
    base = whole * sum(counts)
    ordered = sorted(counts)
    low = base + sum(ordered[:part])
    high = base + sum(ordered[n - part :]) if part else base
    return CostRange(low=low, expected=base + part * sum(counts) / n, high=high)


def _scale(r: CostRange, by: float) -> CostRange:
    return CostRange(low=r.low * by, expected=r.expected * by, high=r.high * by)


def _plus(*ranges: CostRange) -> CostRange:
    return CostRange(
        low=sum(r.low for r in ranges),
        expected=sum(r.expected for r in ranges),
        high=sum(r.high for r in ranges),
    )


ZERO = CostRange(low=0, expected=0, high=0)


def _completion(hp: AnyHyperparameters, measured: CostRange | None) -> CostRange:
    """Tokens of one sampled completion (reinforcement): as the pilot measured them, else bounded."""
    if not isinstance(hp, ReinforcementHyperparameters):
        return ZERO
    if measured is not None:
        return measured
    most = hp.max_completion_length
    return CostRange(low=1, expected=most / 2, high=most)


def model_graders(grader: Any) -> Iterator[dict[str, Any]]:
    """Every grader that calls a model (`score_model`, `label_model`), sub-graders of `multi` too."""
    if not isinstance(grader, dict):
        return
    if grader.get("type") in ("score_model", "label_model") and isinstance(grader.get("model"), str):
        yield grader
    if grader.get("type") == "multi" and isinstance(grader.get("graders"), dict):
        for sub in grader["graders"].values():
            yield from model_graders(sub)


def _judged(
    settings: Settings, grader: Any, calls: CostRange, completion: CostRange
) -> tuple[CostRange, CostRange, list[dict[str, Any]]]:
    """Tokens and USD of the model graders' calls, and what each was assumed to take."""
    tokens, usd, seen = [], [], []
    for g in model_graders(grader):
        prompt = len(json.dumps(g.get("input", ""))) // CHARS_PER_TOKEN
        cap = int(model_sampling(g.get("sampling_params"))["max_completion_tokens"])
        answer = CostRange(low=1, expected=cap / 2, high=cap)
        seen.append({"model": g["model"], "prompt_tokens": prompt, "answer_tokens": answer.model_dump()})
        per = {
            name: (prompt + getattr(completion, name), getattr(answer, name))
            for name in ("low", "expected", "high")
        }
        tokens.append(CostRange(**{k: getattr(calls, k) * (p + a) for k, (p, a) in per.items()}))
        usd.append(
            CostRange(
                **{
                    k: getattr(calls, k) * completion_cost(settings, g["model"], round(p), round(a))
                    for k, (p, a) in per.items()
                }
            )
        )
    return _plus(ZERO, *tokens), _plus(ZERO, *usd), seen


def _evaluated(
    kind: str, hp: AnyHyperparameters, steps: int, valid: FileTokens | None, completion: CostRange
) -> tuple[CostRange, dict[str, int]]:
    """Tokens of the evaluations: at step 0 and every `eval_interval` steps on `eval_samples` examples, and on
    the whole validation file at step 0 and at each checkpoint (a reinforcement evaluation samples one
    completion an example)."""
    if valid is None or not valid.counts or hp.eval_interval is None:
        return ZERO, {"periodic": 0, "full": 0}
    periodic = steps // hp.eval_interval + 1
    full = math.ceil(steps / hp.checkpoint_every) + 1
    samples = min(hp.eval_samples or len(valid.counts), len(valid.counts))
    examples = periodic * samples + full * len(valid.counts)
    prompts = CostRange(
        low=periodic * sum(sorted(valid.counts)[:samples]) + full * valid.total,
        expected=periodic * samples * valid.mean + full * valid.total,
        high=periodic * sum(sorted(valid.counts)[-samples:]) + full * valid.total,
    )
    out = _plus(prompts, _scale(completion, examples)) if kind == "reinforcement" else prompts
    return out, {"periodic": periodic, "full": full, "examples": examples}


def estimate(
    settings: Settings,
    *,
    base_model: str,
    kind: str,
    hp: AnyHyperparameters,
    train: FileTokens,
    valid: FileTokens | None,
    grader: Any,
    throughput: Throughput,
    measured: CostRange | None = None,
) -> Estimate:
    """Tokens, time and USD of a run of `hp` over these files, with its assumptions. `measured`: the tokens
    of one sampled completion as the pilot measured them (reinforcement)."""
    rows = len(train.counts)
    steps = total_steps(kind, rows, hp.batch_size, hp.n_epochs, hp.max_steps)
    if kind == "reinforcement":
        examples = steps * hp.batch_size  # whole batches of prompts only
    else:
        per_epoch = math.ceil(rows / hp.batch_size)
        examples = (steps // per_epoch) * rows + (steps % per_epoch) * hp.batch_size
    generations = hp.num_generations if isinstance(hp, ReinforcementHyperparameters) else 1
    completion = _completion(hp, measured)
    sampled = _scale(completion, examples * generations)
    trained = _plus(_scale(_examples(examples, train.counts), generations), sampled)
    evaluated, evaluations = _evaluated(kind, hp, steps, valid, completion)
    calls = CostRange(
        low=examples * generations, expected=examples * generations, high=examples * generations
    )
    judged, judged_usd, graders = _judged(settings, grader, calls, completion)
    margin = 0.25 if throughput.measured else 0.5
    seconds = CostRange(
        low=(trained.low + evaluated.low) / (throughput.tokens_per_second * (1 + margin)),
        expected=(trained.expected + evaluated.expected) / throughput.tokens_per_second,
        high=(trained.high + evaluated.high) / (throughput.tokens_per_second * (1 - margin)),
    )
    cost = _plus(
        CostRange(
            **{
                k: training_tokens_cost(settings, base_model, round(getattr(trained, k)))
                + training_time_cost(settings, base_model, getattr(seconds, k))
                for k in ("low", "expected", "high")
            }
        ),
        judged_usd,
    )
    assumptions = _assumptions(
        settings,
        base_model,
        kind,
        train,
        examples,
        completion,
        measured is not None,
        evaluations,
        graders,
        throughput,
        margin,
    )
    return Estimate(
        steps=steps,
        tokens=TokenEstimate(trained=trained, evaluated=evaluated, sampled=sampled, judged=judged),
        compute_seconds=seconds,
        cost=cost,
        assumptions=assumptions,
    )


def _assumptions(
    settings: Settings,
    base_model: str,
    kind: str,
    train: FileTokens,
    examples: int,
    completion: CostRange,
    measured: bool,
    evaluations: dict[str, int],
    graders: list[dict[str, Any]],
    throughput: Throughput,
    margin: float,
) -> list[Assumption]:
    out = [
        Assumption(
            name="token_counts",
            value="tokenizer" if train.exact else "characters",
            detail="Examples tokenised with the base model's tokenizer and chat template, as the trainer does"
            if train.exact
            else f"Examples counted at {CHARS_PER_TOKEN} characters a token, plus {TEMPLATE_TOKENS} of "
            "chat template",
        ),
        Assumption(
            name="examples_trained",
            value=examples,
            detail="Examples the run's steps take; when max_steps cuts an epoch, low and high count its "
            "shortest and longest examples",
        ),
    ]
    if kind == "reinforcement":
        out.append(
            Assumption(
                name="completion_tokens",
                value=completion.model_dump(),
                detail="Tokens of a sampled completion, its end-of-sequence token included: as the pilot "
                "measured them, the mean expected, the 10th and 90th percentiles low and high"
                if measured
                else "Tokens of a sampled completion, not measured (see pilot): expected half of "
                "max_completion_length, at most all of it, at least one",
            )
        )
    out.append(
        Assumption(
            name="evaluations",
            value=evaluations,
            detail="Evaluations at step 0 and every eval_interval steps on eval_samples examples, and on the "
            "whole validation file at step 0 and at each checkpoint; not billed per token",
        )
    )
    if graders:
        out.append(
            Assumption(
                name="model_grader_calls",
                value=graders,
                detail="One call a completion per model grader: its input at "
                f"{CHARS_PER_TOKEN} characters a token plus the completion, and an answer of half its "
                "max_completion_tokens expected; priced as chat completions of its model",
            )
        )
    out.append(
        Assumption(
            name="throughput",
            value={
                "tokens_per_second": round(throughput.tokens_per_second, 3),
                "measured": throughput.measured,
            },
            detail=(
                "Measured on the organisation's recorded training of this base model and method"
                if throughput.measured
                else f"No recorded training of this base model and method: {DEFAULT_TOKENS_PER_SECOND:g} "
                "tokens a second per device"
            )
            + f"; low and high {margin:.0%} faster and slower",
        )
    )
    out.append(
        Assumption(
            name="prices",
            value=settings.price_of(base_model).model_dump(),
            detail="USD of the base model's price table: per million trained tokens and per training hour",
        )
    )
    return out

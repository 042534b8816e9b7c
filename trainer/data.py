"""Reading OpenAI fine-tuning JSONL into the rows TRL's trainers take.

- supervised: ``{"messages": [...], "tools"?}`` -> ``{"messages": [...]}`` (+ ``tools``)
- dpo: ``{"input": {"messages": [...]}, "preferred_output": [...], "non_preferred_output": [...]}``
  -> conversational ``{"prompt", "chosen", "rejected"}``
- reinforcement: ``{"messages": [... ending with a user turn], <any other keys>}`` -> ``{"prompt": messages,
  ITEM_COLUMN: json of the whole row}``; the grader reads the row back as ``item``.

Rows of token ids (what captured episodes are exported as) are trained on exactly as given:

- supervised ``{"input_ids", "completion_mask"}`` -> ``{"input_ids", "labels"}`` (-100 off the mask);
- dpo ``{"prompt_ids", "chosen_ids", "rejected_ids", "chosen_mask"?, "rejected_mask"?}`` -> the same keys
  (masks default to all ones): the loss on the masked tokens only (``trainer.token_dpo``);
- reinforcement ``{"input_ids", "completion_mask", "logprobs", "advantage", "reward"?}`` (logged episodes)
  -> the same keys, ``logprobs`` as floats and the mask cleared where the sampler logged none
  (``trainer.offline_rl``).

Every problem is a ``TrainerError`` with code ``invalid_training_file`` (or ``invalid_validation_file``)
naming the line. Only ``datasets`` is imported, inside ``to_dataset``.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

from trainer.errors import TrainerError

logger = logging.getLogger(__name__)

ITEM_COLUMN = "tunegate_item"
"""Reinforcement rows carry the original JSON row here (a string, so rows may differ in shape)."""

ROLES = ("system", "developer", "user", "assistant", "tool")


def read_jsonl(path: str | Path, *, code: str = "invalid_training_file") -> list[dict[str, Any]]:
    """Read a JSONL file of objects (blank lines skipped)."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TrainerError(code, f"cannot read {Path(path).name}: {exc}") from None
    rows = []
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError as exc:
            raise TrainerError(code, f"line {lineno} is not valid JSON: {exc}") from None
        if not isinstance(row, dict):
            raise TrainerError(code, f"line {lineno} must be a JSON object")
        rows.append(row)
    if not rows:
        raise TrainerError(code, f"{Path(path).name} holds no examples")
    return rows


def _content_text(content: Any) -> str | None:
    """Message content as plain text: strings as is, content parts joined."""
    if content is None or isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for part in content:
            if isinstance(part, dict) and isinstance(part.get("text"), str):
                parts.append(part["text"])
            elif isinstance(part, str):
                parts.append(part)
            else:
                raise ValueError("only text content parts are supported")
        return "".join(parts)
    raise ValueError("content must be a string or a list of text parts")


def normalize_messages(messages: Any, where: str) -> list[dict[str, Any]]:
    """Check a chat and return it as ``{"role", "content"[, "tool_calls"]}`` messages for a chat template."""
    if not isinstance(messages, list) or not messages:
        raise ValueError(f"{where} must be a non-empty list of messages")
    out = []
    for i, msg in enumerate(messages):
        if not isinstance(msg, dict) or msg.get("role") not in ROLES:
            raise ValueError(f"{where}[{i}] needs a role among {', '.join(ROLES)}")
        role = "system" if msg["role"] == "developer" else msg["role"]
        try:
            content = _content_text(msg.get("content"))
        except ValueError as exc:
            raise ValueError(f"{where}[{i}]: {exc}") from None
        norm: dict[str, Any] = {"role": role, "content": content or ""}
        if role == "assistant" and msg.get("tool_calls"):
            norm["tool_calls"] = [_tool_call(tc, f"{where}[{i}].tool_calls") for tc in msg["tool_calls"]]
        elif content is None:
            raise ValueError(f"{where}[{i}] has no content")
        out.append(norm)
    return out


def _tool_call(call: Any, where: str) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}: each tool call needs function.name")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise ValueError(f"{where}: function.arguments is not JSON") from None
    return {"type": "function", "function": {"name": fn["name"], "arguments": args}}


def convert_rows(
    method: str, rows: list[dict[str, Any]], *, code: str = "invalid_training_file"
) -> list[dict]:
    """Turn OpenAI rows into TRL rows for ``method``; errors name the 1-based example number."""
    out = []
    for n, row in enumerate(rows, start=1):
        try:
            out.append(_convert(method, row))
        except ValueError as exc:
            raise TrainerError(code, f"example {n}: {exc}") from None
    return out


def _token_row(row: dict[str, Any]) -> dict[str, Any]:
    """A supervised row of token ids (a capture export's sample): trained on exactly as given, the loss on
    the tokens `completion_mask` marks (the ids the model sampled)."""
    ids, mask = row.get("input_ids"), row.get("completion_mask")
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise ValueError("input_ids and completion_mask must be lists of the same length")
    return {"input_ids": ids, "labels": [i if m else -100 for i, m in zip(ids, mask, strict=True)]}


def _ids(value: Any, name: str) -> list[int]:
    if not isinstance(value, list) or not value or not all(type(i) is int and i >= 0 for i in value):
        raise ValueError(f"{name} must be a non-empty list of token ids")
    return value


def _pair_row(row: dict[str, Any]) -> dict[str, Any]:
    """A preference pair of token ids (a capture export's): the loss on the masked (sampled) tokens."""
    out: dict[str, Any] = {"prompt_ids": _ids(row.get("prompt_ids"), "prompt_ids")}
    for side in ("chosen", "rejected"):
        ids = _ids(row.get(f"{side}_ids"), f"{side}_ids")
        mask = row.get(f"{side}_mask", [1] * len(ids))
        if not isinstance(mask, list) or len(mask) != len(ids) or not any(mask):
            raise ValueError(f"{side}_mask must mark some of {side}_ids, one 0 or 1 for each")
        out[f"{side}_ids"], out[f"{side}_mask"] = ids, [1 if m else 0 for m in mask]
    return out


def _episode_row(row: dict[str, Any]) -> dict[str, Any]:
    """A logged episode's sample: its ids, the sampled tokens that have a logged logprob, those logprobs
    (0.0 elsewhere), its advantage and reward."""
    ids = _ids(row.get("input_ids"), "input_ids")
    mask, logprobs = row.get("completion_mask"), row.get("logprobs")
    if (
        not isinstance(mask, list)
        or not isinstance(logprobs, list)
        or not len(ids) == len(mask) == len(logprobs)
    ):
        raise ValueError("input_ids, completion_mask and logprobs must be lists of the same length")
    advantage = row.get("advantage")
    if isinstance(advantage, bool) or not isinstance(advantage, int | float):
        raise ValueError("advantage must be a number")
    kept = [1 if m and lp is not None else 0 for m, lp in zip(mask, logprobs, strict=True)]
    if not any(kept[1:]):
        raise ValueError("no sampled token (after the first) has a logged logprob")
    reward = row.get("reward")
    return {
        "input_ids": ids,
        "completion_mask": kept,
        "logprobs": [float(lp) if k else 0.0 for lp, k in zip(logprobs, kept, strict=True)],
        "advantage": float(advantage),
        "reward": float(reward) if isinstance(reward, int | float) else 0.0,
    }


def _convert(method: str, row: dict[str, Any]) -> dict[str, Any]:
    if method == "supervised" and "input_ids" in row:
        return _token_row(row)
    if method == "dpo" and "prompt_ids" in row:
        return _pair_row(row)
    if method == "reinforcement" and "input_ids" in row:
        return _episode_row(row)
    if method == "supervised":
        messages = normalize_messages(row.get("messages"), "messages")
        if not any(m["role"] == "assistant" for m in messages):
            raise ValueError("messages need at least one assistant message")
        converted: dict[str, Any] = {"messages": messages}
        if row.get("tools"):
            if not isinstance(row["tools"], list):
                raise ValueError("tools must be a list")
            converted["tools"] = row["tools"]
        return converted
    if method == "dpo":
        inp = row.get("input")
        if not isinstance(inp, dict):
            raise ValueError("input must be an object with messages")
        prompt = normalize_messages(inp.get("messages"), "input.messages")
        chosen = normalize_messages(row.get("preferred_output"), "preferred_output")
        rejected = normalize_messages(row.get("non_preferred_output"), "non_preferred_output")
        for name, msgs in (("preferred_output", chosen), ("non_preferred_output", rejected)):
            if any(m["role"] != "assistant" for m in msgs):
                raise ValueError(f"{name} must hold assistant messages only")
        return {"prompt": prompt, "chosen": chosen, "rejected": rejected}
    if method == "reinforcement":
        messages = normalize_messages(row.get("messages"), "messages")
        if messages[-1]["role"] != "user":
            raise ValueError("the last message must have role user")
        prompt = [{"role": m["role"], "content": m["content"]} for m in messages]
        return {"prompt": prompt, ITEM_COLUMN: json.dumps(row)}
    raise ValueError(f"unknown method {method!r}")


def load_dataset(
    method: str, path: str | Path, *, code: str = "invalid_training_file"
):  # -> datasets.Dataset
    """Read, check and convert a JSONL file into a ``datasets.Dataset`` for ``method``."""
    from datasets import Dataset

    rows = convert_rows(method, read_jsonl(path, code=code), code=code)
    try:
        return Dataset.from_list(rows)
    except Exception as exc:  # Arrow refuses rows whose shapes cannot share one schema
        raise TrainerError(code, f"examples do not share one structure: {exc}") from None

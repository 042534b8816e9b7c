"""An episode's token sequence: each captured call's prompt stored as a delta on the turn it extends.

A call of an episode extends an earlier turn when its prompt token ids start with that turn's prompt ids
followed by the ids that turn sampled (choice 0). The record then keeps only the ids after them: the first
`prompt_prefix_tokens` of its prompt are that turn's sequence, and `previous_id` names the turn. The turn
extended is the newest of the episode's recent turns that the prompt starts with.

Where the prompt does not extend the episode's last turn, the record says why as a `segment_break`; when it
still extends an older turn (an agent that branched, or a last turn whose sampled text the chat template
tokenized differently when the conversation was rendered again), the break names that turn (`extends`) and
the record is a delta on it. Where it extends none, nothing is dropped or rendered again: the record keeps
its prompt ids whole and points at the last turn. The reasons:

- `model_changed`: another base model answered (another tokenizer);
- `no_token_ids`: this call or the last turn has no token ids (an engine that returned none);
- `prompt_diverged`: the prompt differs from the last turn's sequence at token `at_token` (a chat template
  that strips earlier thinking, tool-call JSON serialised again, or a sampled sequence the tokenizer would
  not produce when the conversation is rendered again).

The request's `messages` are kept the same way: when they start with the previous turn's request messages
(exactly as they were sent), the record keeps the messages after them, and `messages_prefix` says how many
came before.

`Turn` is what a later call needs of an earlier one (whole); `link` places a new call; `rebuild` turns an
episode's stored records back into whole turns.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from gateway.capture.store import CapturedRow


@dataclass(frozen=True, slots=True)
class Turn:
    """One call of an episode, whole: its prompt ids, the ids it sampled (choice 0) and its messages."""

    id: str
    base_model: str
    prompt_ids: list[int] | None
    completion_ids: list[int] | None
    messages: list[Any]

    @property
    def sequence(self) -> list[int] | None:
        """The prompt and the sampled completion: what a later turn's prompt extends."""
        if self.prompt_ids is None or self.completion_ids is None:
            return None
        return self.prompt_ids + self.completion_ids


@dataclass(frozen=True, slots=True)
class Link:
    """Where a new call sits in its episode, and what of it is stored."""

    previous_id: str | None
    prompt_prefix_tokens: int
    prompt_delta: list[int] | None
    segment_break: dict[str, Any] | None
    messages_prefix: int
    messages_delta: list[Any]


def first_difference(a: Sequence[int], b: Sequence[int]) -> int:
    """The first index at which `a` and `b` differ (the shorter one's length when one starts the other)."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return min(len(a), len(b))


def _why(last: Turn, new: Turn) -> dict[str, Any]:
    if new.base_model != last.base_model:
        return {"reason": "model_changed", "previous_id": last.id, "previous_base_model": last.base_model}
    sequence = last.sequence
    if new.prompt_ids is None or sequence is None:
        return {"reason": "no_token_ids", "previous_id": last.id}
    return {
        "reason": "prompt_diverged",
        "previous_id": last.id,
        "at_token": first_difference(sequence, new.prompt_ids),
        "previous_tokens": len(sequence),
    }


def link(turns: Sequence[Turn], new: Turn) -> Link:
    """Place `new` after the episode's recent `turns` (oldest first; empty for its first call)."""
    if not turns:
        return Link(None, 0, new.prompt_ids, None, 0, new.messages)
    extended = None
    if new.prompt_ids is not None:
        for turn in reversed(turns):
            sequence = turn.sequence
            if (
                turn.base_model == new.base_model
                and sequence is not None
                and len(sequence) <= len(new.prompt_ids)
                and new.prompt_ids[: len(sequence)] == sequence
            ):
                extended = turn
                break
    previous = extended or turns[-1]
    prefix = len(previous.sequence or ()) if extended is not None else 0
    kept = len(previous.messages)
    messages_prefix = kept if kept and new.messages[:kept] == previous.messages else 0
    segment_break = None
    if extended is not turns[-1]:
        segment_break = _why(turns[-1], new)
        if extended is not None:
            segment_break["extends"] = extended.id
    return Link(
        previous_id=previous.id,
        prompt_prefix_tokens=prefix,
        prompt_delta=new.prompt_ids[prefix:] if new.prompt_ids is not None else None,
        segment_break=segment_break,
        messages_prefix=messages_prefix,
        messages_delta=new.messages[messages_prefix:],
    )


def messages_of(request: dict[str, Any]) -> list[Any]:
    """A request's `messages` (none when it has no list of them)."""
    messages = request.get("messages")
    return messages if isinstance(messages, list) else []


def turn_of(row: CapturedRow) -> Turn:
    """A record not stored as a delta yet (as the request path makes it), as a turn."""
    first = row.completion_token_ids[0] if row.completion_token_ids else None
    return Turn(row.id, row.base_model, row.prompt_token_ids, first, messages_of(row.request))


def place(turns: Sequence[Turn], row: CapturedRow) -> CapturedRow:
    """A record as stored after its episode's recent `turns`: its prompt ids and messages a delta on the turn
    it extends (`link`); `row` is whole, as the request path makes it."""
    placed = link(turns, turn_of(row))
    return dataclasses.replace(
        row,
        previous_id=placed.previous_id,
        prompt_prefix_tokens=placed.prompt_prefix_tokens,
        prompt_token_ids=placed.prompt_delta,
        segment_break=placed.segment_break,
        messages_prefix=placed.messages_prefix,
        request={**row.request, "messages": placed.messages_delta}
        if "messages" in row.request
        else row.request,
    )


def rebuild(records: Iterable[CapturedRow]) -> dict[str, Turn]:
    """Every record of an episode made whole again, by id (`records` oldest first). A record whose previous
    turn is gone has no prompt ids (and only the messages it kept)."""
    turns: dict[str, Turn] = {}
    for r in records:
        previous = turns.get(r.previous_id) if r.previous_id is not None else None
        prompt: list[int] | None = r.prompt_token_ids
        if r.prompt_prefix_tokens:
            sequence = previous.sequence if previous is not None else None
            prompt = (
                sequence[: r.prompt_prefix_tokens] + (r.prompt_token_ids or [])
                if sequence is not None
                else None
            )
        messages = messages_of(r.request)
        if r.messages_prefix and previous is not None:
            messages = previous.messages[: r.messages_prefix] + messages
        completions = r.completion_token_ids
        first = completions[0] if completions else None
        turns[r.id] = Turn(r.id, r.base_model, prompt, first, messages)
    return turns

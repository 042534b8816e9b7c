"""An episode's calls stored as deltas on the turns they extend (`gateway.capture.sequences`), over
hand-made records: linking, segment breaks and rebuilding."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from gateway.capture.sequences import place, rebuild, turn_of
from gateway.capture.store import CapturedRow


def _row(
    id: str, prompt: list[int] | None, completion: list[int] | None, messages: list[Any], **more: Any
) -> CapturedRow:
    return CapturedRow(
        organization_id="org",
        id=id,
        api_key_id="key",
        episode_id="ep",
        parent_episode_id=None,
        stored=False,
        streamed=False,
        model="m",
        base_model=more.pop("base_model", "m"),
        served_version="m",
        request={"messages": messages, "temperature": 1.0},
        response={},
        metadata={},
        prompt_token_ids=prompt,
        completion_token_ids=[completion] if completion is not None else None,
        logprobs=None,
        finish_reason="stop",
        prompt_tokens=0,
        completion_tokens=0,
        latency_ms=1,
        status=200,
        created_at=datetime.now(UTC),
        expires_at=None,
        **more,
    )


def _stored(rows: list[CapturedRow]) -> list[CapturedRow]:
    """What the writer stores of each row, in order (placed after the turns before it)."""
    return [place([turn_of(r) for r in rows[:i]], row) for i, row in enumerate(rows)]


U1 = {"role": "user", "content": "hi"}
A1 = {"role": "assistant", "content": "yo"}
U2 = {"role": "user", "content": "and?"}
A2 = {"role": "assistant", "content": "so"}
U3 = {"role": "user", "content": "ok"}


def test_turns_that_extend_the_sampled_ids_are_stored_as_deltas_and_rebuilt_whole() -> None:
    rows = [
        _row("c1", [1, 2, 3], [4, 5], [U1]),
        _row("c2", [1, 2, 3, 4, 5, 6, 7], [8], [U1, A1, U2]),
        _row("c3", [1, 2, 3, 4, 5, 6, 7, 8, 9], [10, 11], [U1, A1, U2, A2, U3]),
    ]
    stored = _stored(rows)
    assert [(s.previous_id, s.prompt_prefix_tokens, s.prompt_token_ids) for s in stored] == [
        (None, 0, [1, 2, 3]),
        ("c1", 5, [6, 7]),
        ("c2", 8, [9]),
    ]
    assert [s.segment_break for s in stored] == [None, None, None]
    assert [s.messages_prefix for s in stored] == [0, 1, 3]
    assert [s.request["messages"] for s in stored] == [[U1], [A1, U2], [A2, U3]]
    whole = rebuild(stored)
    for row in rows:
        assert whole[row.id] == turn_of(row)


def test_a_prompt_that_does_not_extend_the_sampled_ids_is_a_segment_break_kept_whole() -> None:
    # Turn 2's template dropped turn 1's thinking (ids 4, 5): the prompt differs from the sequence at 3.
    rows = [
        _row("c1", [1, 2, 3], [4, 5, 6], [U1]),
        _row("c2", [1, 2, 3, 6, 7], [8], [U1, A1, U2]),
    ]
    stored = _stored(rows)
    assert stored[1].previous_id == "c1" and stored[1].prompt_prefix_tokens == 0
    assert stored[1].prompt_token_ids == [1, 2, 3, 6, 7]  # whole: nothing dropped
    assert stored[1].segment_break == {
        "reason": "prompt_diverged",
        "previous_id": "c1",
        "at_token": 3,
        "previous_tokens": 6,
    }
    assert stored[1].messages_prefix == 1  # the messages still extend turn 1's
    assert rebuild(stored)["c2"] == turn_of(rows[1])


def test_a_branch_extends_the_newest_turn_its_prompt_starts_with_and_is_a_break() -> None:
    rows = [
        _row("c1", [1, 2], [3], [U1]),
        _row("c2", [1, 2, 3, 4], [5], [U1, A1, U2]),
        _row("c3", [1, 2, 3, 9], [10], [U1, A1, U3]),  # a branch off c1, not off c2
    ]
    stored = _stored(rows)
    assert (stored[2].previous_id, stored[2].prompt_prefix_tokens, stored[2].prompt_token_ids) == (
        "c1",
        3,
        [9],
    )
    # It does not extend the last turn: a break, which names the turn it extends.
    assert stored[2].segment_break == {
        "reason": "prompt_diverged",
        "previous_id": "c2",
        "at_token": 3,
        "previous_tokens": 5,
        "extends": "c1",
    }
    assert rebuild(stored)["c3"] == turn_of(rows[2])


def test_other_breaks_name_their_reason() -> None:
    changed = _stored([_row("c1", [1], [2], [U1]), _row("c2", [1, 2, 3], [4], [U1], base_model="other")])
    assert changed[1].segment_break == {
        "reason": "model_changed",
        "previous_id": "c1",
        "previous_base_model": "m",
    }
    no_ids = _stored([_row("c1", None, None, [U1]), _row("c2", [1, 2], [3], [U1])])
    assert no_ids[1].segment_break == {"reason": "no_token_ids", "previous_id": "c1"}
    assert no_ids[1].prompt_token_ids == [1, 2]

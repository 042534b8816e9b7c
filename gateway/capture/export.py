"""Captured episodes as training data: their exact token sequences, as JSONL samples or Tinker `Datum`s.

An episode's calls form chains: each call whose prompt extends an earlier turn's sampled sequence
(`gateway.capture.sequences`) continues that turn's chain. A call that no later call extends ends a
**sample**: the whole token sequence of its chain (`input_ids`: its prompt and its sampled completion, ids
exactly as the engine saw and sampled them, never rendered again), a `completion_mask` that is 1 exactly on
the tokens each call of the chain sampled and 0 on every other (system, user and tool messages, the chat
template's own tokens), and the sampler's `logprobs` of the sampled tokens (null elsewhere). A segment break
starts a new chain, so a conversation the chat template rewrote (earlier thinking stripped, tool JSON
serialised again) gives one sample per segment, each exact.

Each sample carries the rewards posted for it (those of its episode, of its calls, and spans of them) and a
`reward`: the latest episode-level reward named `reward_name` (any name when none is given). A sample's
`advantage` is its reward less the mean reward of its group (the samples whose episodes share the
`group_by` metadata value; all the samples exported when `group_by` is None): GRPO's group-relative
advantage, which the Tinker form puts on its sampled tokens.

A JSONL sample is also a training row: `input_ids` and `completion_mask` are what the supervised trainer
reads from a file of such rows, and with `logprobs` and `advantage` what the offline reinforcement trainer
reads (`trainer.offline_rl`).

A sample's **staleness** (`drop_stale`) counts model versions: the versions that served the selected
samples, ordered by the first call each served, the newest being the policy the data is brought up to; a
sample is as stale as the oldest version among its calls. **Preference pairs** (`dpo_pairs`) match, within a
group, a higher-rewarded sample (chosen) with a lower-rewarded one (rejected) that shares its prompt: the ids
before its first sampled token.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from gateway.capture.episodes_store import RewardRow
from gateway.capture.sequences import rebuild
from gateway.capture.store import CapturedRow


@dataclass(slots=True)
class Sample:
    """One chain of an episode's calls, its whole token sequence exact."""

    episode_id: str
    completion_ids: list[str]
    base_model: str
    served_versions: list[str]
    input_ids: list[int]
    completion_mask: list[int]
    logprobs: list[float | None]
    segment_break: dict[str, Any] | None
    """The break that started this chain (None for an episode's first)."""
    rewards: list[dict[str, Any]]
    reward: float | None
    metadata: dict[str, str]
    advantage: float = 0.0
    served_at: float = 0.0
    """Unix seconds of the chain's first call (versions are ordered by the first call each served)."""


def _reward_out(r: RewardRow) -> dict[str, Any]:
    target: dict[str, Any] = {"type": "episode"}
    if r.completion_id is not None:
        target = {"type": "completion", "completion_id": r.completion_id}
        if r.span_start is not None:
            target = {**target, "type": "span", "start": r.span_start, "end": r.span_end}
    return {
        "name": r.name,
        "value": r.value,
        "target": target,
        "source": r.source,
        "created_at": int(r.created_at.timestamp()),
    }


def episode_samples(
    records: Sequence[CapturedRow],
    rewards: Sequence[RewardRow],
    metadata: dict[str, str],
    *,
    reward_name: str | None = None,
) -> tuple[list[Sample], int]:
    """The samples of one episode (`records` oldest first), and how many calls were left out because the
    engine returned no token ids for them."""
    turns = rebuild(records)
    by_id = {r.id: r for r in records}
    extended = {r.previous_id for r in records if r.prompt_prefix_tokens and r.previous_id is not None}
    episode_level = [r for r in rewards if r.completion_id is None and (reward_name in (None, r.name))]
    reward = episode_level[-1].value if episode_level else None
    out: list[Sample] = []
    skipped = 0
    for end in records:
        if end.id in extended:
            continue
        chain = [end]
        while chain[-1].prompt_prefix_tokens and chain[-1].previous_id in by_id:
            chain.append(by_id[str(chain[-1].previous_id)])
        chain.reverse()
        sequence = turns[end.id].sequence
        if sequence is None:
            skipped += len(chain)
            continue
        mask = [0] * len(sequence)
        logprobs: list[float | None] = [None] * len(sequence)
        for call in chain:
            turn = turns[call.id]
            start = len(turn.prompt_ids or ())
            sampled = call.logprobs[0] if call.logprobs else []
            for i in range(len(turn.completion_ids or ())):
                mask[start + i] = 1
                logprobs[start + i] = sampled[i] if i < len(sampled) else None
        ids = {c.id for c in chain}
        out.append(
            Sample(
                episode_id=str(end.episode_id),
                completion_ids=[c.id for c in chain],
                base_model=end.base_model,
                served_versions=list(dict.fromkeys(c.served_version for c in chain)),
                input_ids=sequence,
                completion_mask=mask,
                logprobs=logprobs,
                segment_break=chain[0].segment_break,
                rewards=[
                    _reward_out(r) for r in rewards if r.completion_id is None or r.completion_id in ids
                ],
                reward=reward,
                metadata=metadata,
                served_at=chain[0].created_at.timestamp(),
            )
        )
    return out, skipped


def version_order(samples: Sequence[Sample]) -> list[str]:
    """The model versions that served `samples`, oldest first: ordered by the first call each served."""
    first: dict[str, float] = {}
    for s in samples:
        for version in s.served_versions:
            first[version] = min(first.get(version, s.served_at), s.served_at)
    return sorted(first, key=lambda v: (first[v], v))


def drop_stale(samples: Sequence[Sample], max_staleness: int | None) -> tuple[list[Sample], int]:
    """The samples no more than `max_staleness` versions older than the newest version that served the
    selection (None: all), and how many were dropped. A sample is as old as its oldest call's version."""
    if max_staleness is None:
        return list(samples), 0
    order = {v: i for i, v in enumerate(version_order(samples))}
    newest = len(order) - 1
    kept = [s for s in samples if newest - min(order[v] for v in s.served_versions) <= max_staleness]
    return kept, len(samples) - len(kept)


def prompt_length(s: Sample) -> int:
    """Tokens before the sample's first sampled token (its prompt)."""
    return s.completion_mask.index(1) if 1 in s.completion_mask else len(s.completion_mask)


def dpo_pairs(samples: Sequence[Sample], group_by: str | None) -> list[dict[str, Any]]:
    """Preference rows of token ids: within each group (the `group_by` metadata value; all samples when
    None), each rewarded sample paired with every lower-rewarded one whose prompt ids are the same (and whose
    sampled ids differ). `chosen_mask`/`rejected_mask` mark the sampled tokens of each continuation: the
    loss is on those only."""
    groups: dict[tuple[str | None, tuple[int, ...]], list[Sample]] = defaultdict(list)
    for s in samples:
        if s.reward is not None:
            n = prompt_length(s)
            groups[(s.metadata.get(group_by) if group_by else None, tuple(s.input_ids[:n]))].append(s)
    rows: list[dict[str, Any]] = []
    for (group, prompt), members in groups.items():
        members = sorted(members, key=lambda s: -float(s.reward or 0.0))
        for i, chosen in enumerate(members):
            for rejected in members[i + 1 :]:
                n = len(prompt)
                if float(chosen.reward or 0.0) <= float(rejected.reward or 0.0):
                    continue
                if chosen.input_ids[n:] == rejected.input_ids[n:]:
                    continue
                rows.append(
                    {
                        "prompt_ids": list(prompt),
                        "chosen_ids": chosen.input_ids[n:],
                        "rejected_ids": rejected.input_ids[n:],
                        "chosen_mask": chosen.completion_mask[n:],
                        "rejected_mask": rejected.completion_mask[n:],
                        "chosen_reward": chosen.reward,
                        "rejected_reward": rejected.reward,
                        "episode_ids": [chosen.episode_id, rejected.episode_id],
                        "served_versions": list(
                            dict.fromkeys(chosen.served_versions + rejected.served_versions)
                        ),
                        "group": group,
                    }
                )
    return rows


def set_advantages(samples: Sequence[Sample], group_by: str | None) -> None:
    """Each rewarded sample's advantage: its reward less its group's mean reward (0 without a reward)."""
    groups: dict[str | None, list[Sample]] = defaultdict(list)
    for s in samples:
        if s.reward is not None:
            groups[s.metadata.get(group_by) if group_by else None].append(s)
    for members in groups.values():
        mean = sum(float(s.reward or 0.0) for s in members) / len(members)
        for s in members:
            s.advantage = float(s.reward or 0.0) - mean


def jsonl_row(s: Sample) -> dict[str, Any]:
    """A sample as a JSONL line (also a supervised training row: `input_ids`, `completion_mask`)."""
    return {
        "episode_id": s.episode_id,
        "completion_ids": s.completion_ids,
        "base_model": s.base_model,
        "served_versions": s.served_versions,
        "input_ids": s.input_ids,
        "completion_mask": s.completion_mask,
        "logprobs": s.logprobs,
        "segment_break": s.segment_break,
        "reward": s.reward,
        "advantage": s.advantage,
        "rewards": s.rewards,
        "metadata": s.metadata,
    }


def _tensor(data: list[Any], dtype: str) -> dict[str, Any]:
    return {"data": data, "dtype": dtype, "shape": [len(data)]}


def datum(s: Sample) -> dict[str, Any]:
    """A sample as a Tinker `Datum`: the model reads every token but the last and predicts every token but
    the first; `weights` are the sampled tokens' mask, `logprobs` the sampler's (0 where not sampled) and
    `advantages` the sample's advantage on its sampled tokens (for `importance_sampling`, `ppo`...)."""
    mask = s.completion_mask[1:]
    return {
        "model_input": {"chunks": [{"type": "encoded_text", "tokens": s.input_ids[:-1]}]},
        "loss_fn_inputs": {
            "target_tokens": _tensor(s.input_ids[1:], "int64"),
            "weights": _tensor([float(m) for m in mask], "float32"),
            "logprobs": _tensor([float(lp or 0.0) for lp in s.logprobs[1:]], "float32"),
            "advantages": _tensor([s.advantage * m for m in mask], "float32"),
        },
    }

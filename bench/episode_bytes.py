"""Stored bytes of a captured episode: what its calls cost to keep against its final sequence kept once.

An agent holds one conversation of `TURNS` turns with `tiny-chat` through the gateway (an embedded engine
behind it, capture on for its organisation, the episode named by `X-Episode-Id`): each turn sends every
message so far plus a new question, as agents do, so the prompts grow and a record of each call as it was
sent would hold the conversation again every turn. Capture stores each call as a delta on the turn it
extends (`gateway.capture.sequences`), and keeps of it only what cannot be derived, token ids as 16-bit (or
32-bit) integers and logprobs as float32 (`gateway.capture.codec`). Once the records are written, the bench
reads them back and compares:

- **stored**: the bytes the episode's records store (`stored_bytes`, what metering bills: their JSON columns
  as written and their binary ones, and the episode's base settings once);
- **the final sequence, once**: the last call as one record of its own, whole (every message, the whole
  prompt's ids, its sampled ids, its answer and settings), encoded as records are stored, plus a float32
  logprob for every token the episode sampled before it (what training on the final sequence needs). This
  is the baseline of the issue's aim (stored at most 1.2 times it); the same in JSON is shown beside it;
- **every call whole, in JSON**: what storing each request as sent, as the old form did, would cost.

`python -m bench.episode_bytes [--quick]` prints the report and the ratios: token ids stored over the
final sequence's (each id is stored once: 1.00 without segment breaks), and bytes stored over the final
sequence kept once.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import orjson

from bench.common import Options, free_port, ratio
from bench.stack import Process, Services, bench_settings, make_tenant, start_gateway
from tunegate.role_processes import EngineProcess

logger = logging.getLogger(__name__)

TURNS = 32


def _conversation(client: Any, episode: str, turns: int) -> None:
    messages: list[Any] = [{"role": "system", "content": "You are a helpful assistant. Keep answers short."}]
    for turn in range(turns):
        messages.append({"role": "user", "content": f"What is {turn} + {turn + 1}?"})
        reply = client.chat.completions.create(
            model="tiny-chat",
            messages=messages,
            max_tokens=8,
            temperature=1.0,
            seed=turn,
            extra_headers={"X-Episode-Id": episode},
        )
        messages.append(reply.choices[0].message.model_dump(exclude_none=True))


async def _measure(database_url: str, org_id: str, episode: str, turns: int) -> dict[str, Any]:
    from gateway.capture import codec, store
    from gateway.capture.sequences import rebuild
    from gateway.db import create_pool

    pool = await create_pool(database_url, max_size=1)
    try:
        deadline = time.monotonic() + 60
        while True:
            records = await store.episode_records(pool, org_id=org_id, episode_id=episode)
            if len(records) >= turns or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        base = await pool.fetchval(
            "SELECT settings FROM capture_request_bases WHERE organization_id = $1 AND episode_id = $2",
            org_id,
            episode,
        )
        forms = await pool.fetch(
            "SELECT form, count(*) AS n FROM captured_completions"
            " WHERE organization_id = $1 AND episode_id = $2 GROUP BY form",
            org_id,
            episode,
        )
    finally:
        await pool.close()
    turns_whole = rebuild(records)
    whole = [
        dataclasses.replace(
            r,
            prompt_token_ids=turns_whole[r.id].prompt_ids,
            request={**r.request, "messages": turns_whole[r.id].messages},
            previous_id=None,
            prompt_prefix_tokens=0,
            messages_prefix=0,
            segment_break=None,
        )
        for r in records
    ]
    last = whole[-1]
    sampled = sum(len(r.logprobs[0]) if r.logprobs else 0 for r in records)
    last_sampled = len(last.logprobs[0]) if last.logprobs else 0
    # The final sequence once, in the encoding records are stored in: the last call as one record of its own
    # (form 1, whole: every message, the whole prompt's ids, its answer and settings), plus a float32 logprob
    # for every token the episode sampled before it.
    final_once = store.stored_bytes(last) + 4 * (sampled - last_sampled)
    by_id = {r.id: r for r in records}
    by_field: dict[str, int] = {}
    for r in records:
        previous = by_id.get(r.previous_id) if r.previous_id is not None else None
        answer = codec.answer_of(previous.response) if previous is not None else None
        values, _ = codec.encode(r, base=base, previous_answer=answer)
        for name, value in values.items():
            if name in codec.JSON_COLUMNS or name in codec.BINARY_COLUMNS:
                by_field[name] = by_field.get(name, 0) + len(value or "")
    by_field["episode base settings"] = len(orjson.dumps(base)) if base is not None else 0
    stored = sum(r.stored_bytes for r in records)
    whole_json = sum(_json_bytes(r) for r in whole)
    ids_stored = sum(
        len(r.prompt_token_ids or []) + len((r.completion_token_ids or [[]])[0]) for r in records
    )
    final_tokens = len(turns_whole[last.id].sequence or [])
    return {
        "turns": len(records),
        "forms": {int(f["form"]): int(f["n"]) for f in forms},
        "token_ids_stored": ids_stored,
        "token_ids_over_final": ratio(ids_stored, final_tokens),
        "breaks": sum(r.segment_break is not None for r in records),
        "final_tokens": final_tokens,
        "stored_bytes": stored,
        "final_once_bytes": final_once,
        "final_once_json_bytes": _json_bytes(last)
        + sum(len(orjson.dumps(r.logprobs[0])) for r in records[:-1] if r.logprobs),
        "whole_records_json_bytes": whole_json,
        "stored_by_field": {k: v for k, v in by_field.items() if v},
        "stored_over_final": ratio(stored, final_once),
        "whole_over_final": ratio(whole_json, final_once),
    }


def _json_bytes(row: Any) -> int:
    """A record's bytes in the old form (migration 0018: every field as JSON)."""
    names = ("request", "response", "metadata", "prompt_token_ids", "completion_token_ids", "logprobs")
    return sum(len(orjson.dumps(getattr(row, n))) for n in (*names, "segment_break") if getattr(row, n))


def run(opts: Options) -> dict[str, Any]:
    import openai

    from trainer.tiny import make_tiny_model

    turns = 8 if opts.quick else TURNS
    work = opts.workdir / "episode_bytes"
    work.mkdir(parents=True, exist_ok=True)
    model = Path(make_tiny_model(opts.workdir / "tiny-chat"))
    services = Services.start(work, redis=True)
    procs: list[Process] = []
    try:
        engine = EngineProcess({"tiny-chat": model}, free_port(), work / "engine.log").wait_ready(120)
        procs.append(engine)
        settings = bench_settings(services, work / "data", upstreams=[engine.url], model_path=model)
        procs.append(start_gateway(settings, work / "gateway.log", None))
        url = f"http://127.0.0.1:{settings.port}"
        org_id, key = make_tenant(url, settings)
        assert settings.admin_key is not None
        admin = {"Authorization": f"Bearer {settings.admin_key.get_secret_value()}"}
        capture = f"{url}/v1/admin/organizations/{org_id}/capture"
        httpx.post(capture, json={"enabled": True}, headers=admin, timeout=30).raise_for_status()
        client = openai.OpenAI(base_url=url + "/v1", api_key=key, max_retries=0, timeout=120)
        episode = "bench-" + secrets.token_hex(4)
        _conversation(client, episode, turns)
        report = asyncio.run(_measure(services.database_url, org_id, episode, turns))
    finally:
        for proc in reversed(procs):
            proc.stop()
        services.stop()
    return report


def markdown(report: dict[str, Any]) -> list[str]:
    return [
        f"One episode of {report['turns']} turns with tiny-chat (each turn sends every message so far and a "
        f"new question; {report['final_tokens']} tokens in its final sequence; {report['breaks']} segment "
        "breaks), captured through the gateway and read back from the database.",
        "",
        "| | size | over the final sequence once |",
        "|---|---|---|",
        f"| token ids stored (prompt deltas and sampled ids) | {report['token_ids_stored']:,} ids "
        f"| {report['token_ids_over_final']:.2f} |",
        f"| bytes stored (`stored_bytes` of the episode's records) | {report['stored_bytes']:,} "
        f"| {report['stored_over_final']:.2f} |",
        f"| the final sequence once (the last call as one record of its own, whole, stored as records are, "
        f"and a float32 logprob for each token sampled before it) | {report['final_once_bytes']:,} | 1.00 |",
        f"| the same in JSON (the old form) | {report['final_once_json_bytes']:,} "
        f"| {report['final_once_json_bytes'] / report['final_once_bytes']:.2f} |",
        f"| every call stored whole, in JSON (each request as sent) | {report['whole_records_json_bytes']:,} "
        f"| {report['whole_over_final']:.2f} |",
        "",
        "Bytes stored by column: "
        + ", ".join(f"{name} {size:,}" for name, size in report["stored_by_field"].items())
        + ".",
    ]


if __name__ == "__main__":
    import argparse
    import json

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    result = run(Options(quick=args.quick))
    print(json.dumps(result, indent=2))
    print("\n".join(markdown(result)))

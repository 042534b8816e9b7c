"""Stored bytes of a captured episode: what its calls cost to keep against its final sequence kept once.

An agent holds one conversation of `TURNS` turns with `tiny-chat` through the gateway (an embedded engine
behind it, capture on for its organisation, the episode named by `X-Episode-Id`): each turn sends every
message so far plus a new question, as agents do, so the prompts grow and a record of each call as it was
sent would hold the conversation again every turn. Capture stores each call as a delta on the turn it
extends (`gateway.capture.sequences`). Once the records are written, the bench reads them back and compares:

- **stored**: the bytes the episode's records store (`stored_bytes`: their JSON fields as written: request,
  response, metadata, prompt and completion token ids, log-probabilities);
- **final sequence, once**: the bytes of one record of the last call made whole (every message, the whole
  prompt's ids, its answer), plus the log-probabilities of every token the episode sampled (what training
  on the final sequence needs, and the only thing the records keep once per turn by design);
- **whole records**: the bytes had every call been stored whole (what storing each request as sent costs).

`python -m bench.episode_bytes [--quick]` prints the report and the ratios: token ids stored over the
final sequence's (each id is stored once: 1.00 without segment breaks), and bytes stored over the final
sequence kept once (the aim is at most 1.2; each call's own JSON, its settings and its answer, is what is
left above that).
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
    from gateway.capture import store
    from gateway.capture.sequences import rebuild
    from gateway.capture.store import stored_bytes
    from gateway.db import create_pool

    pool = await create_pool(database_url, max_size=1)
    try:
        deadline = time.monotonic() + 60
        while True:
            records = await store.episode_records(pool, org_id=org_id, episode_id=episode)
            if len(records) >= turns or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
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
        )
        for r in records
    ]
    last = whole[-1]
    all_logprobs = [lp for r in records for lp in (r.logprobs[0] if r.logprobs else [])]
    earlier_logprobs = all_logprobs[: len(all_logprobs) - len(last.logprobs[0] if last.logprobs else [])]
    import orjson

    final_once = stored_bytes(last) + len(orjson.dumps(earlier_logprobs))
    fields: tuple[str, ...] = ("request", "response", "metadata", "prompt_token_ids")
    fields += ("completion_token_ids", "logprobs", "segment_break")
    by_field = {
        name: sum(len(orjson.dumps(getattr(r, name))) for r in records if getattr(r, name) is not None)
        for name in fields
    }
    stored = sum(r.stored_bytes for r in records)
    whole_bytes = sum(stored_bytes(r) for r in whole)
    ids_stored = sum(
        len(r.prompt_token_ids or []) + len((r.completion_token_ids or [[]])[0]) for r in records
    )
    final_tokens = len(turns_whole[last.id].sequence or [])
    return {
        "turns": len(records),
        "token_ids_stored": ids_stored,
        "token_ids_over_final": ratio(ids_stored, final_tokens),
        "breaks": sum(r.segment_break is not None for r in records),
        "final_tokens": final_tokens,
        "stored_bytes": stored,
        "final_once_bytes": final_once,
        "whole_records_bytes": whole_bytes,
        "stored_by_field": by_field,
        "stored_over_final": ratio(stored, final_once),
        "whole_over_final": ratio(whole_bytes, final_once),
    }


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
        f"| bytes stored (deltas on the turn each call extends) | {report['stored_bytes']:,} "
        f"| {report['stored_over_final']:.2f} |",
        f"| the final sequence once (the last call whole, and every sampled token's logprob) "
        f"| {report['final_once_bytes']:,} | 1.00 |",
        f"| every call stored whole, as sent | {report['whole_records_bytes']:,} "
        f"| {report['whole_over_final']:.2f} |",
        "",
        "Bytes by field: "
        + ", ".join(f"{name} {size:,}" for name, size in report["stored_by_field"].items())
        + ". Each token id is stored once; what a call adds beyond its tokens is its own JSON (the request's "
        "settings and new messages, the answer as the client saw it, the sampled tokens' logprobs).",
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

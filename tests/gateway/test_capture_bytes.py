"""Stored bytes of capture: records kept compactly (`gateway.capture.codec`) read back exactly as they were
captured, rows of the old form (migration 0018) still read, and the bytes an organisation keeps are metered
over time, shown by the usage and costs APIs and billed to Stripe (the real `stripe` SDK against the
stand-in of `tests.gateway.test_billing`) while another organisation sees none of it."""

from __future__ import annotations

import asyncio
import dataclasses
import math
import secrets
import time
from collections.abc import Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import orjson
import pytest

from gateway.billing.outbox import run_billing
from gateway.capture import codec, store
from gateway.capture.store import CapturedRow
from gateway.db import create_pool
from gateway.settings import Settings
from tests.support.capture import capture_on, eventually
from tests.support.data import BASE
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant
from tests.support.stripe import StripeStandIn, serve_stripe

gw = gateway_fixture("capture-bytes")

STORAGE_EVENT = "tg_test_capture_byte_hours"
EPISODE_TURNS = 4


# ---- the codec, alone -------------------------------------------------------------------------------------
def _row(**kw: Any) -> CapturedRow:
    created = datetime(2026, 12, 3, 12, 0, 0, 700_000, tzinfo=UTC)
    response = {
        "id": "chatcmpl-1",
        "object": "chat.completion",
        "created": int(created.timestamp()) + 1,
        "model": "my-model",
        "system_fingerprint": "tiny-chat:v3",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Four.", "refusal": None},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12},
    }
    values: dict[str, Any] = {
        "organization_id": "org-1",
        "id": "chatcmpl-1",
        "api_key_id": "key-1",
        "episode_id": "ep-1",
        "parent_episode_id": None,
        "stored": True,
        "streamed": False,
        "model": "my-model",
        "base_model": "tiny-chat",
        "served_version": "tiny-chat:v3",
        "request": {"model": "my-model", "messages": [{"role": "user", "content": "2+2?"}], "seed": 3},
        "response": response,
        "metadata": {"task": "t1"},
        "prompt_token_ids": [1, 127, 128, 300, 70_000],
        "completion_token_ids": [[5, 6, 7]],
        "logprobs": [[-0.5, -1.25, -0.0078125]],
        "finish_reason": "stop",
        "prompt_tokens": 9,
        "completion_tokens": 3,
        "latency_ms": 12,
        "status": 200,
        "created_at": created,
        "expires_at": None,
    }
    values.update(kw)
    return CapturedRow(**values)


def _read_back(
    row: CapturedRow,
    *,
    base: dict[str, Any] | None = None,
    previous: CapturedRow | None = None,
    previous_gone: bool = False,
) -> tuple[CapturedRow, int]:
    """`row` written in form 1 and read back (the JSON columns through JSON, as PostgreSQL gives them);
    `previous_gone`: the turn it extends is no longer there when it is read."""
    answer = codec.answer_of(previous.response) if previous is not None else None
    values, size = codec.encode(row, base=base, previous_answer=answer)
    record = {f.name: getattr(row, f.name) for f in dataclasses.fields(row)}
    for name in codec.JSON_COLUMNS:
        record[name] = orjson.loads(values[name]) if values[name] is not None else None
    for name in ("form", "derived", *codec.BINARY_COLUMNS):
        record[name] = values[name]
    record["request_base"] = base
    record["previous_response"] = (
        orjson.loads(codec.encode(previous)[0]["response"])
        if previous is not None and not previous_gone
        else None
    )
    return store.row_of(record), size


def _json_bytes(row: CapturedRow) -> int:
    """What the record took in the old form: every field as JSON."""
    names = ("request", "response", "metadata", "prompt_token_ids", "completion_token_ids", "logprobs")
    return sum(len(orjson.dumps(getattr(row, n))) for n in (*names, "segment_break") if getattr(row, n))


def test_every_field_reads_back_as_it_was_written() -> None:
    plain = _row()
    back, size = _read_back(plain)
    assert back == dataclasses.replace(plain)
    assert size < _json_bytes(plain) / 2
    # What no column gives back is kept as it is: an odd answer, ids that are not token ids, odd settings.
    odd_response = {
        **plain.response,
        "created": 17,
        "usage": {"prompt_tokens": 9, "completion_tokens": 3, "total_tokens": 12, "details": {"x": 1}},
        "service_tier": "default",
        "choices": [
            {**plain.response["choices"][0], "logprobs": {"content": [{"token": "F", "logprob": -0.5}]}},
            {
                "index": 1,
                "message": {"role": "assistant", "content": None, "tool_calls": [{"id": "c1"}]},
                "finish_reason": "tool_calls",
                "logprobs": None,
            },
        ],
    }
    odd = _row(
        response=odd_response,
        request={"model": "other", "messages": "not a list", "~absent": 1, "seed": 3},
        prompt_token_ids=[-1, 2],
        completion_token_ids=[[1, 2], [], [3]],
        logprobs=[[-0.5], [], [-0.25]],
        segment_break={"reason": "prompt_diverged", "previous_id": "chatcmpl-0", "at_token": 3},
        previous_id="chatcmpl-0",
        metadata={},
    )
    assert _read_back(odd, base={"seed": 3, "temperature": 1.0})[0] == odd
    streamed = _row(response={**plain.response, "created": True}, logprobs=None, completion_token_ids=None)
    assert _read_back(streamed)[0] == streamed
    # A logprob comes back within float32.
    precise = _row(logprobs=[[-0.123456789012345, -7.000000001]])
    got = _read_back(precise)[0].logprobs
    assert got is not None and all(
        math.isclose(a, b, rel_tol=1e-7)
        for a, b in zip(got[0], precise.logprobs[0], strict=True)  # type: ignore[index]
    )


def test_a_later_turn_keeps_only_what_differs_from_its_episode_and_the_turn_it_extends() -> None:
    first = _row()
    answer = {"role": "assistant", "content": "Four."}
    messages = [*first.request["messages"], answer, {"role": "user", "content": "And 3+3?"}]
    whole = _row(
        id="chatcmpl-2",
        request={"model": "my-model", "messages": messages[2:], "seed": 4},
        response={**first.response, "id": "chatcmpl-2"},
        previous_id="chatcmpl-1",
        messages_prefix=1,
        segment_break={
            "reason": "prompt_diverged",
            "previous_id": "chatcmpl-0",
            "extends": "chatcmpl-1",
            "at_token": 7,
            "previous_tokens": 9,
        },
    )
    # (`messages` of a later turn are those after the turn it extends: `gateway.capture.sequences`.)
    whole = dataclasses.replace(whole, request={**whole.request, "messages": messages[1:]})
    base = codec.settings_of(first.request)
    back, size = _read_back(whole, base=base, previous=first)
    assert back == whole
    alone, alone_size = _read_back(whole)
    assert alone == whole and size < alone_size - len(orjson.dumps(answer))
    # Were the turn it extends gone unnoticed, the message would go with it (`store.purge_expired` keeps it
    # whole before that turn goes).
    gone, _ = _read_back(whole, base=base, previous=first, previous_gone=True)
    assert gone.request["messages"] == whole.request["messages"][1:]


# ---- through the gateway ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def org(gw_admin: Admin) -> Tenant:
    t = gw_admin.tenant("bytes-" + secrets.token_hex(3))
    capture_on(gw_admin, t, retention_days=7)
    return t


def _sql(database: str, sql: str, *args: Any) -> list[asyncpg.Record]:
    async def go() -> list[asyncpg.Record]:
        conn = await asyncpg.connect(database)
        try:
            return list(await conn.fetch(sql, *args))
        finally:
            await conn.close()

    return asyncio.run(go())


def _records(database: str, org_id: str, episode: str) -> list[CapturedRow]:
    async def go() -> list[CapturedRow]:
        pool = await create_pool(database, min_size=1, max_size=1)
        try:
            return await store.episode_records(pool, org_id=org_id, episode_id=episode)
        finally:
            await pool.close()

    return asyncio.run(go())


def _episode(t: Tenant, database: str, turns: int) -> tuple[str, list[Any], list[CapturedRow]]:
    """An agent's conversation of `turns` turns (each sends every message so far): its episode, the answers
    as the client saw them and the records once written."""
    episode = "ep-" + secrets.token_hex(4)
    messages: list[Any] = [{"role": "system", "content": "Be brief."}]
    answers = []
    for turn in range(turns):
        messages.append({"role": "user", "content": f"What is {turn} + 1?"})
        reply = t.client.chat.completions.create(
            model=BASE,
            messages=messages,
            max_tokens=6,
            temperature=1.0,
            seed=turn,
            extra_headers={"X-Episode-Id": episode},
        )
        answers.append(reply)
        messages.append({"role": "assistant", "content": reply.choices[0].message.content})
    records = eventually(
        lambda: (
            _records(database, t.org_id, episode)
            if len(_records(database, t.org_id, episode)) == turns
            else None
        ),
        "the episode written",
    )
    return episode, answers, records


def test_stored_completions_read_back_exactly_in_either_form(gw: GatewayServer, org: Tenant) -> None:
    database = gw.settings.database_url or ""
    episode, answers, records = _episode(org, database, EPISODE_TURNS)
    stored = _sql(
        database,
        "SELECT id, form, stored_bytes, prompt_token_ids, request FROM captured_completions"
        " WHERE organization_id = $1 AND episode_id = $2 ORDER BY seq",
        org.org_id,
        episode,
    )
    assert [r["form"] for r in stored] == [1] * EPISODE_TURNS
    assert all(r["prompt_token_ids"] is None for r in stored)  # the ids are in the binary column
    assert sum(r["stored_bytes"] for r in stored) < sum(_json_bytes(r) for r in records) / 2
    for reply, record in zip(answers, records, strict=True):
        got = org.client.chat.completions.retrieve(reply.id)
        seen = reply.model_dump()
        for name in ("id", "created", "model", "system_fingerprint", "usage", "choices"):
            assert getattr(got, name) == getattr(reply, name) or got.model_dump()[name] == seen[name], name
        assert reply.usage is not None and record.response["usage"] == reply.usage.model_dump(
            exclude_unset=True
        )
        assert record.request["seed"] == records.index(record)
    last = org.client.chat.completions.messages.list(answers[-1].id, limit=100)
    assert [m.content for m in last.data][-3:] == [
        f"What is {EPISODE_TURNS - 2} + 1?",
        answers[-2].choices[0].message.content,
        f"What is {EPISODE_TURNS - 1} + 1?",
    ]

    # A record of the old form (as migration 0018 wrote it) reads as the same call does in the new one.
    old_id = records[0].id + "-old"
    old = dataclasses.replace(records[0], id=old_id, response={**records[0].response, "id": old_id})
    columns = [f.name for f in dataclasses.fields(old)]
    json_columns = codec.JSON_COLUMNS
    values = [
        orjson.dumps(getattr(old, c)).decode()
        if c in json_columns and getattr(old, c) is not None
        else getattr(old, c)
        for c in columns
    ]
    placeholders = ", ".join(
        f"${i}::text::jsonb" if c in json_columns else f"${i}" for i, c in enumerate(columns, 1)
    )
    _sql(
        database, f"INSERT INTO captured_completions ({', '.join(columns)}) VALUES ({placeholders})", *values
    )
    assert _sql(database, "SELECT form FROM captured_completions WHERE id = $1", old_id)[0]["form"] == 0
    then = org.client.chat.completions.retrieve(old_id).model_dump()
    now = org.client.chat.completions.retrieve(records[0].id).model_dump()
    assert {**then, "id": None} == {**now, "id": None}


def test_a_turn_past_its_retention_leaves_the_later_turns_their_messages(
    gw: GatewayServer, org: Tenant
) -> None:
    """A later turn keeps no copy of the answer it repeats from the turn it extends; when that turn goes
    (past its retention, purged), the later one is written again with the message first."""
    database = gw.settings.database_url or ""
    episode, answers, records = _episode(org, database, 3)
    derived = _sql(
        database,
        "SELECT id, derived FROM captured_completions WHERE organization_id = $1 AND episode_id = $2"
        " ORDER BY seq",
        org.org_id,
        episode,
    )
    assert [bool(r["derived"] & codec.ANSWER_FIRST) for r in derived] == [False, True, True]
    _sql(
        database,
        "UPDATE captured_completions SET expires_at = now() - interval '1 s'"
        " WHERE organization_id = $1 AND id = $2",
        org.org_id,
        answers[0].id,
    )

    async def purge() -> None:
        pool = await create_pool(database, min_size=1, max_size=1)
        try:
            await store.purge_expired(pool, most=10_000)
        finally:
            await pool.close()

    asyncio.run(purge())
    assert not _sql(database, "SELECT 1 FROM captured_completions WHERE id = $1", answers[0].id)
    later = _records(database, org.org_id, episode)
    assert [r.id for r in later] == [records[1].id, records[2].id]
    # What each kept of its own is what it kept before: the second turn its messages after the first's.
    assert later[1].request == records[2].request
    assert later[0].request["messages"] == records[1].request["messages"]
    assert later[0].request["messages"][0] == {
        "role": "assistant",
        "content": answers[0].choices[0].message.content,
    }
    kept = org.client.chat.completions.retrieve(answers[1].id)
    assert kept.choices[0].message.content == answers[1].choices[0].message.content


# ---- metering and billing ---------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def standin() -> Iterator[tuple[StripeStandIn, str]]:
    with serve_stripe(fail_rate=0.0) as served:
        yield served


def _bill(gw: GatewayServer, base: str, tmp_path: Path) -> None:
    settings = Settings(
        data_dir=tmp_path,
        database_url=gw.settings.database_url,
        stripe_api_key="sk_test_standin",  # type: ignore[arg-type]
        stripe_api_base=base,
        stripe_max_retries=1,
        stripe_meter_capture_storage=STORAGE_EVENT,
        billing_window_s=600,
    )

    async def go() -> None:
        pool = await create_pool(settings.database_url or "", min_size=1, max_size=2)
        try:
            await run_billing(pool, settings)
        finally:
            await pool.close()

    asyncio.run(go())


def _kept(database: str, org_id: str) -> tuple[int, int]:
    """(the org's live records' stored bytes, the bytes metering counts for it)."""
    live = _sql(
        database,
        "SELECT coalesce(sum(stored_bytes), 0)::bigint AS b FROM captured_completions"
        " WHERE organization_id = $1 AND (expires_at IS NULL OR expires_at > now())",
        org_id,
    )[0]["b"]
    counted = _sql(database, "SELECT bytes FROM capture_storage WHERE organization_id = $1", org_id)
    return int(live), int(counted[0]["bytes"]) if counted else 0


def _pass_time(database: str, org_id: str, seconds: int) -> None:
    """Move the org's clock: all it did and keeps happened `seconds` earlier (its records made and expiring,
    its bytes last metered), so what it keeps now has been kept `seconds` longer."""
    _sql(
        database,
        "UPDATE captured_completions SET created_at = created_at - make_interval(secs => $2),"
        " expires_at = expires_at - make_interval(secs => $2) WHERE organization_id = $1",
        org_id,
        seconds,
    )
    _sql(
        database,
        "UPDATE capture_storage SET metered_at = metered_at - make_interval(secs => $2)"
        " WHERE organization_id = $1",
        org_id,
        seconds,
    )


def _usage(t: Tenant, route: str, **params: Any) -> dict[str, Any]:
    resp = httpx.get(
        f"{t.client.base_url}organization/{route}",
        params={"start_time": int(time.time()) - 86_400, "bucket_width": "1d", "limit": 2, **params},
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=30,
    )
    assert resp.status_code == 200, resp.text
    return dict(resp.json())


def _byte_seconds(page: dict[str, Any]) -> int:
    return sum(r["byte_seconds"] for b in page["data"] for r in b["results"])


def test_kept_bytes_are_metered_shown_and_billed_to_their_organisation_only(
    gw: GatewayServer, gw_admin: Admin, standin: tuple[StripeStandIn, str], tmp_path: Path
) -> None:
    database = gw.settings.database_url or ""
    stand, base = standin
    a = gw_admin.tenant("kept-a-" + secrets.token_hex(3))
    b = gw_admin.tenant("kept-b-" + secrets.token_hex(3))
    customers = {}
    for t in (a, b):
        capture_on(gw_admin, t, retention_days=30)
        customers[t.org_id] = "cus_" + secrets.token_hex(6)
        resp = gw_admin.http.post(
            f"/v1/admin/organizations/{t.org_id}/billing", json={"stripe_customer_id": customers[t.org_id]}
        )
        assert resp.status_code == 200, resp.text
    _, answers, records = _episode(a, database, 3)
    live, counted = _kept(database, a.org_id)
    assert live == counted > 0 and live >= sum(r.stored_bytes for r in records)

    _pass_time(database, a.org_id, 7200)
    _bill(gw, base, tmp_path)
    first = _byte_seconds(_usage(a, "usage/capture_storage"))
    assert live * 7200 <= first <= live * (7200 + 120)

    # A record deleted and one past its retention stop counting; what is left keeps counting.
    a.client.chat.completions.delete(answers[-1].id)
    _sql(
        database,
        "UPDATE captured_completions SET expires_at = now() - interval '1 s'"
        " WHERE organization_id = $1 AND id = $2",
        a.org_id,
        answers[0].id,
    )
    left, counted = _kept(database, a.org_id)
    assert left == counted and 0 < left < live
    _pass_time(database, a.org_id, 3600)
    _bill(gw, base, tmp_path)
    total = _byte_seconds(_usage(a, "usage/capture_storage"))
    assert first + left * 3600 <= total <= first + left * 3600 + live * 120

    costs = _usage(a, "costs", **{"group_by[]": "line_item"})
    items = [r for bucket in costs["data"] for r in bucket["results"] if r["line_item"] == "capture storage"]
    price = gw.settings.capture_storage_per_gb_month
    assert items and math.isclose(
        sum(r["quantity"] for r in items), total / (1e9 * 30 * 86_400), rel_tol=1e-9
    )
    assert math.isclose(
        sum(r["amount"]["value"] for r in items), total / (1e9 * 30 * 86_400) * price, rel_tol=1e-9
    )

    billed = stand.totals().get((customers[a.org_id], STORAGE_EVENT), 0)
    events = sum(1 for e in stand.events.values() if e["customer"] == customers[a.org_id])
    assert abs(billed - total / 3600) <= events
    assert billed > 0

    # The other organisation keeps nothing, is shown nothing and billed nothing.
    assert _byte_seconds(_usage(b, "usage/capture_storage")) == 0
    assert _kept(database, b.org_id) == (0, 0)
    assert not [e for e in stand.events.values() if e["customer"] == customers[b.org_id]]
    nothing = _usage(b, "costs", **{"group_by[]": "line_item"})
    assert all(bucket["results"] == [] for bucket in nothing["data"])
    # And cannot read the first one's: its key reads its own organisation whatever it names.
    named = _usage(b, "usage/capture_storage", organization_id=a.org_id)
    assert _byte_seconds(named) == 0

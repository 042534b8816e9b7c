"""Capture on the chat path and OpenAI's stored-completions API, through the official `openai` SDK against a
gateway whose engine serves tiny-chat: off by default (nothing stored, `store: true` or not), on per
organisation or per key; what the client sees is what it sees without capture, streamed or not; the stored
token ids are the sampled ones (the same streamed and not, and they decode to the answer); every route is
scoped to the organisation; bad metadata is a 400 naming it. The last two tests do the same with vLLM as
the engine, for chat and for text completions of an episode (skipped where vLLM is not installed)."""

from __future__ import annotations

import json
import secrets
from collections.abc import Callable
from typing import Any

import httpx
import openai
import pytest

from tests.support.capture import capture_on, eventually
from tests.support.data import BASE, MESSAGES, TOOLS
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant, admin_of
from tests.support.vllm import vllm_gateway_fixture

gw = gateway_fixture("capture")
vllm_gw = vllm_gateway_fixture("capture-vllm")

ASK: Any = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2 + 3?"}]
SEEDED: dict[str, Any] = {"model": BASE, "messages": ASK, "max_tokens": 6, "temperature": 1.0, "seed": 1234}
"""A sampled (not greedy) request made repeatable by its seed."""
REQUEST_FIELDS = ("seed", "temperature", "top_p", "presence_penalty", "frequency_penalty", "tools")
STORED_KEYS = {
    "id",
    "object",
    "created",
    "model",
    "choices",
    "usage",
    "system_fingerprint",
    "service_tier",
    "metadata",
    "input_user",
    "tool_choice",
    "response_format",
    *REQUEST_FIELDS,
}
CAPTURE_KEYS = {
    "api_key_id",
    "episode_id",
    "parent_episode_id",
    "stored",
    "streamed",
    "base_model",
    "served_version",
    "request",
    "prompt_token_ids",
    "choices",
    "previous_id",
    "segment_break",
    "stored_bytes",
    "cost_usd",
    "finish_reason",
    "latency_ms",
    "status",
    "expires_at",
}


def _stored(t: Tenant, completion_id: str) -> dict[str, Any]:
    """The stored completion `completion_id`, as raw JSON, once written."""

    def probe() -> dict[str, Any] | None:
        resp = httpx.get(
            f"{t.client.base_url}chat/completions/{completion_id}",
            headers={"Authorization": f"Bearer {t.key}"},
            timeout=30,
        )
        return resp.json() if resp.status_code == 200 else None

    return eventually(probe, f"{completion_id} stored")


@pytest.fixture(scope="module")
def capturing(gw_admin: Admin) -> Tenant:
    """An organisation with capture on (records kept 7 days)."""
    t = gw_admin.tenant("capture-" + secrets.token_hex(3))
    assert capture_on(gw_admin, t, retention_days=7)["retention_days"] == 7
    return t


@pytest.fixture(scope="module")
def tokenizer(gw: GatewayServer) -> Any:
    """The base model's tokenizer."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(gw.settings.base_model_path(BASE)))


IDS = ("logprobs", "token_ids")
"""What capture asks the engine for, which a client that did not ask must see as it would without it."""


def _without_ids(body: dict[str, Any]) -> dict[str, Any]:
    """An answer without what differs between two calls of the same request (its id and time)."""
    return {k: v for k, v in body.items() if k not in ("id", "created")}


def _chunks(t: Tenant, **kw: Any) -> list[dict[str, Any]]:
    with t.client.chat.completions.with_streaming_response.create(**SEEDED, stream=True, **kw) as resp:
        return [
            _without_ids(json.loads(line[6:])) for line in resp.iter_lines() if line.startswith("data: {")
        ]


# --------------------------------------------------------------------------------------------- the switch
def test_capture_is_off_by_default_and_admin_switches_it(gw_admin: Admin, capturing: Tenant) -> None:
    off = gw_admin.tenant("capture-off-" + secrets.token_hex(3))
    shown = gw_admin.http.get(f"/v1/admin/organizations/{off.org_id}/capture").json()
    assert shown == {
        "object": "capture_setting",
        "organization_id": off.org_id,
        "api_key_id": None,
        "enabled": False,
        "retention_days": None,
        "updated_at": None,
    }
    # store: true, metadata and an episode header on an organisation without capture: nothing is kept, and
    # metadata is not even looked at (the request path does nothing for capture there).
    ignored = off.client.chat.completions.create(
        **SEEDED, store=True, metadata={"k" * 80: "v"}, extra_headers={"X-Episode-Id": "ep-off"}
    )
    # A call captured after it: once that one is written, the earlier one would have been written too.
    later = capturing.client.chat.completions.create(**SEEDED, store=True)
    _stored(capturing, later.id)
    assert off.client.chat.completions.list().data == []
    with pytest.raises(openai.NotFoundError):
        off.client.chat.completions.retrieve(ignored.id)

    # A key of its own turns capture on for that key alone, in an organisation with capture off.
    made = gw_admin.http.post(f"/v1/admin/organizations/{off.org_id}/api_keys", json={"name": "agent"}).json()
    resp = gw_admin.http.post(f"/v1/admin/api_keys/{made['id']}/capture", json={"enabled": True})
    setting = resp.json()
    assert resp.status_code == 200 and setting["api_key_id"] == made["id"] and setting["enabled"] is True
    assert setting["retention_days"] == 30 and isinstance(setting["updated_at"], int)
    agent = openai.OpenAI(base_url=str(off.client.base_url), api_key=made["key"], max_retries=0)
    by_agent = agent.chat.completions.create(**SEEDED, store=True)
    assert _stored(off, by_agent.id)["capture"]["api_key_id"] == made["id"]
    other = off.client.chat.completions.create(
        **SEEDED, store=True
    )  # the organisation's first key: still off
    marker = agent.chat.completions.create(**SEEDED, store=True)
    _stored(off, marker.id)
    assert [c.id for c in off.client.chat.completions.list()] == [by_agent.id, marker.id]
    assert other.id not in {c.id for c in off.client.chat.completions.list()}

    # Unknown organisations and keys are 404; a bad setting is a 400 naming the field.
    assert (
        gw_admin.http.post("/v1/admin/organizations/org-nope/capture", json={"enabled": True}).status_code
        == 404
    )
    assert gw_admin.http.get("/v1/admin/api_keys/key-nope/capture").status_code == 404
    bad = gw_admin.http.post(
        f"/v1/admin/organizations/{off.org_id}/capture", json={"enabled": True, "retention_days": 0}
    )
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "retention_days"


# ------------------------------------------------------------------------------- the stored-completions API
def test_stored_completions_api_through_the_sdk(capturing: Tenant, tokenizer: Any) -> None:
    client = capturing.client
    tag = secrets.token_hex(4)
    made = client.chat.completions.create(**SEEDED, store=True, metadata={"run": tag, "kind": "first"})
    second = client.chat.completions.create(**SEEDED, store=True, metadata={"run": tag, "kind": "second"})
    _stored(capturing, made.id)
    _stored(capturing, second.id)

    # list: filtered by metadata and model, ascending by default, paged with after/limit/order.
    page = client.chat.completions.list(metadata={"run": tag})
    assert [c.id for c in page.data] == [made.id, second.id] and page.has_more is False
    assert [c.id for c in client.chat.completions.list(metadata={"run": tag}, order="desc")] == [
        second.id,
        made.id,
    ]
    assert [c.id for c in client.chat.completions.list(metadata={"run": tag, "kind": "second"})] == [
        second.id
    ]
    first_page = client.chat.completions.list(metadata={"run": tag}, limit=1)
    assert [c.id for c in first_page.data] == [made.id] and first_page.has_more is True
    rest = client.chat.completions.list(metadata={"run": tag}, limit=1, after=made.id)
    assert [c.id for c in rest.data] == [second.id] and rest.has_more is False
    assert client.chat.completions.list(metadata={"run": tag}, after=second.id).data == []
    assert client.chat.completions.list(metadata={"run": tag}, model="ft:other").data == []
    assert len(client.chat.completions.list(metadata={"run": tag}, model=BASE).data) == 2
    raw = httpx.get(
        f"{client.base_url}chat/completions",
        params={"metadata[run]": tag, "limit": 1},
        headers={"Authorization": f"Bearer {capturing.key}"},
    ).json()
    assert set(raw) == {"object", "data", "has_more", "first_id", "last_id"}
    assert raw["object"] == "list" and raw["first_id"] == raw["last_id"] == made.id
    assert set(raw["data"][0]) == STORED_KEYS  # items of a list carry no capture detail

    # retrieve: the answer the client had, its metadata and the request's settings; OpenAI's shape.
    got = client.chat.completions.retrieve(made.id)
    assert got.id == made.id and got.object == "chat.completion" and got.model == BASE
    assert got.choices[0].message.content == made.choices[0].message.content
    assert got.choices[0].finish_reason == made.choices[0].finish_reason
    assert got.usage == made.usage and got.system_fingerprint == made.system_fingerprint
    stored = _stored(capturing, made.id)
    assert set(stored) == STORED_KEYS | {"capture"} and set(stored["capture"]) == CAPTURE_KEYS
    assert stored["metadata"] == {"run": tag, "kind": "first"}
    assert stored["seed"] == 1234 and stored["temperature"] == 1.0 and stored["tools"] is None
    assert stored["choices"] == made.to_dict()["choices"]
    capture = stored["capture"]
    assert capture["stored"] is True and capture["streamed"] is False and capture["episode_id"] is None
    assert capture["served_version"] == BASE == capture["base_model"] and capture["status"] == 200
    assert capture["request"]["messages"] == ASK and capture["request"]["max_tokens"] == 6
    assert "metadata" not in capture["request"]
    assert capture["expires_at"] - made.created == pytest.approx(7 * 86400, abs=120)
    assert capture["finish_reason"] == made.choices[0].finish_reason

    # The ids: the prompt as the engine saw it, the sampled ones decoding to the answer, one logprob each.
    prompt_ids = tokenizer.apply_chat_template(
        ASK, add_generation_prompt=True, tokenize=True, return_dict=True
    )
    assert capture["prompt_token_ids"] == list(prompt_ids["input_ids"])
    ids = capture["choices"][0]["token_ids"]
    assert len(ids) == made.usage.completion_tokens and len(capture["choices"][0]["logprobs"]) == len(ids)
    assert all(lp <= 0 for lp in capture["choices"][0]["logprobs"])
    assert tokenizer.decode(ids, skip_special_tokens=True) == made.choices[0].message.content

    # update: metadata only, replaced whole; bad metadata is a 400 naming it.
    updated = client.chat.completions.update(made.id, metadata={"run": tag, "kind": "relabelled"})
    assert updated.id == made.id and updated.metadata == {"run": tag, "kind": "relabelled"}
    assert [c.id for c in client.chat.completions.list(metadata={"kind": "relabelled", "run": tag})] == [
        made.id
    ]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.update(made.id, metadata={str(i): "v" for i in range(17)})
    assert info.value.param == "metadata"

    # messages: the request's, ids <completion id>-<index>, paged.
    messages = client.chat.completions.messages.list(made.id)
    assert [(m.id, m.role, m.content) for m in messages.data] == [
        (f"{made.id}-0", "system", "Be brief."),
        (f"{made.id}-1", "user", "What is 2 + 3?"),
    ]
    assert messages.data[0].model_dump(exclude_none=True) == {
        "id": f"{made.id}-0",
        "role": "system",
        "content": "Be brief.",
    }
    assert [m.id for m in client.chat.completions.messages.list(made.id, order="desc", limit=1).data] == [
        f"{made.id}-1"
    ]
    assert [m.id for m in client.chat.completions.messages.list(made.id, after=f"{made.id}-0").data] == [
        f"{made.id}-1"
    ]

    # delete: OpenAI's deleted object, then 404 everywhere.
    gone = client.chat.completions.delete(made.id)
    assert gone.model_dump() == {"id": made.id, "object": "chat.completion.deleted", "deleted": True}
    with pytest.raises(openai.NotFoundError) as missing:
        client.chat.completions.retrieve(made.id)
    assert missing.value.body == {
        "message": f"No chat completion found with id '{made.id}'.",
        "type": "invalid_request_error",
        "param": "completion_id",
        "code": "not_found",
    }
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.delete(made.id)
    assert [c.id for c in client.chat.completions.list(metadata={"run": tag})] == [second.id]


def test_bad_metadata_and_episode_headers_are_400s_naming_them(capturing: Tenant) -> None:
    create = capturing.client.chat.completions.create
    cases: list[tuple[dict[str, Any], str]] = [
        ({"metadata": {str(i): "v" for i in range(17)}}, "metadata"),
        ({"metadata": {"k" * 65: "v"}}, "metadata"),
        ({"metadata": {"k": "v" * 513}}, "metadata.k"),
        ({"metadata": {"k": 1}}, "metadata.k"),
        ({"extra_headers": {"X-Episode-Id": "e" * 257}}, "x-episode-id"),
    ]
    for kw, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            create(**SEEDED, store=True, **kw)
        assert info.value.param == param and info.value.code == "invalid_value", kw
    with pytest.raises(openai.BadRequestError) as bad_store:
        create(**SEEDED, extra_body={"store": "yes"})
    assert bad_store.value.param == "store"


# ------------------------------------------------------------------------------------- fidelity and streams
def test_the_client_sees_what_it_sees_without_capture(gw_admin: Admin, capturing: Tenant) -> None:
    plain = gw_admin.tenant("capture-plain-" + secrets.token_hex(3))
    without = plain.client.chat.completions.create(**SEEDED).to_dict()
    captured = capturing.client.chat.completions.create(**SEEDED, store=True).to_dict()
    assert "prompt_token_ids" not in captured and "token_ids" not in captured["choices"][0]
    assert captured["choices"][0]["logprobs"] is None
    assert _without_ids(captured) == _without_ids(without)
    # Streamed: chunk for chunk the same, token ids and log-probabilities taken out again.
    usage = {"stream_options": {"include_usage": True}}
    assert _chunks(capturing, store=True, **usage) == _chunks(plain, **usage)
    assert _chunks(capturing, store=True) == _chunks(plain)
    # A client that asks for them gets them (as vLLM gives them).
    asked = capturing.client.chat.completions.create(
        **SEEDED, store=True, logprobs=True, extra_body={"return_token_ids": True}
    )
    extra = asked.model_extra or {}
    assert isinstance(extra.get("prompt_token_ids"), list) and asked.choices[0].logprobs is not None
    stored = _stored(capturing, asked.id)
    assert stored["choices"][0]["logprobs"] is not None
    assert stored["capture"]["choices"][0]["token_ids"] == (asked.choices[0].model_extra or {})["token_ids"]


def test_streamed_and_whole_answers_store_the_same_ids(capturing: Tenant, tokenizer: Any) -> None:
    episode = "ep-" + secrets.token_hex(4)
    whole = capturing.client.chat.completions.create(
        **SEEDED, extra_headers={"X-Episode-Id": episode, "X-Parent-Episode-Id": "ep-root"}
    )
    pieces = list(
        capturing.client.chat.completions.create(
            **SEEDED, stream=True, extra_headers={"X-Session-Id": episode, "x-parent-session-id": "ep-root"}
        )
    )
    streamed_id = pieces[0].id
    text = "".join(p.choices[0].delta.content or "" for p in pieces if p.choices)
    assert text == whole.choices[0].message.content

    a, b = _stored(capturing, whole.id), _stored(capturing, streamed_id)
    assert a["capture"]["streamed"] is False and b["capture"]["streamed"] is True
    for row in (a, b):  # captured by the episode headers alone (no store: true), under either name
        assert row["capture"]["episode_id"] == episode and row["capture"]["parent_episode_id"] == "ep-root"
        assert row["capture"]["stored"] is False
    assert a["capture"]["prompt_token_ids"] == b["capture"]["prompt_token_ids"]
    assert a["capture"]["choices"] == b["capture"]["choices"]  # ids and log-probabilities
    ids = b["capture"]["choices"][0]["token_ids"]
    assert ids and tokenizer.decode(ids, skip_special_tokens=True) == text
    # The stream is stored as the whole answer it amounts to.
    assert b["choices"] == a["choices"] and b["object"] == "chat.completion"
    assert b["usage"] == a["usage"]

    # With tools (the engine's tool-call parsing), the call's tokens too.
    tooled = {**SEEDED, "messages": MESSAGES, "tools": TOOLS, "tool_choice": "required", "max_tokens": 24}
    call = capturing.client.chat.completions.create(**tooled, store=True)
    call_pieces = list(capturing.client.chat.completions.create(**tooled, store=True, stream=True))
    c, d = _stored(capturing, call.id), _stored(capturing, call_pieces[0].id)
    assert c["capture"]["choices"][0]["token_ids"] == d["capture"]["choices"][0]["token_ids"] != []
    assert c["capture"]["prompt_token_ids"] == d["capture"]["prompt_token_ids"]
    asked = call.to_dict()["choices"][0]["message"]["tool_calls"]
    assert [x["function"]["name"] for x in asked] == ["get_weather"]
    for stored in (c, d):
        found = stored["choices"][0]["message"]["tool_calls"]
        assert [x["function"] for x in found] == [x["function"] for x in asked]
    assert c["choices"][0]["finish_reason"] == d["choices"][0]["finish_reason"] == "tool_calls"

    # Agent Lightning's headers: the attempt is the episode, its rollout the parent.
    lightning = capturing.client.chat.completions.create(
        **SEEDED, extra_headers={"x-rollout-id": "ro-1", "x-attempt-id": "at-1"}
    )
    capture = _stored(capturing, lightning.id)["capture"]
    assert (capture["episode_id"], capture["parent_episode_id"]) == ("at-1", "ro-1")


# ------------------------------------------------------------------------------------------------- tenants
def test_another_organisations_ids_are_404_on_every_route(gw_admin: Admin, capturing: Tenant) -> None:
    mine = capturing.client.chat.completions.create(**SEEDED, store=True, metadata={"owner": "me"})
    _stored(capturing, mine.id)
    other = gw_admin.tenant("capture-other-" + secrets.token_hex(3))
    capture_on(gw_admin, other)
    c = other.client.chat.completions
    calls: list[Callable[[], Any]] = [
        lambda: c.retrieve(mine.id),
        lambda: c.update(mine.id, metadata={"owner": "them"}),
        lambda: c.messages.list(mine.id),
        lambda: c.delete(mine.id),
    ]
    for call in calls:
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body == {
            "message": f"No chat completion found with id '{mine.id}'.",
            "type": "invalid_request_error",
            "param": "completion_id",
            "code": "not_found",
        }
    assert c.list(metadata={"owner": "me"}).data == []
    assert c.list(after=mine.id).data == []
    # Untouched for its owner.
    assert capturing.client.chat.completions.retrieve(mine.id).metadata == {"owner": "me"}


# ------------------------------------------------------------------------------------------------- vLLM
@pytest.mark.timeout(900)  # vLLM's start, when this module is the first to use it
def test_with_vllm_the_client_sees_the_same_and_ids_are_stored(
    vllm_gw: GatewayServer, tokenizer: Any
) -> None:
    admin = admin_of(vllm_gw)
    plain = admin.tenant("capture-vllm-plain-" + secrets.token_hex(3))
    captured = admin.tenant("capture-vllm-" + secrets.token_hex(3))
    capture_on(admin, captured)
    greedy = {**SEEDED, "temperature": 0}
    without = plain.client.chat.completions.create(**greedy).to_dict()
    made = captured.client.chat.completions.create(**greedy, store=True)
    # vLLM writes its token-id fields as null when not asked: so they stay, null, for the client.
    assert made.to_dict()["prompt_token_ids"] is None and made.to_dict()["choices"][0]["token_ids"] is None
    assert _without_ids(made.to_dict()) == _without_ids(without)

    def chunks(t: Tenant) -> list[dict[str, Any]]:
        with t.client.chat.completions.with_streaming_response.create(
            **greedy, stream=True, store=True
        ) as resp:
            return [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]

    # vLLM puts several tokens in one chunk when its reader lags (a busy machine), so the two streams are
    # compared by what they carry: the same fields in every chunk and choice, the same text and ending.
    def carried(stream: list[dict[str, Any]]) -> tuple[Any, ...]:
        fields = {frozenset(_without_ids(c)) for c in stream}
        choice_fields = {frozenset(ch) for c in stream for ch in c.get("choices") or []}
        deltas = [ch["delta"] for c in stream for ch in c.get("choices") or []]
        text = "".join(d.get("content") or "" for d in deltas)
        ends = [ch["finish_reason"] for c in stream for ch in c.get("choices") or [] if ch["finish_reason"]]
        asked = {(k, json.dumps(ch.get(k))) for c in stream for ch in c.get("choices") or [] for k in IDS}
        return fields, choice_fields, text, ends, asked, stream[-1].get("usage")

    seen = chunks(captured)
    assert carried(seen) == carried(chunks(plain))
    whole, streamed = _stored(captured, made.id), _stored(captured, seen[0]["id"])
    assert made.usage is not None
    assert whole["capture"]["prompt_token_ids"] == streamed["capture"]["prompt_token_ids"]
    assert len(whole["capture"]["prompt_token_ids"]) == made.usage.prompt_tokens
    ids = whole["capture"]["choices"][0]["token_ids"]
    assert ids == streamed["capture"]["choices"][0]["token_ids"] and len(ids) == made.usage.completion_tokens
    assert tokenizer.decode(ids, skip_special_tokens=True) == made.choices[0].message.content
    assert len(whole["capture"]["choices"][0]["logprobs"]) == len(ids)

    # vLLM's whole answer writes every field of its model (null ones too); the stream's is the answer it
    # amounts to, in OpenAI's fields.
    def essential(c: dict[str, Any]) -> tuple[Any, ...]:
        message = c["message"]
        return c["index"], message["role"], message["content"], message.get("tool_calls"), c["finish_reason"]

    assert [essential(c) for c in streamed["choices"]] == [essential(c) for c in whole["choices"]]
    counts = ("prompt_tokens", "completion_tokens", "total_tokens")
    assert [streamed["usage"][k] for k in counts] == [whole["usage"][k] for k in counts]


@pytest.mark.timeout(900)
def test_with_vllm_text_completions_of_an_episode_are_captured(
    vllm_gw: GatewayServer, tokenizer: Any
) -> None:
    admin = admin_of(vllm_gw)
    plain = admin.tenant("capture-vllm-text-plain-" + secrets.token_hex(3))
    captured = admin.tenant("capture-vllm-text-" + secrets.token_hex(3))
    capture_on(admin, captured)
    episode = "vllm-text-" + secrets.token_hex(4)
    ask: dict[str, Any] = {"model": BASE, "prompt": "2 + 3 =", "max_tokens": 6, "temperature": 0}
    made = captured.client.completions.create(**ask, extra_headers={"X-Episode-Id": episode})
    # vLLM writes its token-id fields as null when not asked: so they stay, null, for the client.
    assert _without_ids(made.to_dict()) == _without_ids(plain.client.completions.create(**ask).to_dict())
    with captured.client.completions.with_streaming_response.create(
        **ask, stream=True, extra_headers={"X-Episode-Id": episode}
    ) as resp:
        seen = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: {")]
    assert all(ch.get("token_ids") is None for c in seen for ch in c["choices"])
    text = "".join(ch["text"] for c in seen for ch in c["choices"])
    assert text == made.choices[0].text

    def export() -> dict[str, Any] | None:
        try:
            out: Any = captured.client.get(f"episodes/{episode}/export", cast_to=object)
        except openai.NotFoundError:  # not written yet
            return None
        return out if len(out["samples"]) == 2 else None

    samples = eventually(export, "both text completions written")["samples"]
    assert made.usage is not None
    for s in samples:  # the prompt's ids, then the sampled ones (masked), which decode to the text
        start = s["completion_mask"].index(1)
        assert (
            start == made.usage.prompt_tokens and len(s["input_ids"]) - start == made.usage.completion_tokens
        )
        assert tokenizer.decode(s["input_ids"][start:], skip_special_tokens=True) == text
        assert len([lp for lp in s["logprobs"] if lp is not None]) == made.usage.completion_tokens
    assert samples[0]["input_ids"] == samples[1]["input_ids"]

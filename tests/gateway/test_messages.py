"""Anthropic's Messages API (`POST /v1/messages`) through the official `anthropic` SDK against a gateway whose
engine serves tiny-chat: the answer is the chat path's (same greedy text, same usage) in Anthropic's shapes,
whole and streamed (`messages.stream` and the raw event sequence); a tool's round trip; the key as
`x-api-key` or a bearer token; a fine-tuned model, and another organisation's as 404; errors in Anthropic's
shape with the right status; metering through the usage API; capture of a call with an episode header. The
last test does it with vLLM as the engine (skipped where vLLM is not installed)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import anthropic
import httpx
import pytest

from tests.support.capture import eventually
from tests.support.data import BASE
from tests.support.engine import ft_model, make_lora_adapter
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant, admin_of
from tests.support.vllm import vllm_gateway_fixture

gw = gateway_fixture("messages", usage_flush_interval_s=0.3)
vllm_gw = vllm_gateway_fixture("messages-vllm")

SYSTEM = "Be brief."
QUESTION = "What is 2 + 3?"
CHAT: Any = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": QUESTION}]
ASK: Any = [{"role": "user", "content": QUESTION}]
TOOL: Any = {
    "name": "get_weather",
    "description": "Current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_TOOL: Any = {
    "type": "function",
    "function": {
        "name": TOOL["name"],
        "description": TOOL["description"],
        "parameters": TOOL["input_schema"],
    },
}
ASK_WEATHER = "What is the weather in Paris?"
GREEDY: Any = {"temperature": 0}
"""Greedy sampling (the SDK sends `temperature` only as an extra field now; the API still takes it)."""
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens"}


def _client(gateway: GatewayServer, t: Tenant) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=gateway.url, api_key=t.key, max_retries=0, timeout=120)


def _post(gateway: GatewayServer, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(f"{gateway.url}/v1/messages", json=body, headers=headers, timeout=120)


def _events(resp: httpx.Response) -> list[dict[str, Any]]:
    """The server-sent events of a stream, each checked to be named as its `type`."""
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/event-stream")
    events = []
    for block in resp.text.split("\n\n"):
        if not block.strip():
            continue
        name, data = block.split("\n")
        event = json.loads(data.removeprefix("data: "))
        assert name == "event: " + event["type"]
        events.append(event)
    return events


@pytest.fixture(scope="module")
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("messages-" + secrets.token_hex(3))


def _check_plain(gateway: GatewayServer, t: Tenant, model: str, most: int = 16) -> None:
    """A plain Messages call is the chat path's greedy answer in Anthropic's shape, exactly."""
    chat = t.client.chat.completions.create(model=model, messages=CHAT, max_tokens=most, temperature=0)
    text = chat.choices[0].message.content or ""
    body = {"model": model, "max_tokens": most, "system": SYSTEM, "messages": ASK, "temperature": 0}
    resp = _post(gateway, body, **{"x-api-key": t.key, "anthropic-version": "2023-06-01"})
    assert resp.status_code == 200, resp.text
    raw = resp.json()
    assert raw["id"].startswith("msg_")
    assert raw == {
        "id": raw["id"],
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [{"type": "text", "text": text}],
        "stop_reason": STOP_REASONS[chat.choices[0].finish_reason],
        "stop_sequence": None,
        "usage": {"input_tokens": chat.usage.prompt_tokens, "output_tokens": chat.usage.completion_tokens},  # type: ignore[union-attr]
    }
    # The SDK reads it as its own `Message`; a bearer token is a key as well.
    message = _client(gateway, t).messages.create(
        model=model,
        max_tokens=most,
        system=[{"type": "text", "text": SYSTEM}],
        messages=ASK,
        extra_body=GREEDY,
    )
    assert message.content[0].type == "text" and message.content[0].text == text
    assert message.usage.input_tokens == raw["usage"]["input_tokens"]
    bearer = _post(gateway, body, Authorization=f"Bearer {t.key}")
    assert bearer.status_code == 200 and bearer.json()["content"] == raw["content"]


def test_plain_message_is_the_chat_answer(gw: GatewayServer, org: Tenant) -> None:
    _check_plain(gw, org, BASE)


def _check_count(gateway: GatewayServer, t: Tenant) -> None:
    """`count_tokens` through the SDK: the input tokens the same request is then billed for, with tools
    too; an unknown model is Anthropic's 404."""
    client = _client(gateway, t)
    for tools in ([], [TOOL]):
        asked: Any = {"model": BASE, "system": SYSTEM, "messages": ASK, **({"tools": tools} if tools else {})}
        counted = client.messages.count_tokens(**asked)
        made = client.messages.create(**asked, max_tokens=2, extra_body=GREEDY)
        assert counted.input_tokens == made.usage.input_tokens > 0, tools
    with pytest.raises(anthropic.NotFoundError) as missing:
        client.messages.count_tokens(model="no-such-model", messages=ASK)
    assert missing.value.body["error"]["code"] == "model_not_found"  # type: ignore[index]


def test_count_tokens_is_what_the_message_is_billed_for(gw: GatewayServer, org: Tenant) -> None:
    _check_count(gw, org)


def test_max_tokens_and_stop_sequences(gw: GatewayServer, org: Tenant) -> None:
    client = _client(gw, org)
    short = client.messages.create(model=BASE, max_tokens=1, messages=ASK, extra_body=GREEDY)
    assert short.stop_reason == "max_tokens" and short.usage.output_tokens == 1
    free = client.messages.create(model=BASE, max_tokens=32, messages=ASK, extra_body=GREEDY)
    text = free.content[0].text  # type: ignore[union-attr]
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.messages.create(
            model=BASE, max_tokens=32, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]
        )
        chat = org.client.chat.completions.create(
            model=BASE, messages=ASK, max_tokens=32, temperature=0, stop=[stop]
        )
        assert cut.content[0].text == chat.choices[0].message.content == text[: text.index(stop)]  # type: ignore[union-attr]
        # This engine does not say which stop string ended the answer (vLLM does: see test_with_vllm).
        assert cut.stop_reason == "end_turn" and cut.stop_sequence is None


def test_streamed_message(gw: GatewayServer, org: Tenant) -> None:
    client = _client(gw, org)
    whole = client.messages.create(model=BASE, max_tokens=32, system=SYSTEM, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(
        model=BASE, max_tokens=32, system=SYSTEM, messages=ASK, extra_body=GREEDY
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text  # type: ignore[union-attr]
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    assert final.id.startswith("msg_") and final.id != whole.id

    key = {"x-api-key": org.key}
    body = {
        "model": BASE,
        "max_tokens": 32,
        "system": SYSTEM,
        "messages": ASK,
        "temperature": 0,
        "stream": True,
    }
    events = _events(_post(gw, body, **key))
    kinds = [e["type"] for e in events]
    assert kinds[:2] == ["message_start", "content_block_start"]
    assert kinds[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(kinds[2:-3]) == {"content_block_delta"}
    start = events[0]["message"]
    assert start == {
        "id": start["id"],
        "type": "message",
        "role": "assistant",
        "model": BASE,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": 0, "output_tokens": 0},
    }
    assert events[1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "text", "text": ""},
    }
    deltas = events[2:-3]
    assert all(e["index"] == 0 and e["delta"]["type"] == "text_delta" for e in deltas)
    assert "".join(e["delta"]["text"] for e in deltas) == text
    assert events[-3] == {"type": "content_block_stop", "index": 0}
    assert events[-2] == {
        "type": "message_delta",
        "delta": {"stop_reason": whole.stop_reason, "stop_sequence": None},
        "usage": {"input_tokens": whole.usage.input_tokens, "output_tokens": whole.usage.output_tokens},
    }


def test_tool_use_round_trip(gw: GatewayServer, org: Tenant) -> None:
    client = _client(gw, org)
    asked: Any = {"model": BASE, "max_tokens": 24, "messages": [{"role": "user", "content": ASK_WEATHER}]}
    called = client.messages.create(**asked, tools=[TOOL], tool_choice={"type": "any"}, extra_body=GREEDY)
    assert called.stop_reason == "tool_use" and [b.type for b in called.content] == ["tool_use"]
    use = called.content[0]
    assert use.type == "tool_use" and use.name == "get_weather" and isinstance(use.input, dict) and use.id
    chat = org.client.chat.completions.create(
        model=BASE,
        messages=[{"role": "user", "content": ASK_WEATHER}],
        tools=[CHAT_TOOL],
        tool_choice="required",
        max_tokens=24,
        temperature=0,
    )
    (chat_call,) = chat.choices[0].message.tool_calls or []
    assert use.input == json.loads(chat_call.function.arguments)  # type: ignore[union-attr]

    # Streamed, the call comes as JSON pieces that add up to the same input.
    with client.messages.stream(
        **asked, tools=[TOOL], tool_choice={"type": "any"}, extra_body=GREEDY
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    (again,) = streamed.content
    assert again.type == "tool_use" and again.name == use.name and again.input == use.input
    assert streamed.stop_reason == "tool_use"
    raw = _events(
        _post(
            gw,
            {**asked, "tools": [TOOL], "tool_choice": {"type": "any"}, "temperature": 0, "stream": True},
            **{"x-api-key": org.key},
        )
    )
    assert raw[1]["content_block"] == {
        "type": "tool_use",
        "id": raw[1]["content_block"]["id"],
        "name": "get_weather",
        "input": {},
    }
    pieces = [e["delta"] for e in raw if e["type"] == "content_block_delta"]
    assert pieces and all(p["type"] == "input_json_delta" for p in pieces)
    assert json.loads("".join(p["partial_json"] for p in pieces)) == use.input

    # The tool's result goes back in a user turn; the model answers in text.
    answer = client.messages.create(
        model=BASE,
        max_tokens=8,
        extra_body=GREEDY,
        tools=[TOOL],
        messages=[
            {"role": "user", "content": ASK_WEATHER},
            {
                "role": "assistant",
                "content": [{"type": "tool_use", "id": use.id, "name": use.name, "input": use.input}],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": use.id,
                        "content": json.dumps({"temperature_c": 21}),
                    }
                ],
            },
        ],
    )
    follow = org.client.chat.completions.create(
        model=BASE,
        messages=[
            {"role": "user", "content": ASK_WEATHER},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": use.id,
                        "type": "function",
                        "function": {
                            "name": use.name,
                            "arguments": json.dumps(use.input),
                        },
                    }
                ],
            },
            {"role": "tool", "tool_call_id": use.id, "content": json.dumps({"temperature_c": 21})},
        ],
        tools=[CHAT_TOOL],
        max_tokens=8,
        temperature=0,
    )
    assert follow.usage is not None and answer.usage.input_tokens == follow.usage.prompt_tokens
    if follow.choices[0].message.content:
        assert (
            answer.content[0].type == "text" and answer.content[0].text == follow.choices[0].message.content
        )


def test_fine_tuned_model_and_another_organisations(
    gw: GatewayServer,
    gw_admin: Admin,
    org: Tenant,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    adapter = make_lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("messages-lora") / "lora", seed=314)
    model = ft_model(gw, org, adapter)
    _check_plain(gw, org, model)
    other = gw_admin.tenant("messages-other-" + secrets.token_hex(3))
    with pytest.raises(anthropic.NotFoundError) as caught:
        _client(gw, other).messages.create(model=model, max_tokens=4, messages=ASK)
    assert caught.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": f"No model found with id '{model}'.",
            "param": "model",
            "code": "model_not_found",
        },
    }


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        ({"model": BASE, "messages": ASK}, "max_tokens", "missing_required_parameter"),
        ({"model": BASE, "max_tokens": 4}, "messages", "missing_required_parameter"),
        ({"model": BASE, "max_tokens": 0, "messages": ASK}, "max_tokens", "invalid_value"),
        (
            {"model": BASE, "max_tokens": 4, "messages": [{"role": "user", "content": [{"type": "image"}]}]},
            "messages[0].content[0].type",
            "unsupported_value",
        ),
        (
            {"model": BASE, "max_tokens": 4, "messages": [{"role": "tool", "content": "x"}]},
            "messages[0].role",
            "invalid_value",
        ),
        (
            {
                "model": BASE,
                "max_tokens": 4,
                "messages": ASK,
                "tools": [{"type": "web_search_20250305", "name": "w"}],
            },
            "tools[0].type",
            "unsupported_value",
        ),
        ({"max_tokens": 4, "messages": ASK}, "model", "missing_model"),
    ],
)
def test_bad_input_is_an_anthropic_400(
    gw: GatewayServer, org: Tenant, body: dict[str, Any], param: str, code: str
) -> None:
    resp = _post(gw, body, **{"x-api-key": org.key})
    assert resp.status_code == 400, resp.text
    raw = resp.json()
    assert raw["type"] == "error" and set(raw["error"]) == {"type", "message", "param", "code"}
    assert (raw["error"]["type"], raw["error"]["param"], raw["error"]["code"]) == (
        "invalid_request_error",
        param,
        code,
    )
    assert param.split(".")[0].split("[")[0] in raw["error"]["message"]


def test_auth_and_unknown_model_errors(gw: GatewayServer, org: Tenant) -> None:
    with pytest.raises(anthropic.BadRequestError) as bad:
        _client(gw, org).messages.create(model=BASE, messages=ASK, max_tokens=None)  # type: ignore[arg-type]
    assert bad.value.body["error"]["param"] == "max_tokens"  # type: ignore[index]
    with pytest.raises(anthropic.NotFoundError) as missing:
        _client(gw, org).messages.create(model="no-such-model", messages=ASK, max_tokens=4)
    assert missing.value.body == {
        "type": "error",
        "error": {
            "type": "not_found_error",
            "message": "No model found with id 'no-such-model'.",
            "param": "model",
            "code": "model_not_found",
        },
    }
    body = {"model": BASE, "max_tokens": 4, "messages": ASK}
    for headers in ({}, {"x-api-key": "sk-tg-nope"}):
        resp = _post(gw, body, **headers)
        assert resp.status_code == 401
        assert resp.json()["type"] == "error" and resp.json()["error"]["type"] == "authentication_error"
        assert resp.json()["error"]["code"] == "invalid_api_key"


def test_metered_like_chat(gw: GatewayServer, gw_admin: Admin) -> None:
    t = gw_admin.tenant("messages-usage-" + secrets.token_hex(3))
    client = _client(gw, t)
    start = int(time.time()) - 5
    whole = client.messages.create(model=BASE, max_tokens=6, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(model=BASE, max_tokens=32, messages=ASK, extra_body=GREEDY) as stream:
        streamed = stream.get_final_message()
    assert (
        client.messages.count_tokens(model=BASE, messages=ASK).input_tokens > 0
    )  # neither metered nor billed
    want = {
        "input_tokens": whole.usage.input_tokens + streamed.usage.input_tokens,
        "output_tokens": whole.usage.output_tokens + streamed.usage.output_tokens,
        "num_model_requests": 2,
    }
    assert streamed.usage.input_tokens == whole.usage.input_tokens > 0

    def probe() -> dict[str, int] | None:
        page = httpx.get(
            f"{gw.url}/v1/organization/usage/completions",
            params={"start_time": start, "bucket_width": "1h", "group_by": "model"},
            headers={"Authorization": f"Bearer {t.key}"},
        ).json()
        got = {k: 0 for k in want}
        for bucket in page["data"]:
            for row in bucket["results"]:
                assert row["model"] == BASE
                for k in want:
                    got[k] += row[k]
        return got if got == want else None

    assert eventually(probe, "usage metered") == want


def _stored(gateway: GatewayServer, t: Tenant, completion_id: str) -> dict[str, Any] | None:
    resp = httpx.get(
        f"{gateway.url}/v1/chat/completions/{completion_id}",
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=30,
    )
    return dict(resp.json()) if resp.status_code == 200 else None


def _check_capture(gateway: GatewayServer, admin: Admin) -> None:
    """A Messages call with an episode header is captured as its chat completion, streamed or not; one without
    is not."""
    t = admin.tenant("messages-capture-" + secrets.token_hex(3))
    on = admin.http.post(f"/v1/admin/organizations/{t.org_id}/capture", json={"enabled": True})
    assert on.status_code == 200, on.text
    client = _client(gateway, t)
    plain = client.messages.create(model=BASE, max_tokens=6, messages=ASK, extra_body=GREEDY)
    episode = "ep-" + secrets.token_hex(4)
    headers = {"X-Episode-Id": episode}
    whole = client.messages.create(
        model=BASE, max_tokens=6, messages=ASK, extra_body=GREEDY, extra_headers=headers
    )
    with client.messages.stream(
        model=BASE, max_tokens=32, messages=ASK, extra_body=GREEDY, extra_headers=headers
    ) as stream:
        streamed = stream.get_final_message()
    for message, was_streamed in ((whole, False), (streamed, True)):
        chat_id = "chatcmpl-" + message.id.removeprefix("msg_")
        row = eventually(lambda chat_id=chat_id: _stored(gateway, t, chat_id), f"{chat_id} stored")  # type: ignore[misc]
        capture = row["capture"]
        assert (capture["stored"], capture["episode_id"], capture["streamed"]) == (
            False,
            episode,
            was_streamed,
        )
        assert capture["request"]["messages"] == ASK
        assert capture["request"]["max_tokens"] == (32 if was_streamed else 6)
        assert row["choices"][0]["message"]["content"] == message.content[0].text  # type: ignore[union-attr]
        assert row["usage"]["completion_tokens"] == message.usage.output_tokens and row["model"] == BASE
    assert _stored(gateway, t, "chatcmpl-" + plain.id.removeprefix("msg_")) is None


def test_episode_header_is_captured(gw: GatewayServer, gw_admin: Admin) -> None:
    _check_capture(gw, gw_admin)


def test_with_vllm(vllm_gw: GatewayServer) -> None:
    """On vLLM: the plain answer is chat's, streamed it is the same, a stop sequence is named, tokens are
    counted by vLLM's own `/tokenize`, and capture works alike."""
    admin = admin_of(vllm_gw)
    t = admin.tenant("messages-vllm-" + secrets.token_hex(3))
    _check_plain(vllm_gw, t, BASE)
    _check_count(vllm_gw, t)
    client = _client(vllm_gw, t)
    whole = client.messages.create(model=BASE, max_tokens=32, messages=ASK, extra_body=GREEDY)
    with client.messages.stream(model=BASE, max_tokens=32, messages=ASK, extra_body=GREEDY) as stream:
        final = stream.get_final_message()
    assert final.model_dump(exclude={"id"}) == whole.model_dump(exclude={"id"})
    text = whole.content[0].text  # type: ignore[union-attr]
    if len(text) >= 4:
        stop = text[2:4]
        cut = client.messages.create(
            model=BASE, max_tokens=32, messages=ASK, extra_body=GREEDY, stop_sequences=[stop]
        )
        assert cut.stop_reason == "stop_sequence" and cut.stop_sequence == stop
        assert cut.content[0].text == text[: text.index(stop)]  # type: ignore[union-attr]
    _check_capture(vllm_gw, admin)


def test_translation_of_blocks_and_of_a_stream_error() -> None:
    """Without a stack: tool results come before the user's text, tool uses join the assistant's text, and an
    engine's error mid-stream is an Anthropic `error` event."""
    from gateway.serving.anthropic import MessagesTranslator, to_chat

    chat = to_chat(
        {
            "model": BASE,
            "max_tokens": 9,
            "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": [
                {"role": "user", "content": "Weather?"},
                {
                    "role": "assistant",
                    "content": [
                        {"type": "thinking", "thinking": "hm", "signature": "s"},
                        {"type": "text", "text": "Checking."},
                        {"type": "tool_use", "id": "t1", "name": "get_weather", "input": {"city": "Paris"}},
                    ],
                },
                {
                    "role": "user",
                    "content": [
                        {
                            "type": "tool_result",
                            "tool_use_id": "t1",
                            "content": [{"type": "text", "text": "21C"}],
                        },
                        {"type": "text", "text": "Thanks."},
                    ],
                },
            ],
            "tool_choice": {"type": "any"},
            "tools": [TOOL],
            "metadata": {"user_id": "u1"},
            "stop_sequences": ["\n\n"],
        }
    )
    assert chat == {
        "model": BASE,
        "max_tokens": 9,
        "messages": [
            {"role": "system", "content": "a\nb"},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {
                        "id": "t1",
                        "type": "function",
                        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "t1", "content": "21C"},
            {"role": "user", "content": "Thanks."},
        ],
        "stop": ["\n\n"],
        "tools": [CHAT_TOOL],
        "tool_choice": "required",
        "user": "u1",
    }
    t = MessagesTranslator({"model": BASE})
    (event,) = t.stream_error(
        {"error": {"message": "boom", "type": "server_error", "param": None, "code": "upstream_error"}}
    )
    assert event == (
        b'event: error\ndata: {"type":"error","error":{"type":"api_error","message":"boom","param":null,'
        b'"code":"upstream_error"}}\n\n'
    )

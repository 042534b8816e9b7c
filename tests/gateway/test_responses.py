"""OpenAI's Responses API (`POST /v1/responses`) through the official `openai` SDK against a gateway whose
engine serves tiny-chat: the answer is the chat path's (same greedy text, same usage), in the Responses
shapes, whole and streamed (the SDK's stream helper and the raw event sequence); a function tool's round
trip; a fine-tuned model, and another organisation's as 404; bad input as 400s naming the parameter;
metering through the usage API; capture of `store: true` and of an episode header. The last test does it
with vLLM as the engine (skipped where vLLM is not installed)."""

from __future__ import annotations

import json
import secrets
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from tests.support.capture import eventually
from tests.support.data import BASE
from tests.support.engine import ft_model, make_lora_adapter
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Tenant, admin_of
from tests.support.vllm import vllm_gateway_fixture

gw = gateway_fixture("responses", usage_flush_interval_s=0.3)
vllm_gw = vllm_gateway_fixture("responses-vllm")

INSTRUCTIONS = "Be brief."
QUESTION = "What is 2 + 3?"
CHAT: Any = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
TOOL: Any = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_TOOL: Any = {"type": "function", "function": {k: v for k, v in TOOL.items() if k != "type"}}
"""`TOOL` as a chat tool."""
ASK_WEATHER = "What is the weather in Paris?"
RESPONSE_KEYS = {
    "id",
    "object",
    "created_at",
    "status",
    "completed_at",
    "error",
    "incomplete_details",
    "instructions",
    "max_output_tokens",
    "model",
    "output",
    "parallel_tool_calls",
    "previous_response_id",
    "reasoning",
    "store",
    "temperature",
    "text",
    "tool_choice",
    "tools",
    "top_p",
    "truncation",
    "usage",
    "user",
    "metadata",
}
STREAM_TEXT = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
]
STREAM_END = [
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


def _post(gateway: GatewayServer, key: str, body: dict[str, Any], **headers: str) -> httpx.Response:
    return httpx.post(
        f"{gateway.url}/v1/responses",
        json=body,
        headers={"Authorization": f"Bearer {key}", **headers},
        timeout=120,
    )


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


def _usage(chat: Any) -> dict[str, Any]:
    """The Responses usage of a chat completion's usage."""
    prompt, completion = chat.usage.prompt_tokens, chat.usage.completion_tokens
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


@pytest.fixture(scope="module")
def org(gw_admin: Admin) -> Tenant:
    return gw_admin.tenant("responses-" + secrets.token_hex(3))


def _check_plain(gateway: GatewayServer, t: Tenant, model: str, most: int = 16) -> None:
    """A plain Responses call is the chat path's greedy answer in the Responses shape, exactly."""
    chat = t.client.chat.completions.create(model=model, messages=CHAT, max_tokens=most, temperature=0)
    text = chat.choices[0].message.content or ""
    resp = _post(
        gateway,
        t.key,
        {
            "model": model,
            "input": QUESTION,
            "instructions": INSTRUCTIONS,
            "max_output_tokens": most,
            "temperature": 0,
        },
    )
    assert resp.status_code == 200, resp.text
    raw = resp.json()
    assert set(raw) == RESPONSE_KEYS
    suffix = raw["id"].removeprefix("resp_")
    assert raw["id"].startswith("resp_") and suffix
    finished = chat.choices[0].finish_reason == "stop"
    assert raw["status"] == ("completed" if finished else "incomplete")
    assert raw["incomplete_details"] == (None if finished else {"reason": "max_output_tokens"})
    assert raw["output"] == [
        {
            "type": "message",
            "id": f"msg_{suffix}",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
        }
    ]
    assert raw["usage"] == _usage(chat)
    assert raw["object"] == "response" and raw["model"] == model and raw["error"] is None
    assert raw["instructions"] == INSTRUCTIONS and raw["max_output_tokens"] == most
    assert (
        raw["temperature"] == 0
        and raw["top_p"] == 1.0
        and raw["tools"] == []
        and raw["tool_choice"] == "auto"
    )
    assert raw["store"] is False and raw["metadata"] == {} and raw["text"] == {"format": {"type": "text"}}
    assert abs(raw["created_at"] - time.time()) < 120
    # The SDK reads it as its own `Response`.
    sdk = t.client.responses.create(
        model=model, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=most, temperature=0
    )
    assert sdk.output_text == text and sdk.model == model and sdk.usage is not None
    assert sdk.usage.input_tokens == chat.usage.prompt_tokens  # type: ignore[union-attr]


def test_plain_response_is_the_chat_answer(gw: GatewayServer, org: Tenant) -> None:
    _check_plain(gw, org, BASE)


def test_a_short_limit_is_incomplete(gw: GatewayServer, org: Tenant) -> None:
    resp = org.client.responses.create(model=BASE, input=QUESTION, max_output_tokens=1, temperature=0)
    assert resp.status == "incomplete" and resp.incomplete_details is not None
    assert resp.incomplete_details.reason == "max_output_tokens"
    assert resp.usage is not None and resp.usage.output_tokens == 1


def test_streamed_response(gw: GatewayServer, org: Tenant) -> None:
    whole = org.client.responses.create(
        model=BASE, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=32, temperature=0
    )
    assert whole.status == "completed", "the greedy answer ends within 32 tokens"
    kinds: list[str] = []
    deltas: list[str] = []
    with org.client.responses.stream(
        model=BASE, input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=32, temperature=0
    ) as stream:
        for event in stream:
            kinds.append(event.type)
            if event.type == "response.output_text.delta":
                deltas.append(event.delta)
        final = stream.get_final_response()
    assert kinds[:4] == STREAM_TEXT and kinds[-4:] == STREAM_END
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert "".join(deltas) == whole.output_text == final.output_text
    assert final.status == "completed" and final.usage is not None and whole.usage is not None
    assert final.usage.model_dump() == whole.usage.model_dump()
    assert final.id.startswith("resp_") and final.output[0].model_dump()[
        "id"
    ] == "msg_" + final.id.removeprefix("resp_")

    # The raw events: named as their type, numbered in order, each with its own fields.
    events = _events(
        _post(
            gw,
            org.key,
            {
                "model": BASE,
                "input": QUESTION,
                "instructions": INSTRUCTIONS,
                "max_output_tokens": 32,
                "temperature": 0,
                "stream": True,
            },
        )
    )
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    created, progress, added, part = events[:4]
    assert created["response"]["status"] == "in_progress" and created["response"]["output"] == []
    assert created["response"]["usage"] is None and progress["response"] == created["response"]
    item_id = "msg_" + created["response"]["id"].removeprefix("resp_")
    assert added["item"] == {
        "type": "message",
        "id": item_id,
        "status": "in_progress",
        "role": "assistant",
        "content": [],
    }
    assert added["output_index"] == 0 and part["item_id"] == item_id and part["content_index"] == 0
    assert part["part"] == {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
    text_done, part_done, item_done, completed = events[-4:]
    assert text_done["text"] == whole.output_text and part_done["part"]["text"] == whole.output_text
    assert item_done["item"] == whole.output[0].model_dump(exclude_none=True) | {"id": item_id}
    assert completed["response"]["output"] == [item_done["item"]]
    assert completed["response"]["usage"] == whole.usage.model_dump(exclude_none=True)


def test_function_tool_round_trip(gw: GatewayServer, org: Tenant) -> None:
    called = org.client.responses.create(
        model=BASE,
        input=ASK_WEATHER,
        tools=[TOOL],
        tool_choice="required",
        max_output_tokens=24,
        temperature=0,
    )
    assert called.status == "completed" and called.tools[0].model_dump(exclude_none=True) == TOOL
    calls = [item for item in called.output if item.type == "function_call"]
    assert len(calls) == 1 and [item.type for item in called.output] == ["function_call"]
    call = calls[0]
    assert call.name == "get_weather" and call.status == "completed" and call.call_id
    assert call.id == "fc_" + called.id.removeprefix("resp_") + "_0"
    assert isinstance(json.loads(call.arguments), dict)

    # Streamed, the same call comes as argument deltas.
    with org.client.responses.stream(
        model=BASE,
        input=ASK_WEATHER,
        tools=[TOOL],
        tool_choice="required",
        max_output_tokens=24,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_response()
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-3:] == [
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert set(kinds[3:-3]) == {"response.function_call_arguments.delta"}
    (again,) = streamed.output
    assert again.type == "function_call" and again.name == call.name and again.arguments == call.arguments

    # The tool's output goes back as input items; the model answers in text.
    answer = org.client.responses.create(
        model=BASE,
        input=[
            {"role": "user", "content": [{"type": "input_text", "text": ASK_WEATHER}]},
            {
                "type": "function_call",
                "call_id": call.call_id,
                "name": call.name,
                "arguments": call.arguments,
            },
            {
                "type": "function_call_output",
                "call_id": call.call_id,
                "output": json.dumps({"temperature_c": 21}),
            },
        ],
        tools=[TOOL],
        max_output_tokens=8,
        temperature=0,
    )
    chat = org.client.chat.completions.create(
        model=BASE,
        messages=[
            {"role": "user", "content": ASK_WEATHER},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": call.call_id,
                        "type": "function",
                        "function": {"name": call.name, "arguments": call.arguments},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": call.call_id, "content": json.dumps({"temperature_c": 21})},
        ],
        tools=[CHAT_TOOL],
        max_tokens=8,
        temperature=0,
    )
    assert answer.usage is not None and chat.usage is not None
    assert (
        answer.usage.input_tokens == chat.usage.prompt_tokens
    )  # the same prompt as the chat it translates to
    if chat.choices[0].message.content:
        assert answer.output_text == chat.choices[0].message.content


def test_fine_tuned_model_and_another_organisations(
    gw: GatewayServer,
    gw_admin: Admin,
    org: Tenant,
    tiny_model_dir: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    adapter = make_lora_adapter(tiny_model_dir, tmp_path_factory.mktemp("responses-lora") / "lora", seed=271)
    model = ft_model(gw, org, adapter)
    _check_plain(gw, org, model)
    other = gw_admin.tenant("responses-other-" + secrets.token_hex(3))
    resp = _post(gw, other.key, {"model": model, "input": QUESTION})
    assert resp.status_code == 404
    assert resp.json() == {
        "error": {
            "message": f"No model found with id '{model}'.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }
    }


@pytest.mark.parametrize(
    ("body", "param", "code"),
    [
        (
            {"model": BASE, "input": "hi", "previous_response_id": "resp_1"},
            "previous_response_id",
            "unsupported_parameter",
        ),
        ({"model": BASE, "input": "hi", "background": True}, "background", "unsupported_parameter"),
        (
            {"model": BASE, "input": "hi", "tools": [{"type": "web_search"}]},
            "tools[0].type",
            "unsupported_parameter",
        ),
        ({"model": BASE}, "input", "missing_required_parameter"),
        (
            {"model": BASE, "input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
            "unsupported_parameter",
        ),
        ({"model": BASE, "input": [{"type": "reasoning"}]}, "input[0].type", "unsupported_parameter"),
        ({"model": BASE, "input": "hi", "max_output_tokens": 0}, "max_output_tokens", "invalid_value"),
        ({"input": "hi"}, "model", "missing_model"),
    ],
)
def test_bad_input_is_a_400_naming_it(
    gw: GatewayServer, org: Tenant, body: dict[str, Any], param: str, code: str
) -> None:
    resp = _post(gw, org.key, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", param, code)
    assert f"'{param}'" in error["message"] or (param == "model" and "model parameter" in error["message"])


def test_unknown_model_and_no_key(gw: GatewayServer, org: Tenant) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        org.client.responses.create(model="no-such-model", input="hi")
    assert caught.value.body == {
        "message": "No model found with id 'no-such-model'.",
        "type": "invalid_request_error",
        "param": "model",
        "code": "model_not_found",
    }
    resp = httpx.post(f"{gw.url}/v1/responses", json={"model": BASE, "input": "hi"}, timeout=30)
    assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


def test_metered_like_chat(gw: GatewayServer, gw_admin: Admin) -> None:
    t = gw_admin.tenant("responses-usage-" + secrets.token_hex(3))
    start = int(time.time()) - 5
    whole = t.client.responses.create(model=BASE, input=QUESTION, max_output_tokens=6, temperature=0)
    with t.client.responses.stream(model=BASE, input=QUESTION, max_output_tokens=32, temperature=0) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_response()
    assert whole.usage is not None and streamed.usage is not None
    want = {
        "input_tokens": whole.usage.input_tokens + streamed.usage.input_tokens,
        "output_tokens": whole.usage.output_tokens + streamed.usage.output_tokens,
        "num_model_requests": 2,
    }

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
    """`store: true` and an episode header capture a Responses call as its chat completion; a plain call is
    not captured."""
    t = admin.tenant("responses-capture-" + secrets.token_hex(3))
    on = admin.http.post(f"/v1/admin/organizations/{t.org_id}/capture", json={"enabled": True})
    assert on.status_code == 200, on.text
    plain = t.client.responses.create(model=BASE, input=QUESTION, max_output_tokens=6, temperature=0)
    stored = t.client.responses.create(
        model=BASE, input=QUESTION, max_output_tokens=6, temperature=0, store=True, metadata={"task": "sum"}
    )
    assert stored.to_dict()["store"] is True and stored.metadata == {"task": "sum"}
    episode = "ep-" + secrets.token_hex(4)
    with t.client.responses.stream(
        model=BASE,
        input=QUESTION,
        max_output_tokens=32,
        temperature=0,
        extra_headers={"X-Episode-Id": episode},
    ) as stream:
        for _ in stream:
            pass
        streamed = stream.get_final_response()
    for resp, is_stored, ep, was_streamed in ((stored, True, None, False), (streamed, False, episode, True)):
        chat_id = "chatcmpl-" + resp.id.removeprefix("resp_")
        row = eventually(lambda chat_id=chat_id: _stored(gateway, t, chat_id), f"{chat_id} stored")  # type: ignore[misc]
        capture = row["capture"]
        assert (capture["stored"], capture["episode_id"], capture["streamed"]) == (
            is_stored,
            ep,
            was_streamed,
        )
        assert capture["request"]["messages"] == [{"role": "user", "content": QUESTION}]
        assert row["choices"][0]["message"]["content"] == resp.output_text
        assert resp.usage is not None and row["usage"]["completion_tokens"] == resp.usage.output_tokens
        assert row["model"] == BASE
    assert _stored(gateway, t, "chatcmpl-" + plain.id.removeprefix("resp_")) is None
    assert _stored(gateway, t, "chatcmpl-" + stored.id.removeprefix("resp_"))["metadata"] == {"task": "sum"}  # type: ignore[index]


def test_store_and_episode_headers_are_captured(gw: GatewayServer, gw_admin: Admin) -> None:
    _check_capture(gw, gw_admin)


def test_with_vllm(vllm_gw: GatewayServer) -> None:
    """On vLLM: the plain answer is chat's, streamed it is the same, and capture works alike."""
    admin = admin_of(vllm_gw)
    t = admin.tenant("responses-vllm-" + secrets.token_hex(3))
    _check_plain(vllm_gw, t, BASE)
    whole = t.client.responses.create(model=BASE, input=QUESTION, max_output_tokens=32, temperature=0)
    with t.client.responses.stream(model=BASE, input=QUESTION, max_output_tokens=32, temperature=0) as stream:
        for _ in stream:
            pass
        final = stream.get_final_response()
    assert final.output_text == whole.output_text and final.status == whole.status
    _check_capture(vllm_gw, admin)


def _chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"id": "chatcmpl-abc", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def test_translation_of_items_and_of_a_mixed_stream() -> None:
    """Without a stack: input items become chat messages (a call joins the assistant turn before it), and a
    stream of text, a call and text again gives three items with ids of their own, then an engine's error
    mid-stream ends it with an `error` event."""
    from gateway.serving.responses import to_chat
    from gateway.serving.responses_answer import ResponsesTranslator

    chat = to_chat(
        {
            "model": BASE,
            "instructions": "Be brief.",
            "input": [
                {"type": "message", "role": "developer", "content": "Use tools."},
                {"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                {
                    "role": "assistant",
                    "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
                },
                {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "c1", "output": "21C"},
            ],
            "tool_choice": {"type": "function", "name": "get_weather"},
            "max_output_tokens": 5,
        }
    )
    assert chat == {
        "model": BASE,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather?"},
            {
                "role": "assistant",
                "content": "Checking.",
                "tool_calls": [
                    {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "21C"},
        ],
        "max_tokens": 5,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }

    t = ResponsesTranslator({"model": BASE})
    deltas: list[dict[str, Any]] = [
        {"role": "assistant", "content": "A"},
        {"tool_calls": [{"index": 0, "id": "c9", "function": {"name": "f", "arguments": "{"}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": "}"}}]},
        {"content": "B"},
    ]
    out = b"".join(b"".join(t.event(_chunk(d))) for d in deltas) + b"".join(t.finish())
    events = [json.loads(b.split(b"\ndata: ")[1]) for b in out.split(b"\n\n") if b]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    final = events[-1]["response"]
    assert events[-1]["type"] == "response.completed"
    assert [(i["type"], i["id"]) for i in final["output"]] == [
        ("message", "msg_abc"),
        ("function_call", "fc_abc_0"),
        ("message", "msg_abc_2"),
    ]
    assert final["output"][1]["arguments"] == "{}" and final["output"][2]["content"][0]["text"] == "B"
    error = t.stream_error(
        {"error": {"message": "boom", "type": "server_error", "param": None, "code": "upstream_error"}}
    )
    assert json.loads(error[0].split(b"\ndata: ")[1]) == {
        "type": "error",
        "sequence_number": len(events),
        "code": "upstream_error",
        "message": "boom",
        "param": None,
    }

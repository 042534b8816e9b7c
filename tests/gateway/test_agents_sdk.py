"""The openai-agents SDK (its default model: OpenAI's Responses API) against a running gateway whose engine
serves tiny-chat: an agent with a function tool runs to its end (the tool's output is its answer: tiny-chat
cannot be relied on to end a free answer within a bound, which the SDK takes as a failure), the tool called
with the model's arguments, streamed and not; the model call is captured into the episode its header names,
and the episode's export holds the exact ids it sampled."""

from __future__ import annotations

import asyncio
import secrets
from typing import Any

import httpx
import pytest

from tests.support.capture import capture_on, eventually
from tests.support.data import BASE
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, Tenant

agents = pytest.importorskip("agents")

gw = gateway_fixture("agents-sdk")


@pytest.fixture(scope="module")
def capturing(gw_admin: Admin) -> Tenant:
    t = gw_admin.tenant("agents-" + secrets.token_hex(3))
    capture_on(gw_admin, t)
    return t


def _agent(t: Tenant, episode: str, calls: list[str]) -> Any:
    from openai import AsyncOpenAI

    agents.set_tracing_disabled(True)  # traces go to OpenAI's servers by default

    @agents.function_tool
    def get_weather(city: str = "anywhere") -> str:  # tiny-chat may leave out the argument
        """Current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    client = AsyncOpenAI(base_url=str(t.client.base_url), api_key=t.key, max_retries=4)
    return agents.Agent(
        name="weather",
        instructions="Answer with the weather. Use the tool.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=BASE, openai_client=client),
        tool_use_behavior="stop_on_first_tool",
        model_settings=agents.ModelSettings(
            tool_choice="required",
            max_tokens=48,
            temperature=0,
            extra_headers={"X-Episode-Id": episode},
        ),
    )


def _episode(t: Tenant, episode: str, calls: int) -> dict[str, Any]:
    def probe() -> dict[str, Any] | None:
        got = httpx.get(
            f"{t.client.base_url}episodes/{episode}", headers={"Authorization": f"Bearer {t.key}"}, timeout=30
        )
        return got.json() if got.status_code == 200 and len(got.json()["calls"]) >= calls else None

    return eventually(probe, f"{calls} calls of {episode} written")


@pytest.mark.parametrize("streamed", [False, True])
def test_an_agent_with_a_tool_runs_through_the_gateway_and_is_captured(
    capturing: Tenant, streamed: bool
) -> None:
    episode = "agent-" + secrets.token_hex(4)
    calls: list[str] = []
    agent = _agent(capturing, episode, calls)

    async def run() -> Any:
        if not streamed:
            return await agents.Runner.run(agent, "What is the weather in Paris?", max_turns=3)
        result = agents.Runner.run_streamed(agent, "What is the weather in Paris?", max_turns=3)
        events = [e async for e in result.stream_events()]
        assert any(e.type == "raw_response_event" for e in events)
        return result

    result = asyncio.run(run())
    assert calls and all(isinstance(c, str) for c in calls)  # the tool ran with the model's arguments
    items = [type(i).__name__ for i in result.new_items]
    assert items[:2] == ["ToolCallItem", "ToolCallOutputItem"], items
    assert result.final_output == f"Sunny in {calls[0]}."
    turns = len(result.raw_responses)
    assert turns == 1

    found = _episode(capturing, episode, turns)
    assert [c["model"] for c in found["calls"]] == [BASE] * turns
    export = capturing.client.get(f"episodes/{episode}/export", cast_to=object)
    assert isinstance(export, dict)
    sampled = [s for s in export["samples"] if any(s["completion_mask"])]
    assert sampled and all(len(s["input_ids"]) == len(s["completion_mask"]) for s in sampled)
    masked = sum(sum(s["completion_mask"]) for s in export["samples"])
    usage = sum(c["usage"]["completion_tokens"] for c in found["calls"])
    assert masked == usage  # every token each call sampled is in the export, once

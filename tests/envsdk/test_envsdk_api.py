"""The authoring API, run in-process: rewards, errors as data, multi-turn episodes, tools, manifests."""

from __future__ import annotations

import asyncio
from typing import Literal

import pytest

from envsdk import (
    InProcessRunner,
    MultiTurnEnv,
    PackageError,
    SingleTurnEnv,
    StepResult,
    StopReason,
    ToolEnv,
    completion_text,
    tool,
)
from envsdk.host import RemoteError
from envsdk.manifest import Limits, parse_manifest
from envsdk.rollout import run_episode, run_single_turn


class Exact(SingleTurnEnv):
    def reward(self, task, completion):
        if task.get("explode"):
            raise ValueError("boom")
        return float(completion_text(completion).strip() == task["answer"])


class AsyncRanked(SingleTurnEnv):
    async def reward(self, task, completion):
        await asyncio.sleep(0)
        return float(len(completion))

    async def group_reward(self, task, completions):
        order = sorted(range(len(completions)), key=lambda i: len(completions[i]))
        ranks = [0.0] * len(completions)
        for rank, index in enumerate(order):
            ranks[index] = rank / (len(completions) - 1)
        return ranks


def test_reward_batch_scores_and_keeps_errors_as_data():
    with InProcessRunner(Exact) as runner:
        results = runner.reward_batch(
            [
                {"task": {"answer": "4"}, "completion": "4"},
                {"task": {"answer": "4"}, "completion": [{"role": "assistant", "content": " 5 "}]},
                {"task": {"answer": "4", "explode": True}, "completion": "4"},
                {"task": {}, "completion": "4"},
            ]
        )
    assert results == [
        {"reward": 1.0, "error": None},
        {"reward": 0.0, "error": None},
        {"reward": None, "error": "ValueError: boom"},
        {"reward": None, "error": "KeyError: 'answer'"},
    ]


def test_async_reward_and_group_reward():
    with InProcessRunner(AsyncRanked) as runner:
        assert runner.reward_batch([{"task": {}, "completion": "abc"}]) == [{"reward": 3.0, "error": None}]
        ranked = runner.call("group_reward", {"task": {}, "completions": ["aaa", "a", "aa"]})
    assert [r["reward"] for r in ranked] == [1.0, 0.0, 0.5]
    with InProcessRunner(AsyncRanked) as runner:  # describe tells callers to judge whole groups
        assert runner.describe()["group_reward"] is True
    with InProcessRunner(Exact) as runner:  # default group_reward: reward of each
        assert runner.describe()["group_reward"] is False
        default = runner.call("group_reward", {"task": {"answer": "x"}, "completions": ["x", "y"]})
    assert [r["reward"] for r in default] == [1.0, 0.0]


class Raw(SingleTurnEnv):
    def reward(self, task, completion):
        return task["value"]

    def group_reward(self, task, completions):
        return [float(c) for c in completions]


def test_non_finite_rewards_fail_their_item_alone():
    with InProcessRunner(Raw) as runner:
        results = runner.reward_batch(
            [{"task": {"value": v}, "completion": ""} for v in (0.5, float("nan"), float("-inf"), "x", 2)]
        )
        grouped = runner.call("group_reward", {"task": {}, "completions": ["1", "nan", "inf"]})
    assert results == [
        {"reward": 0.5, "error": None},
        {"reward": None, "error": "ValueError: reward must be a finite number, got nan"},
        {"reward": None, "error": "ValueError: reward must be a finite number, got -inf"},
        {"reward": None, "error": "ValueError: could not convert string to float: 'x'"},
        {"reward": 2.0, "error": None},
    ]
    assert grouped == [
        {"reward": 1.0, "error": None},
        {"reward": None, "error": "ValueError: reward must be a finite number, got nan"},
        {"reward": None, "error": "ValueError: reward must be a finite number, got inf"},
    ]


class Counter(MultiTurnEnv):
    max_turns = 3

    def reset(self, task):
        self.seen = 0
        return [{"role": "user", "content": "count"}]

    def step(self, assistant_message):
        self.seen += 1
        if assistant_message["content"] == "stop":
            return StepResult(reward=1.0, done=True)
        if assistant_message["content"] == "crash":
            raise RuntimeError("step broke")
        return StepResult(observation=[{"role": "user", "content": f"seen {self.seen}"}], reward=0.25)


def test_multi_turn_episode_state_per_instance_and_max_turns():
    with InProcessRunner(Counter) as runner:
        assert runner.describe() == {
            "kind": "multi_turn",
            "entrypoint": f"{__name__}:Counter",
            "tools": [],
            "max_turns": 3,
            "group_reward": False,
            "scores_truncated": False,
        }
        a = runner.call("reset", {"task": {}})
        b = runner.call("reset", {"task": {}})
        assert a["episode_id"] != b["episode_id"]
        first = runner.call("step", {"episode_id": a["episode_id"], "assistant_message": {"content": "go"}})
        assert first["observation"] == [{"role": "user", "content": "seen 1"}] and not first["done"]
        # episode b has its own instance: its counter starts at zero
        other = runner.call("step", {"episode_id": b["episode_id"], "assistant_message": {"content": "go"}})
        assert other["observation"][0]["content"] == "seen 1"

        long = run_episode(runner, {}, lambda messages, tools: {"role": "assistant", "content": "go"})
        assert long.stop_reason is StopReason.MAX_TURNS and long.turns == 3 and long.reward == 0.75
        done = run_episode(runner, {}, lambda messages, tools: {"role": "assistant", "content": "stop"})
        assert done.stop_reason is StopReason.DONE and done.reward == 1.0 and done.turns == 1
        broken = run_episode(runner, {}, lambda messages, tools: {"role": "assistant", "content": "crash"})
        assert broken.stop_reason is StopReason.ERROR and broken.reward is None
        assert broken.error == "RuntimeError: step broke"


class Shop(ToolEnv):
    @tool
    def price(self, item: Literal["apple", "pear"], quantity: int = 1) -> float:
        """Price of some fruit.

        Args:
            item: Which fruit.
            quantity: How many, at least one.
        """
        return {"apple": 0.5, "pear": 0.75}[item] * quantity

    def reward(self, task, messages):
        return float(task["answer"] in completion_text(messages))


def test_tool_schema_from_signature_and_docstring():
    @tool
    def search(
        query: str, limit: int | None = None, tags: list[str] | None = None, exact: bool = False
    ) -> str:
        """Search the catalogue.

        Args:
            query: Words to look for,
                over several lines.
            limit: Most results.
        """
        return query

    assert search.__envsdk_tool__ == {
        "type": "function",
        "function": {
            "name": "search",
            "description": "Search the catalogue.",
            "parameters": {
                "type": "object",
                "properties": {
                    "query": {"type": "string", "description": "Words to look for, over several lines."},
                    "limit": {"type": "integer", "description": "Most results.", "default": None},
                    "tags": {"type": "array", "items": {"type": "string"}, "default": None},
                    "exact": {"type": "boolean", "default": False},
                },
                "required": ["query"],
            },
        },
    }


def test_tool_env_runs_tool_calls_and_scores_the_conversation():
    calls = [
        {
            "id": "c1",
            "type": "function",
            "function": {"name": "price", "arguments": '{"item": "pear", "quantity": 4}'},
        },
        {"id": "c2", "type": "function", "function": {"name": "nope", "arguments": "{}"}},
    ]
    script = iter(
        [{"role": "assistant", "content": "", "tool_calls": calls}, {"role": "assistant", "content": "3.0"}]
    )
    seen_tools = []

    def policy(messages, tools):
        seen_tools.append(tools)
        return next(script)

    with InProcessRunner(Shop) as runner:
        [schema] = runner.call("tools", {})
        assert schema["function"]["parameters"]["properties"]["item"] == {
            "enum": ["apple", "pear"],
            "type": "string",
            "description": "Which fruit.",
        }
        result = run_episode(
            runner, {"messages": [{"role": "user", "content": "4 pears?"}], "answer": "3.0"}, policy
        )
        direct = runner.call("call_tool", {"name": "price", "arguments": {"item": "apple"}})
    assert seen_tools[0] == [schema]
    assert result.stop_reason is StopReason.DONE and result.reward == 1.0 and result.turns == 2
    tool_messages = [m for m in result.messages if m["role"] == "tool"]
    assert tool_messages[0] == {"role": "tool", "tool_call_id": "c1", "content": "3.0"}
    assert tool_messages[1]["content"].startswith("error: KeyError")
    assert direct == {"content": "0.5", "error": None}


def test_single_turn_literal_completion_and_wrong_kind():
    with InProcessRunner(Exact) as runner:
        scored = run_single_turn(runner, {"prompt": "2+2", "answer": "4"}, completion="4")
        assert scored.reward == 1.0 and scored.messages[-1] == {"role": "assistant", "content": "4"}
        with pytest.raises(RemoteError) as info:
            runner.call("reset", {"task": {}})
        assert info.value.code == "wrong_kind"


def test_entrypoint_checks():
    with pytest.raises(RemoteError, match="not a SingleTurnEnv"):
        InProcessRunner("json:JSONDecoder")
    with pytest.raises(RemoteError, match="cannot import"):
        InProcessRunner("no_such_module_here:Env")
    with pytest.raises(RemoteError, match="base class"):
        InProcessRunner("envsdk:SingleTurnEnv")


def test_manifest_validation():
    manifest = parse_manifest('name = "a"\nversion = "1.0"\nentrypoint = "m:E"\n[limits]\ntimeout_s = 5\n')
    assert manifest.limits.timeout_s == 5 and manifest.limits.memory_mb == 1024
    capped = manifest.limits.capped(Limits(memory_mb=256, timeout_s=60))
    assert capped.memory_mb == 256 and capped.timeout_s == 5
    for bad, where in [
        ('name = "a"\nversion = "1"\n', "entrypoint"),
        ('name = "../x"\nversion = "1"\nentrypoint = "m:E"\n', "name"),
        ('name = "a"\nversion = "1"\nentrypoint = "m:E"\n[limits]\nmemory = 5\n', "limits.memory"),
        ("name = ", "TOML"),
    ]:
        with pytest.raises(PackageError, match=where) as info:
            parse_manifest(bad)
        assert info.value.code == "invalid_manifest"


def test_envsdk_imports_without_torch_or_pydantic():
    import subprocess
    import sys

    code = (
        "import sys, envsdk; assert 'torch' not in sys.modules and 'pydantic' not in sys.modules; print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


class Meter(Shop):
    @tool
    def weigh(self, item: str) -> str:
        """Weigh some fruit.

        Args:
            item: Which fruit.
        """
        self.info["metrics"] = {"tools/weighed": self.info.get("metrics", {}).get("tools/weighed", 0) + 1}
        return f"{item}: 120 g"


def test_forced_first_tool_call_opens_the_episode_and_info_reaches_every_step():
    task = {
        "messages": [{"role": "user", "content": "How heavy is a pear?"}],
        "answer": "120",
        "tool_call": {"name": "weigh", "arguments": {"item": "pear"}},
    }
    policy_calls = []

    def policy(messages, tools):
        policy_calls.append(list(messages))
        return {"role": "assistant", "content": "120 g"}

    with InProcessRunner(Meter) as runner:  # not asked for: the task's tool_call is not used
        assert runner.call("reset", {"task": task})["forced_tool_call"] is None
    with InProcessRunner(Meter, {"force_first_tool_call": True}) as runner:
        opened = runner.call("reset", {"task": task})
        assert opened["forced_tool_call"] == {"name": "weigh", "arguments": {"item": "pear"}}
        result = run_episode(runner, task, policy)
        untooled = runner.call("reset", {"task": {"messages": task["messages"]}})
        assert untooled["forced_tool_call"] is None  # a task without a tool_call plays as usual
    assert result.stop_reason is StopReason.DONE and result.reward == 1.0 and result.turns == 2
    forced, tool_answer = result.messages[1], result.messages[2]
    assert forced["tool_calls"][0]["function"] == {"name": "weigh", "arguments": '{"item": "pear"}'}
    assert tool_answer == {"role": "tool", "tool_call_id": "call_1_0", "content": "pear: 120 g"}
    assert len(policy_calls) == 1 and policy_calls[0][-1] == tool_answer  # the model wrote only turn 2
    assert result.info == {"metrics": {"tools/weighed": 1}}

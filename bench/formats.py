"""Environment formats: how fast an environment written for another framework runs unchanged through its
adapter (`envsdk.formats`), against the same environment written natively in envsdk.

Each side is one sandbox (`envsdk.Sandbox`, as a trainer's) fed the same tasks and the same answers, in
alternating slices (a slow spell of a shared machine falls on both sides alike):

* `trl`: `examples/envs/trl_arithmetic` (trl in its venv; its own `correct_answer` and TRL's
  `think_format_reward`): episodes of one scored answer (`reset`, `step`);
* `openenv`: `examples/envs/openenv_guess` (openenv-core's server in the sandbox, one WebSocket session an
  episode): episodes of two guesses, the second right;
* `verifiers`: `examples/envs/verifiers_arithmetic` (verifiers 0.3.1; its `vf.Rubric`): single-turn rewards
  in batches of 16 (`reward_batch`), as a trainer asks for them;
* `atropos`: `examples/envs/atropos_arithmetic` (atroposlib 0.4.0; its own `collect_trajectories` and
  `score`, answered by the adapter's stand-in for its server): rewards of groups of 16 completions of one
  prompt (`group_reward`), as a trainer asks for them.

The native side of each computes the same rewards in an envsdk class; the report says whether they agree.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common import ROOT, Options, fmt, ratio

EXAMPLES = ROOT / "examples" / "envs"
ROUNDS = 6
BATCH = 16
NATIVE_TRL = '''
import re

from envsdk import ToolEnv, tool


class Env(ToolEnv):
    @tool
    def add(self, a: int, b: int) -> str:
        """Add two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return str(a + b)

    @tool
    def multiply(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: The first number.
            b: The second number.
        """
        return str(a * b)

    def reward(self, task, messages):
        completion = messages[len(self.task["messages"]):]
        text = completion[-1]["content"].strip() if completion else ""
        expected = str(task["answer"])
        correct = 1.0 if text == expected else 0.5 if expected in text else 0.0
        pattern = r"^<think>(?!.*<think>)(.*?)</think>.*$"
        thought = 1.0 if re.match(pattern, completion[0]["content"], re.DOTALL | re.MULTILINE) else 0.0
        return correct + thought
'''
NATIVE_GUESS = """
import re

from envsdk import MultiTurnEnv, StepResult, task_messages


class Env(MultiTurnEnv):
    def reset(self, task):
        self.target, self.left = int(task["target"]), 3
        return task_messages(task)

    def step(self, message):
        self.left -= 1
        found = re.search(r"-?\\d+", message.get("content") or "")
        if found is None:
            text, reward, done = "not a number", 0.0, False
        elif int(found.group()) == self.target:
            text, reward, done = "correct", 1.0, True
        else:
            text = "higher" if int(found.group()) < self.target else "lower"
            reward, done = 0.1, False
        done = done or self.left <= 0
        return StepResult(observation=[{"role": "user", "content": text}], reward=reward, done=done)
"""
NATIVE_SUMS = """
import re

from envsdk import SingleTurnEnv, completion_text


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        text = completion_text(completion).strip()
        exact = 1.0 if text == task["answer"] else 0.0
        present = 1.0 if task["answer"] in re.findall(r"-?\\d+", text) else 0.0
        return exact + 0.5 * present
"""
NATIVE_GROUPS = """
import re

from envsdk import SingleTurnEnv, completion_text


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        text, answer = completion_text(completion).strip(), task["answer"]
        return 1.0 if text == answer else 0.5 if answer in re.findall(r"-?\\d+", text) else 0.0
"""


@dataclass(frozen=True)
class Case:
    """One format: its example package, the native equivalent, and how a unit of work is played."""

    package: str
    native: str
    play: Callable[[Any, dict[str, Any], int], list[float]]
    """Play unit `i` of `task` on a sandbox; the rewards it gave. One episode, or one batch of rewards."""
    unit: str


def _step(box: Any, episode: str, content: str) -> dict[str, Any]:
    step: dict[str, Any] = box.call(
        "step", {"episode_id": episode, "assistant_message": {"role": "assistant", "content": content}}
    )
    assert step.get("error") is None, step
    return step


def _answer_episode(box: Any, task: dict[str, Any], i: int) -> list[float]:
    answers = ["<think>easy</think>{answer}", "{answer}", "It is {answer}.", "no idea"]
    opened = box.call("reset", {"task": task})
    step = _step(box, opened["episode_id"], answers[i % len(answers)].format(answer=task["answer"]))
    assert step["done"], step
    return [float(step["reward"])]


def _guess_episode(box: Any, task: dict[str, Any], i: int) -> list[float]:
    opened = box.call("reset", {"task": task})
    first = str(task["target"] % 10 + 1)  # wrong, then right
    rewards = [float(_step(box, opened["episode_id"], first)["reward"])]
    last = _step(box, opened["episode_id"], str(task["target"]))
    assert last["done"], last
    return rewards + [float(last["reward"])]


def _reward_batch(box: Any, task: dict[str, Any], i: int) -> list[float]:
    replies = ["{answer}", "It is {answer}.", "no"]
    items = [
        {"task": task, "completion": replies[(i + k) % len(replies)].format(answer=task["answer"])}
        for k in range(BATCH)
    ]
    out = box.reward_batch(items)
    assert all(r.get("error") is None for r in out), out
    return [float(r["reward"]) for r in out]


def _group_reward(box: Any, task: dict[str, Any], i: int) -> list[float]:
    replies = ["{answer}", "It is {answer}.", "no"]
    group = [replies[(i + k) % len(replies)].format(answer=task["answer"]) for k in range(BATCH)]
    out = box.group_reward(task, group)
    assert all(r.get("error") is None for r in out), out
    return [float(r["reward"]) for r in out]


CASES = {
    "trl": Case("trl_arithmetic", NATIVE_TRL, _answer_episode, "episodes"),
    "openenv": Case("openenv_guess", NATIVE_GUESS, _guess_episode, "episodes"),
    "verifiers": Case("verifiers_arithmetic", NATIVE_SUMS, _reward_batch, "rewards"),
    "atropos": Case("atropos_arithmetic", NATIVE_GROUPS, _group_reward, "rewards"),
}


def _native_package(root: Path, code: str) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "environment.toml").write_text(
        'name = "native"\nversion = "0.1.0"\nentrypoint = "native_env:Env"\n'
    )
    (root / "native_env.py").write_text(code)
    return root


def _slice(
    box: Any, case: Case, tasks: list[dict[str, Any]], seconds: float, seen: list[float], start: int
) -> tuple[int, float]:
    """Play units for `seconds`, the side's units numbered on from `start` (the tasks taken in turn across
    slices, so both sides play the same sequence however many units a slice holds): (units played, the time
    they took); the first rewards go to `seen`."""
    done, t0 = 0, time.perf_counter()
    while (now := time.perf_counter()) - t0 < seconds:
        unit = start + done
        rewards = case.play(box, tasks[unit % len(tasks)], unit)
        if len(seen) < 32:
            seen.extend(rewards)
        done += 1
    return done, now - t0


def _compare(name: str, case: Case, opts: Options, builder: Any) -> dict[str, Any]:
    from envsdk.sandbox import Sandbox

    package = EXAMPLES / case.package
    tasks = [json.loads(line) for line in (package / "tasks.jsonl").read_text().splitlines() if line.strip()]
    native = _native_package(opts.workdir / "formats" / f"native-{name}", case.native)
    seconds = 0.5 if opts.quick else 4.0
    per_unit = BATCH if case.unit == "rewards" else 1
    t0 = time.perf_counter()
    sides: dict[str, dict[str, Any]] = {}
    with Sandbox(native, venvs=builder) as native_box, Sandbox(package, venvs=builder) as adapted_box:
        start_s = time.perf_counter() - t0
        boxes = {"native": native_box, name: adapted_box}
        played = dict.fromkeys(boxes, 0)
        for side in boxes:
            sides[side] = {"units": 0, "elapsed_s": 0.0, "rewards": []}
        for _ in range(ROUNDS):
            for side, box in boxes.items():
                n, took = _slice(box, case, tasks, seconds / ROUNDS, sides[side]["rewards"], played[side])
                played[side] += n
                sides[side]["units"] += n * per_unit
                sides[side]["elapsed_s"] += took
    for totals in sides.values():
        totals["per_s"] = totals["units"] / totals["elapsed_s"]
    return {
        "unit": case.unit,
        "sides": sides,
        "vs_native": ratio(sides[name]["per_s"], sides["native"]["per_s"]),
        "same_rewards": sides[name]["rewards"] == sides["native"]["rewards"],
        "start_s": start_s,
    }


def run(opts: Options) -> dict[str, Any]:
    from envsdk.venvs import VenvBuilder

    builder = VenvBuilder(opts.venv_dir or opts.workdir / "formats" / "venvs")
    return {"formats": {name: _compare(name, case, opts, builder) for name, case in CASES.items()}}


def markdown(report: dict[str, Any]) -> list[str]:
    lines = [
        "Each example package of another framework's format, run unchanged through its adapter in one "
        "sandbox, against the same environment written in envsdk in another, same tasks and answers, "
        "alternating slices: trl and openenv in episodes per second, verifiers in rewards per second "
        "(batches of 16), atropos in rewards per second (groups of 16 completions of one prompt).",
        "",
        "| format | unit | native /s | adapter /s | vs native | same rewards | sandboxes started (s) |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, r in report["formats"].items():
        lines.append(
            f"| {name} | {r['unit']} | {r['sides']['native']['per_s']:.0f} | "
            f"{r['sides'][name]['per_s']:.0f} | {fmt(r['vs_native'])}x | {r['same_rewards']} | "
            f"{r['start_s']:.1f} |"
        )
    return lines

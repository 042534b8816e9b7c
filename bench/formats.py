"""Environment formats: episodes per second of an environment written for another framework, run unchanged
through its adapter (`envsdk.formats`), against the same environment written natively in envsdk.

Each side is one sandbox (`envsdk.Sandbox`, the same as a trainer's) playing the same tasks with the same
one-turn answers: `reset`, then one `step` whose answer ends the episode and is scored. The TRL side is
`examples/envs/trl_arithmetic` as shipped (its exact requirement set, `trl` and `packaging`, in its venv;
the scores from its own `correct_answer` and TRL's `think_format_reward`); the native side computes the same
two scores in a `ToolEnv` with the same tools. Measured in alternating slices, so that a slow spell of a
shared machine falls on both sides alike.
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from bench.common import ROOT, Options, ratio

TRL_PACKAGE = ROOT / "examples" / "envs" / "trl_arithmetic"
ROUNDS = 6
NATIVE = '''
import re

from envsdk import ToolEnv, tool


class ArithmeticTools(ToolEnv):
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
ANSWERS = ["<think>easy</think>{answer}", "{answer}", "It is {answer}.", "no idea"]


def _native_package(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    (root / "environment.toml").write_text(
        'name = "native-arithmetic"\nversion = "0.1.0"\nentrypoint = "native_env:ArithmeticTools"\n'
    )
    (root / "native_env.py").write_text(NATIVE)
    return root


def _episodes(
    box: Any, tasks: list[dict[str, Any]], seconds: float, rewards: list[float]
) -> tuple[int, float]:
    """Play episodes for `seconds`: (how many, the time they took)."""
    done, t0 = 0, time.perf_counter()
    while (now := time.perf_counter()) - t0 < seconds:
        task = tasks[done % len(tasks)]
        answer = ANSWERS[done % len(ANSWERS)].format(answer=task["answer"])
        opened = box.call("reset", {"task": task})
        message = {"role": "assistant", "content": answer}
        step = box.call("step", {"episode_id": opened["episode_id"], "assistant_message": message})
        assert step["done"] and step.get("error") is None, step
        if len(rewards) < len(ANSWERS) * 2:
            rewards.append(float(step["reward"]))
        done += 1
    return done, now - t0


def run(opts: Options) -> dict[str, Any]:
    from envsdk.sandbox import Sandbox
    from envsdk.venvs import VenvBuilder

    lines = (TRL_PACKAGE / "tasks.jsonl").read_text().splitlines()
    tasks = [json.loads(line) for line in lines if line.strip()]
    builder = VenvBuilder(opts.workdir / "formats" / "venvs")
    native = _native_package(opts.workdir / "formats" / "native")
    seconds = 0.5 if opts.quick else 4.0
    t0 = time.perf_counter()
    sides: dict[str, dict[str, Any]] = {}
    with Sandbox(native, venvs=builder) as native_box, Sandbox(TRL_PACKAGE, venvs=builder) as trl_box:
        venv_s = time.perf_counter() - t0
        boxes = {"native": native_box, "trl": trl_box}
        for name in boxes:
            sides[name] = {"episodes": 0, "elapsed_s": 0.0, "rewards": []}
        for _ in range(ROUNDS):
            for name, box in boxes.items():
                n, took = _episodes(box, tasks, seconds / ROUNDS, sides[name]["rewards"])
                sides[name]["episodes"] += n
                sides[name]["elapsed_s"] += took
    for side in sides.values():
        side["episodes_per_s"] = side["episodes"] / side["elapsed_s"]
    return {
        "sides": sides,
        "trl_vs_native": ratio(sides["trl"]["episodes_per_s"], sides["native"]["episodes_per_s"]),
        "same_rewards": sides["trl"]["rewards"] == sides["native"]["rewards"],
        "start_s": venv_s,
    }


def markdown(report: dict[str, Any]) -> list[str]:
    sides = report["sides"]
    lines = [
        "Episodes per second (reset, then one scored answer) through one sandbox each: "
        "`examples/envs/trl_arithmetic` (written for TRL, run through `envsdk.formats.trl`, with `trl` in "
        "its venv) against the same environment written in envsdk, same tasks and answers, alternating "
        "slices.",
        "",
        "| format | episodes | episodes/s | vs native |",
        "|---|---|---|---|",
    ]
    for name, side in sides.items():
        vs = report["trl_vs_native"] if name == "trl" else 1.0
        lines.append(f"| {name} | {side['episodes']} | {side['episodes_per_s']:.0f} | {vs:.2f}x |")
    lines += [
        "",
        f"Both sides gave the same rewards for the same answers: {report['same_rewards']}. Starting both "
        f"sandboxes (the TRL side's venv built or found in the cache first) took {report['start_s']:.1f} s.",
    ]
    return lines

"""``envsdk``: scaffold, pack, check and play environment packages.

::

    envsdk init NAME [--kind single_turn|multi_turn|tool] [--dir PARENT]
    envsdk pack DIR [-o OUT]                      # prints "<sha256>  <path>"
    envsdk inspect ARCHIVE                         # the gateway's upload check, locally
    envsdk test DIR --tasks tasks.jsonl [--completions TEXT ...] [--base-url URL --model M --api-key K]
                [--n N] [--allow-unsandboxed]      # one JSON line per episode, then a summary line

A package whose ``environment.toml`` lists ``requirements`` (each pinned with ``==``): ``pack`` refuses an
unpinned one and prints them (the archive's manifest carries them); ``test`` and ``inspect`` run it with
the venv the gateway would build (:mod:`envsdk.venvs`), cached in ``~/.cache/envsdk/venvs``
(``$XDG_CACHE_HOME``, or ``ENVSDK_VENV_DIR``).
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
from pathlib import Path
from typing import Any

from envsdk.errors import EnvSDKError

logger = logging.getLogger(__name__)

_TEMPLATES = {
    "single_turn": '''"""{name}: a single-turn environment."""

from envsdk import SingleTurnEnv, completion_text


class Env(SingleTurnEnv):
    def reward(self, task: dict, completion) -> float:
        """1.0 when the completion contains the task's answer."""
        return float(str(task["answer"]).strip() in completion_text(completion))
''',
    "multi_turn": '''"""{name}: a multi-turn environment."""

from envsdk import MultiTurnEnv, StepResult


class Env(MultiTurnEnv):
    max_turns = 4

    def reset(self, task: dict) -> list[dict]:
        self.answer = str(task["answer"])
        return task["messages"]

    def step(self, assistant_message: dict) -> StepResult:
        if self.answer in (assistant_message.get("content") or ""):
            return StepResult(reward=1.0, done=True)
        return StepResult(observation=[{{"role": "user", "content": "Not quite, try again."}}])
''',
    "tool": '''"""{name}: a tool-using environment."""

from envsdk import ToolEnv, completion_text, tool


class Env(ToolEnv):
    max_turns = 4

    @tool
    def add(self, a: float, b: float) -> float:
        """Add two numbers.

        Args:
            a: The first number.
            b: The second number.
        """
        return a + b

    def reward(self, task: dict, messages: list[dict]) -> float:
        return float(str(task["answer"]) in completion_text(messages))
''',
}


def cmd_init(args: argparse.Namespace) -> int:
    target = Path(args.dir) / args.name
    if target.exists():
        print(f"error: {target} already exists", file=sys.stderr)
        return 1
    module = args.name.replace("-", "_").replace(".", "_")
    target.mkdir(parents=True)
    (target / "environment.toml").write_text(
        f'name = "{args.name}"\nversion = "0.1.0"\nentrypoint = "{module}_env:Env"\n'
        f'description = "The {args.name} environment."\n\n'
        "[limits]\ntimeout_s = 30\nmemory_mb = 1024\ncpu_s = 600\nmax_turns = 4\n"
    )
    (target / f"{module}_env.py").write_text(_TEMPLATES[args.kind].format(name=args.name))
    task = {
        "messages": [{"role": "user", "content": "What is 2 + 2? Answer with the number."}],
        "answer": "4",
    }
    (target / "tasks.jsonl").write_text(json.dumps(task) + "\n")
    print(target)
    return 0


def cmd_pack(args: argparse.Namespace) -> int:
    from envsdk.archive import pack
    from envsdk.manifest import load_manifest
    from envsdk.venvs import normalise_requirements

    out, digest = pack(Path(args.dir), Path(args.output) if args.output else None)
    # the archive's environment.toml carries them; pack refused a requirement not pinned with ==
    requirements = normalise_requirements(load_manifest(Path(args.dir)).requirements)
    if requirements:
        print(f"requirements: {' '.join(requirements)}", file=sys.stderr)
    print(f"{digest}  {out}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    from envsdk.archive import inspect_package

    with tempfile.TemporaryDirectory(prefix="envsdk-inspect-") as work:
        manifest = inspect_package(Path(args.archive), Path(work), allow_unsandboxed=args.allow_unsandboxed)
    print(manifest.model_dump_json(indent=2))
    return 0


def _read_tasks(path: Path) -> list[dict[str, Any]]:
    tasks = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.strip():
            try:
                tasks.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise SystemExit(f"{path}:{number}: not JSON: {exc}") from exc
    return tasks


def cmd_test(args: argparse.Namespace) -> int:
    from envsdk.rollout import Policy, openai_policy, run_episode, run_single_turn
    from envsdk.sandbox import Sandbox

    tasks = _read_tasks(Path(args.tasks))[: args.n] if args.n else _read_tasks(Path(args.tasks))
    config = json.loads(args.config) if args.config else None
    policy: Policy | None = None
    if args.model:
        import openai

        client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key or "none")
        policy = openai_policy(client, args.model, max_tokens=args.max_tokens)
    elif not args.completions:
        print("error: give --model (with --base-url) or --completions", file=sys.stderr)
        return 2
    rewards: list[float | None] = []
    with Sandbox(Path(args.dir), config=config, allow_unsandboxed=args.allow_unsandboxed) as sandbox:
        kind = sandbox.info["kind"]
        for index, task in enumerate(tasks):
            if kind == "single_turn":
                if policy is not None:
                    results = [run_single_turn(sandbox, task, policy) for _ in range(args.samples)]
                else:
                    results = [run_single_turn(sandbox, task, completion=c) for c in args.completions]
            elif policy is None:
                print("error: multi-turn environments need --model", file=sys.stderr)
                return 2
            else:
                limit = sandbox.limits.max_turns
                results = [run_episode(sandbox, task, policy, max_turns=limit) for _ in range(args.samples)]
            for result in results:
                rewards.append(result.reward)
                row: dict[str, Any] = {"task": index, "reward": result.reward, "turns": result.turns}
                row.update(stop_reason=str(result.stop_reason), error=result.error)
                if kind != "single_turn":
                    row["tool_calls"] = sum(len(m.get("tool_calls") or []) for m in result.messages)
                if args.verbose:
                    row["messages"] = result.messages
                print(json.dumps(row))
            if not sandbox.running:  # a timeout or crash killed it: start a fresh one for the next task
                sandbox.start()
    scored = [r for r in rewards if r is not None]
    mean = sum(scored) / len(scored) if scored else None
    print(json.dumps({"episodes": len(rewards), "errors": len(rewards) - len(scored), "mean_reward": mean}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="envsdk", description="tunegate environment packages")
    parser.add_argument("-v", "--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("init", help="scaffold a new environment package")
    p.add_argument("name")
    p.add_argument("--kind", choices=sorted(_TEMPLATES), default="single_turn")
    p.add_argument("--dir", default=".", help="parent directory")
    p.set_defaults(func=cmd_init)

    p = sub.add_parser("pack", help="make a reproducible .tar.gz and print its sha256")
    p.add_argument("dir")
    p.add_argument("-o", "--output")
    p.set_defaults(func=cmd_pack)

    p = sub.add_parser("inspect", help="check an archive as the gateway does on upload")
    p.add_argument("archive")
    p.add_argument("--allow-unsandboxed", action="store_true")
    p.set_defaults(func=cmd_inspect)

    p = sub.add_parser(
        "test",
        help="play episodes in the sandbox and print rewards (requirements: a venv cached in "
        "~/.cache/envsdk/venvs, as the gateway builds them)",
    )
    p.add_argument("dir")
    p.add_argument("--tasks", required=True, help="JSONL file of tasks (OpenAI RFT rows)")
    p.add_argument("--completions", nargs="+", help="literal completions to score (single-turn)")
    p.add_argument("--base-url", default=None)
    p.add_argument("--model", default=None)
    p.add_argument("--api-key", default=None)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--n", type=int, default=0, help="use only the first N tasks")
    p.add_argument("--samples", type=int, default=1, help="episodes per task with --model")
    p.add_argument("--config", default=None, help="JSON config for the environment")
    p.add_argument("--allow-unsandboxed", action="store_true", help="development machines without bwrap")
    p.add_argument("--verbose", action="store_true", help="print whole conversations")
    p.set_defaults(func=cmd_test)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        code: int = args.func(args)
        return code
    except EnvSDKError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    raise SystemExit(main())

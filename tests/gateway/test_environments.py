"""Environment packages end to end: pack, upload (checked in the sandbox), train with a real worker, score.

One worker process serves this module. Every job trains a few GRPO steps of the tiny model.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import tarfile
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from envsdk.archive import pack
from tests.support.fixtures import worker_fixture
from tests.support.jobs import metrics, upload_rows, wait_for
from tests.support.stack import GatewayServer, Tenant, WorkerProcess

pytestmark = pytest.mark.slow

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "envs"
HYPERPARAMETERS = {
    "batch_size": 2,
    "num_generations": 2,
    "max_completion_length": 40,
    "max_steps": 3,
    "checkpoint_every": 10,
}
PROBE = """import os

from envsdk import ToolEnv, tool


class ProbeEnv(ToolEnv):
    @tool
    def where(self) -> str:
        \"\"\"Tell where this tool runs.\"\"\"
        return f"uid={os.getuid()} pid={os.getpid()}"

    def reward(self, task, messages):
        return 1.0 if any(m.get("role") == "tool" for m in messages) else 0.0
"""


worker = worker_fixture(of="stack")


def write_package(root: Path, name: str, entrypoint: str, code: str, **limits: Any) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    toml = f'name = "{name}"\nversion = "0.1.0"\nentrypoint = "{entrypoint}"\n'
    if limits:
        toml += "\n[limits]\n" + "".join(f"{k} = {v}\n" for k, v in limits.items())
    (root / "environment.toml").write_text(toml)
    (root / f"{entrypoint.split(':')[0]}.py").write_text(code)
    return root


def upload_package(t: Tenant, src: Path, tmp: Path) -> str:
    archive, _ = pack(src, tmp / f"{src.name}.tar.gz")
    return t.client.files.create(file=(archive.name, archive.read_bytes()), purpose="environment").id


def tasks_of(name: str) -> list[dict[str, Any]]:
    return [json.loads(line) for line in (EXAMPLES / name / "tasks.jsonl").read_text().splitlines() if line]


def create_job(t: Tenant, env_file: str, tasks: str, **config: Any) -> Any:
    return t.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=tasks,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "environment": {"file_id": env_file, "config": config},
                "hyperparameters": HYPERPARAMETERS,
            },
        },  # type: ignore[typeddict-unknown-key]
    )


def run_env(stack: GatewayServer, t: Tenant, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(
        f"{stack.url}/v1/fine_tuning/alpha/environments/run",
        json=body,
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=60,
    )


@pytest.mark.parametrize(
    "name",
    [
        "arithmetic",
        "guess_number",
        "calculator",
        "trl_arithmetic",
        "openenv_guess",
        "verifiers_arithmetic",
        "atropos_arithmetic",
    ],
)
def test_example_environment_job_succeeds(
    stack: GatewayServer, worker: WorkerProcess, tenant: Tenant, tmp_path: Path, name: str
) -> None:
    env_file = upload_package(tenant, EXAMPLES / name, tmp_path)
    assert tenant.client.files.retrieve(env_file).purpose == "environment"
    # the calculator's episodes open with the task's tool call, so its tool runs during training
    config = {"force_first_tool_call": True} if name == "calculator" else {}
    job = create_job(tenant, env_file, upload_rows(tenant, tasks_of(name)), **config)
    done = wait_for(tenant, job.id)
    assert done.status == "succeeded", done.error
    assert done.fine_tuned_model and done.trained_tokens and done.trained_tokens > 0
    steps = metrics(tenant, job.id)
    assert [d["step"] for d in steps] == [1, 2, 3]
    for data in steps:
        # trl: two reward functions summed, each at most 1; openenv: three guesses, 0.1 for a number and 1
        # for the right one; verifiers: two reward functions weighted 1.0 and 0.5 by its rubric
        most = {"trl_arithmetic": 2.0, "openenv_guess": 1.2, "verifiers_arithmetic": 1.5}.get(name, 1.0)
        assert 0.0 <= data["reward_mean"] <= most and "rewards/environment" in data
        assert data["episode_failures"] == 0
        if name in ("arithmetic", "verifiers_arithmetic", "atropos_arithmetic"):
            assert "turns_mean" not in data
        else:  # episodes of one or more turns, each turn answered by the environment in its sandbox
            assert 1.0 <= data["turns_mean"] <= 6.0 and data["tool_calls_mean"] >= 0.0
        if name == "calculator":  # tool calls were made, each inside the sandbox (non-root uid, own PID
            # namespace, none of the worker's TUNEGATE_* settings such as the database URL visible)
            assert data["tool_calls_mean"] >= 1.0 and data["tools/calls"] >= 1.0
            assert data["tools/sandboxed_fraction"] == 1.0
        if name == "trl_arithmetic":  # written for TRL: its reward functions, one of them TRL's own
            # (trl.rewards.think_format_reward, from trl installed in the package's venv), each scored
            assert {"reward/correct_answer", "reward/think_format_reward"} <= set(data), sorted(data.items())
        if name == "openenv_guess":  # written for OpenEnv: its own server (openenv-core's create_app,
            # from the package's venv) ran in the sandbox and stepped the model's replies as its Action
            assert data["openenv/steps"] > 0.0, sorted(data.items())
    if name == "verifiers_arithmetic":  # written for verifiers: load_environment() built it in the sandbox,
        # from verifiers in the package's venv, and its vf.Rubric scores: 1.0 * exact + 0.5 * present
        task = tasks_of(name)[0]
        for completion, reward in ((task["answer"], 1.5), (f"It is {task['answer']}.", 0.5), ("no", 0.0)):
            scored = run_env(stack, tenant, {"file_id": env_file, "task": task, "completion": completion})
            assert scored.status_code == 200, scored.text
            assert scored.json()["kind"] == "single_turn" and scored.json()["reward"] == reward
    if name == "atropos_arithmetic":  # written for Atropos: its BaseEnv (atroposlib from the package's venv)
        # judged each group with its own collect_trajectories and score: 1.0 exact, 0.5 present, else 0.0
        task = tasks_of(name)[0]
        for completion, reward in ((task["answer"], 1.0), (f"It is {task['answer']}.", 0.5), ("no", 0.0)):
            scored = run_env(stack, tenant, {"file_id": env_file, "task": task, "completion": completion})
            assert scored.status_code == 200, scored.text
            assert scored.json()["kind"] == "single_turn" and scored.json()["reward"] == reward


def test_environment_run_scores_and_runs_tools_in_the_sandbox(
    stack: GatewayServer, tenant: Tenant, other_tenant: Tenant, tmp_path: Path
) -> None:
    arithmetic = upload_package(tenant, EXAMPLES / "arithmetic", tmp_path)
    task = tasks_of("arithmetic")[0]
    exact = run_env(stack, tenant, {"file_id": arithmetic, "task": task, "completion": task["answer"]})
    assert exact.status_code == 200, exact.text
    assert exact.json()["reward"] == 1.0 and exact.json()["kind"] == "single_turn"
    no_credit = {"file_id": arithmetic, "task": task, "completion": "7", "config": {"partial_credit": False}}
    assert run_env(stack, tenant, no_credit).json()["reward"] == 0.0

    calculator = upload_package(tenant, EXAMPLES / "calculator", tmp_path)
    call = '<tool_call>{"name": "calculate", "arguments": {"expression": "37 * 41"}}</tool_call>'
    body = {"file_id": calculator, "task": tasks_of("calculator")[0], "completion": call}
    turn = run_env(stack, tenant, body).json()
    assert turn["kind"] == "tool" and turn["error"] is None
    assert turn["messages"][-1] == {"role": "tool", "tool_call_id": "call_0", "content": "1517"}

    probe = upload_package(
        tenant, write_package(tmp_path / "probe", "probe", "probe_env:ProbeEnv", PROBE), tmp_path
    )
    call = '<tool_call>{"name": "where", "arguments": {}}</tool_call>'
    task = {"messages": [{"role": "user", "content": "Where are you?"}]}
    answer = run_env(stack, tenant, {"file_id": probe, "task": task, "completion": call}).json()
    evidence = dict(part.split("=", 1) for part in answer["messages"][-1]["content"].split())
    assert int(evidence["uid"]) not in (0, os.getuid())  # the sandbox's own unprivileged uid
    assert int(evidence["pid"]) < 10  # its own PID namespace

    theirs = run_env(stack, other_tenant, {"file_id": probe, "task": task, "completion": call})
    assert theirs.status_code == 404 and theirs.json()["error"]["param"] == "file_id"


def _tar(members: dict[str, bytes], *, mode: str = "w:gz") -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode=mode) as tar:  # type: ignore[call-overload]
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_hostile_uploads_are_refused(tenant: Tenant) -> None:
    manifest = b'name = "x"\nversion = "1"\nentrypoint = "env:Env"\n'
    code = (
        b"from envsdk import SingleTurnEnv\n\n"
        b"class Env(SingleTurnEnv):\n    def reward(self, t, c):\n        return 1.0\n"
    )
    bomb = io.BytesIO()
    with gzip.GzipFile(fileobj=bomb, mode="wb") as gz:
        with tarfile.open(fileobj=gz, mode="w") as tar:
            info = tarfile.TarInfo("zeros.bin")
            info.size = 64 * 1024 * 1024
            tar.addfile(info, io.BytesIO(bytes(info.size)))
    cases = {
        "traversal": (_tar({"environment.toml": manifest, "../escape.py": code}), "'..'"),
        "no manifest": (_tar({"env.py": code}), "environment.toml"),
        "missing entrypoint": (_tar({"environment.toml": manifest.replace(b"env:Env", b"gone:Env")}), "gone"),
        "compression bomb": (bomb.getvalue(), "compression bomb"),
    }
    for label, (data, words) in cases.items():
        with pytest.raises(openai.BadRequestError) as err:
            tenant.client.files.create(file=("package.tar.gz", data), purpose="environment")
        error = err.value.body
        assert isinstance(error, dict), label
        assert error["code"] == "invalid_environment" and error["param"] == "file", (label, error)
        assert words in error["message"], (label, error["message"])
    assert list(tenant.client.files.list(purpose="environment")) == []  # nothing was stored
    accepted = tenant.client.files.create(
        file=("ok.tar.gz", _tar({"environment.toml": manifest, "env.py": code})), purpose="environment"
    )
    assert accepted.purpose == "environment"


def test_hostile_environments_fail_their_own_jobs(
    stack: GatewayServer, worker: WorkerProcess, tenant: Tenant, other_tenant: Tenant, tmp_path: Path
) -> None:
    looping = write_package(
        tmp_path / "looping",
        "looping",
        "loop_env:Env",
        "from envsdk import SingleTurnEnv\n\n\nclass Env(SingleTurnEnv):\n"
        "    def reward(self, task, completion):\n        while True:\n            pass\n",
        timeout_s=2,
    )
    raising = write_package(
        tmp_path / "raising",
        "raising",
        "raise_env:Env",
        "from envsdk import SingleTurnEnv\n\n\nclass Env(SingleTurnEnv):\n"
        "    def reward(self, task, completion):\n        raise ValueError('no reward for you')\n",
    )
    tasks = upload_rows(tenant, tasks_of("arithmetic")[:4])
    loop_job = create_job(tenant, upload_package(tenant, looping, tmp_path), tasks)
    raise_job = create_job(tenant, upload_package(tenant, raising, tmp_path), tasks)
    good_job = create_job(tenant, upload_package(tenant, EXAMPLES / "arithmetic", tmp_path), tasks)

    looped = wait_for(tenant, loop_job.id)
    assert looped.status == "failed" and looped.error is not None
    assert "looping" in looped.error.message and "did not answer within 2 s" in looped.error.message
    raised = wait_for(tenant, raise_job.id)
    assert raised.status == "failed" and raised.error is not None
    assert "ValueError: no reward for you" in raised.error.message
    assert wait_for(tenant, good_job.id).status == "succeeded"

    # another organisation's environment cannot be named in a job
    theirs = upload_package(other_tenant, EXAMPLES / "arithmetic", tmp_path)
    with pytest.raises(openai.BadRequestError) as err:
        create_job(tenant, theirs, tasks)
    assert isinstance(err.value.body, dict)
    assert err.value.body["param"] == "method.reinforcement.environment.file_id"

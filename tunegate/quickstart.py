"""`tunegate quickstart`: the newcomer's first five minutes, end to end through the public API.

Starts the stack (`tunegate up` in a child process) unless one already answers, makes an organisation and a
key with the admin API, packs and uploads the example environment, runs a short reinforcement-learning job
on `tiny-chat` with live progress, chats with the base and the fine-tuned model side by side, and draws the
reward curve in the terminal and as a PNG in the data dir.

The environment path comes first; when the job fails on it (an older trainer without environment support,
for instance), the same tasks run again with an OpenAI `text_similarity` grader so the tour still ends with
a served fine-tuned model.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from gateway.settings import Settings
from tunegate.client import root_url

if TYPE_CHECKING:
    import openai
    from rich.console import Console

    from tunegate.follow import FollowResult

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_ENV = REPO_ROOT / "examples" / "envs" / "arithmetic"
BASE_MODEL = "tiny-chat"
READY_TIMEOUT_S = 300.0

FALLBACK_GRADER: dict[str, Any] = {
    "type": "text_similarity",
    "name": "close_to_answer",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "evaluation_metric": "fuzzy_match",
}
"""The grader used when the environment path fails: closeness of the answer text to the right number."""


def rl_hyperparameters(steps: int) -> dict[str, Any]:
    """Hyperparameters that move the tiny model visibly within `steps` GRPO steps on two CPU cores."""
    return {
        "batch_size": 4,
        "num_generations": 4,
        "max_completion_length": 8,
        "learning_rate_multiplier": 3000,
        "temperature": 1.0,
        "max_steps": steps,
        "n_epochs": 50,
        "checkpoint_every": max(steps, 1),
    }


def environment_method(env_file_id: str, steps: int) -> dict[str, Any]:
    """An RL method whose rewards come from an uploaded environment package."""
    return {
        "type": "reinforcement",
        "reinforcement": {
            "environment": {"file_id": env_file_id, "config": {"partial_credit": True}},
            "hyperparameters": rl_hyperparameters(steps),
        },
    }


def grader_method(steps: int) -> dict[str, Any]:
    """The same RL run with an OpenAI grader instead of an environment."""
    return {
        "type": "reinforcement",
        "reinforcement": {"grader": FALLBACK_GRADER, "hyperparameters": rl_hyperparameters(steps)},
    }


# ---- the stack --------------------------------------------------------------------------------------


def stack_ready(root: str, timeout: float = 2.0) -> bool:
    """Whether a gateway at `root` answers `/readyz` with 200."""
    try:
        return httpx.get(f"{root}/readyz", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


@dataclass
class StackProcess:
    """`tunegate up` as a child process in its own session, its output in a log file."""

    proc: subprocess.Popen[bytes]
    log_path: Path
    _log: IO[bytes] | None = None

    @classmethod
    def start(cls, *, data_dir: Path, host: str, port: int, engine_port: int | None = None) -> StackProcess:
        data_dir.mkdir(parents=True, exist_ok=True)
        log_path = data_dir / "stack.log"
        log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        argv = [sys.executable, "-m", "tunegate", "up", "--data-dir", str(data_dir)]
        argv += ["--host", host, "--port", str(port)]
        if engine_port is not None:
            argv += ["--engine-port", str(engine_port)]
        proc = subprocess.Popen(
            argv, stdout=log, stderr=subprocess.STDOUT, cwd=str(REPO_ROOT), start_new_session=True
        )
        logger.info("started tunegate up (pid %s), log in %s", proc.pid, log_path)
        return cls(proc, log_path, log)

    def wait_ready(self, root: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until `/readyz` answers; raises `RuntimeError` when the stack exits or time runs out."""
        deadline = time.monotonic() + timeout_s
        while not stack_ready(root):
            if self.proc.poll() is not None:
                code = self.proc.returncode
                raise RuntimeError(f"tunegate up exited with code {code}; see {self.log_path}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"the stack was not ready within {timeout_s:.0f}s; see {self.log_path}")
            time.sleep(0.5)

    def stop(self, timeout_s: float = 90.0) -> int | None:
        """SIGTERM, then wait (the stack stops its worker, engine and databases); SIGKILL the session last."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout_s)
            except subprocess.TimeoutExpired:
                logger.warning("tunegate up did not stop within %.0fs: killing it", timeout_s)
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None
        return self.proc.returncode


# ---- tenancy and uploads ----------------------------------------------------------------------------


def admin_key_for(data_dir: Path) -> str | None:
    """The admin key of the stack whose data dir is `data_dir` (settings first, then the stored file)."""
    settings = Settings(data_dir=data_dir)
    return settings.admin_key_value()


def create_tenant(root: str, admin_key: str, name: str) -> tuple[str, str]:
    """An organisation and an API key through the admin API. Returns (org id, key)."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=root, headers=headers, timeout=30) as http:
        org = http.post("/v1/admin/organizations", json={"name": name})
        org.raise_for_status()
        org_id: str = org.json()["id"]
        key = http.post(f"/v1/admin/organizations/{org_id}/api_keys", json={"name": "quickstart"})
        key.raise_for_status()
        return org_id, key.json()["key"]


def upload_environment(client: openai.OpenAI, env_dir: Path, workdir: Path) -> str:
    """Pack `env_dir` with `envsdk.archive.pack` and upload it (purpose `environment`); returns its id."""
    from envsdk.archive import pack

    workdir.mkdir(parents=True, exist_ok=True)
    archive, _sha = pack(env_dir, workdir / f"{env_dir.name}.tar.gz")
    with open(archive, "rb") as fh:
        return client.files.create(file=(archive.name, fh), purpose="environment").id  # type: ignore[arg-type]


def upload_tasks(client: openai.OpenAI, tasks_path: Path) -> str:
    """Upload a tasks JSONL file (purpose `fine-tune`); returns the file id."""
    with open(tasks_path, "rb") as fh:
        return client.files.create(file=(tasks_path.name, fh), purpose="fine-tune").id


def load_prompts(tasks_path: Path, n: int) -> list[str]:
    """The user prompts of the first `n` tasks."""
    prompts = []
    for line in tasks_path.read_text().splitlines():
        if line.strip():
            messages = json.loads(line)["messages"]
            prompts.append(next(m["content"] for m in messages if m["role"] == "user"))
        if len(prompts) == n:
            break
    return prompts


def answer(client: openai.OpenAI, model: str, prompt: str, max_tokens: int = 16) -> str:
    """One greedy chat completion through the gateway."""
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        max_tokens=max_tokens,
        temperature=0.0,
    )
    return (out.choices[0].message.content or "").strip()


# ---- the tour ---------------------------------------------------------------------------------------


@dataclass
class QuickstartReport:
    """Where everything lives after a quickstart run."""

    data_dir: Path
    base_url: str
    org_id: str = ""
    api_key: str = ""
    reward_source: str = ""
    """`environment` or `grader`: which path trained the model."""
    job_id: str = ""
    fine_tuned_model: str | None = None
    rewards: list[float] = field(default_factory=list)
    png: Path | None = None
    answers: list[tuple[str, str, str]] = field(default_factory=list)
    """(prompt, base answer, fine-tuned answer) per prompt."""
    started_stack: bool = False


def _train(
    client: openai.OpenAI, console: Console, method: dict[str, Any], training_file: str, timeout_s: float
) -> FollowResult:
    from tunegate.follow import follow_job

    job = client.fine_tuning.jobs.create(
        model=BASE_MODEL,
        training_file=training_file,
        method=method,  # type: ignore[arg-type]  # extensions (environment, extra hyperparameters)
        suffix="quickstart",
        seed=1,
    )
    console.print(f"job [bold]{job.id}[/bold] created", highlight=False)
    return follow_job(client, job.id, console=console, poll_s=0.5, timeout_s=timeout_s)


def run_tour(
    client: openai.OpenAI,
    console: Console,
    report: QuickstartReport,
    *,
    env_dir: Path = EXAMPLE_ENV,
    steps: int = 40,
    job_timeout_s: float = 600.0,
) -> QuickstartReport:
    """Upload, train (environment first, grader if that fails), compare answers and draw the curve."""
    from rich.table import Table

    from tunegate.plot import save_curve, sparkline

    tasks = env_dir / "tasks.jsonl"
    training_file = upload_tasks(client, tasks)
    result: FollowResult | None = None
    try:
        env_file = upload_environment(client, env_dir, report.data_dir / "quickstart")
        console.print(f"uploaded environment {env_dir.name} as {env_file}", highlight=False)
        console.rule("reinforcement learning with the environment")
        result = _train(client, console, environment_method(env_file, steps), training_file, job_timeout_s)
        report.reward_source = "environment"
    except Exception as exc:  # noqa: BLE001 - any refusal of the environment path: take the grader path
        console.print(f"[yellow]the environment path was refused: {exc}[/yellow]", highlight=False)
    if result is None or result.job.status != "succeeded":
        console.rule("reinforcement learning with a grader (fallback)")
        result = _train(client, console, grader_method(steps), training_file, job_timeout_s)
        report.reward_source = "grader"
    report.job_id = result.job.id
    report.fine_tuned_model = result.job.fine_tuned_model
    if result.job.status != "succeeded" or not report.fine_tuned_model:
        raise RuntimeError(f"the quickstart job {result.job.id} ended {result.job.status}")

    steps_seen, rewards = result.series("reward_mean")
    report.rewards = rewards
    if rewards:
        console.rule("reward per step")
        console.print(f"{rewards[0]:.3f} {sparkline(rewards)} {rewards[-1]:.3f}", highlight=False)
        report.png = save_curve(
            steps_seen,
            rewards,
            report.data_dir / "quickstart" / "reward.png",
            title=f"{report.fine_tuned_model} ({report.reward_source})",
            ylabel="mean reward",
        )

    console.rule("base vs fine-tuned")
    table = Table("prompt", BASE_MODEL, "fine-tuned")
    for prompt in load_prompts(tasks, 3):
        row = (prompt, answer(client, BASE_MODEL, prompt), answer(client, report.fine_tuned_model, prompt))
        report.answers.append(row)
        table.add_row(*row)
    console.print(table)
    return report


def print_summary(console: Console, report: QuickstartReport, keep_running: bool) -> None:
    """Where everything lives."""
    lines = [
        f"data dir:         {report.data_dir}",
        f"admin key file:   {report.data_dir / 'admin_key'}",
        f"gateway:          {report.base_url}",
        f"organisation:     {report.org_id}",
        f"API key:          {report.api_key}",
        f"job:              {report.job_id} (rewards from the {report.reward_source})",
        f"fine-tuned model: {report.fine_tuned_model}",
    ]
    if report.png is not None:
        lines.append(f"reward curve:     {report.png}")
    if report.started_stack:
        lines.append(f"stack log:        {report.data_dir / 'stack.log'}")
        lines.append("the stack is still running" if keep_running else "the stack was stopped")
    console.rule("where everything lives")
    console.print("\n".join(lines), highlight=False)


def run_quickstart(
    settings: Settings,
    *,
    console: Console,
    base_url: str,
    keep_running: bool = False,
    steps: int = 40,
    engine_port: int | None = None,
    env_dir: Path = EXAMPLE_ENV,
) -> QuickstartReport:
    """The whole quickstart. `base_url` ends in `/v1`; `settings.data_dir` is the stack's data dir."""
    import openai

    root = root_url(base_url)
    report = QuickstartReport(data_dir=settings.data_dir.resolve(), base_url=base_url)
    stack: StackProcess | None = None
    if stack_ready(root):
        console.print(f"a gateway already answers at {root}", highlight=False)
    else:
        parts = urlsplit(root)
        console.print(f"starting the stack in {report.data_dir} (log: stack.log) ...", highlight=False)
        stack = StackProcess.start(
            data_dir=report.data_dir,
            host=parts.hostname or settings.host,
            port=parts.port or settings.port,
            engine_port=engine_port,
        )
        report.started_stack = True
    try:
        if stack is not None:
            stack.wait_ready(root)
            console.print(f"the stack is ready at {root}", highlight=False)
        admin_key = settings.admin_key_value()
        if not admin_key:
            raise RuntimeError(
                f"no admin key in {report.data_dir / 'admin_key'}: pass the --data-dir of the running stack "
                "or set TUNEGATE_ADMIN_KEY"
            )
        report.org_id, report.api_key = create_tenant(root, admin_key, "quickstart")
        console.print(f"organisation {report.org_id} and a key made with the admin API", highlight=False)
        client = openai.OpenAI(base_url=base_url, api_key=report.api_key, timeout=120, max_retries=2)
        run_tour(client, console, report, env_dir=env_dir, steps=steps)
    finally:
        if stack is not None and not keep_running:
            console.print("stopping the stack ...", highlight=False)
            stack.stop()
    print_summary(console, report, keep_running)
    return report

"""`tunegate quickstart`: the newcomer's first minutes, end to end through the public API.

Starts the stack (`tunegate up` in a child process, `--engine` passed on) unless one already answers, says
which engine serves `tiny-chat` (vLLM where it is installed, else the embedded engine) and how to choose the
other, makes an organisation and a key with the admin API, packs and uploads the arithmetic example
environment with its tasks and its held-out problems, and runs a reinforcement-learning job on `tiny-chat`
with the default hyperparameters and live progress. Then it measures what training did: one eval (OpenAI's
Evals API) scores the base model and the fine-tuned model on held-out problems that training never saw, and
it prints
`held-out exact answers: base X% -> fine-tuned Y%`, a table of answers, and the train and validation reward
curves (in the terminal, and as a PNG in the data dir), then where everything lives: what the run found and
how it is told is `tunegate.quickstart_report`. Any failure stops the tour with its cause.
"""

from __future__ import annotations

import json
import logging
import re
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import httpx

from gateway.settings import Settings
from tunegate.client import provision_tenant, root_url
from tunegate.processes import Process
from tunegate.quickstart_report import (
    BASE_MODEL,
    QuickstartReport,
    print_heldout,
    print_summary,
    show_rewards,
)

if TYPE_CHECKING:
    import openai
    from rich.console import Console

    from tunegate.follow import FollowResult

logger = logging.getLogger(__name__)

REPO_ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_ENV = REPO_ROOT / "examples" / "envs" / "arithmetic"
READY_TIMEOUT_S = 300.0
EXACT = {
    "type": "string_check",
    "name": "exact",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "eq",
}
"""The held-out eval's criterion: the answer is exactly the number."""
QUESTION_ITEMS: dict[str, Any] = {
    "type": "custom",
    "item_schema": {
        "type": "object",
        "properties": {"question": {"type": "string"}, "answer": {"type": "string"}},
        "required": ["question", "answer"],
    },
    "include_sample_schema": True,
}
"""The held-out eval's items: a question and its answer, both text (its `data_source_config`)."""
SERVED_BY = re.compile(r"^(?P<models>.+): served by (?P<engine>.+) at (?P<url>https?://\S+)$")
"""A line of `tunegate up` naming the engine that serves some base models."""


class QuickstartError(RuntimeError):
    """A step of the tour failed; the message says which and why."""


def environment_method(env_file_id: str) -> dict[str, Any]:
    """An RL method whose rewards come from an uploaded environment package; every hyperparameter "auto"."""
    return {
        "type": "reinforcement",
        "reinforcement": {"environment": {"file_id": env_file_id, "config": {"partial_credit": True}}},
    }


# ---- the stack --------------------------------------------------------------------------------------


def stack_ready(root: str, timeout: float = 2.0) -> bool:
    """Whether a gateway at `root` answers `/readyz` with 200."""
    try:
        return httpx.get(f"{root}/readyz", timeout=timeout).status_code == 200
    except httpx.HTTPError:
        return False


class StackProcess(Process):
    """`tunegate up` as a child process in its own session, its output in `stack.log` of the data dir."""

    @classmethod
    def start(
        cls,
        *,
        data_dir: Path,
        host: str,
        port: int,
        engine_port: int | None = None,
        engine: str | None = None,
    ) -> StackProcess:
        data_dir.mkdir(parents=True, exist_ok=True)
        argv = [sys.executable, "-m", "tunegate", "up", "--data-dir", str(data_dir)]
        argv += ["--host", host, "--port", str(port)]
        if engine_port is not None:
            argv += ["--engine-port", str(engine_port)]
        if engine is not None:
            argv += ["--engine", engine]
        # stopping waits for the stack to stop its worker, engine and databases
        stack = cls(argv, data_dir / "stack.log", name="tunegate up", cwd=REPO_ROOT, stop_timeout_s=90.0)
        logger.info("started tunegate up (pid %s), log in %s", stack.pid, stack.log_path)
        return stack

    def wait_ready(self, root: str, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Wait until `/readyz` answers 200; raises `RuntimeError` when the stack exits or time runs out."""
        self.wait_http(f"{root}/readyz", timeout_s, status=200)

    def engines(self) -> list[str]:
        """What the stack said about its engines once they were ready (`tunegate.stack._say_engines`): a
        `MODEL: served by ENGINE at URL` line for each engine, after `vLLM is not used: WHY` where `auto`
        fell back to the embedded engine."""
        if self.log_path is None or not self.log_path.exists():
            return []
        lines = self.log_path.read_text(errors="replace").splitlines()
        return [line for line in lines if SERVED_BY.match(line) or line.startswith("vLLM is not used: ")]


def engine_summary(lines: list[str]) -> str:
    """One sentence from `StackProcess.engines`: what serves `tiny-chat` and how to choose the other engine
    (empty when the lines name no engine)."""
    served = {m["models"]: m["engine"] for line in lines if (m := SERVED_BY.match(line))}
    engine = next((e for models, e in served.items() if BASE_MODEL in models.split(", ")), None)
    if engine is None:
        return ""
    if engine.startswith("vLLM"):
        return f"{BASE_MODEL} is served by {engine}; --engine embedded serves it with tunegate's own engine"
    why = next((line for line in lines if line.startswith("vLLM is not used: ")), "")
    other = why or "--engine vllm serves it with vLLM (scripts/install adds it)"
    return f"{BASE_MODEL} is served by {engine}; {other}"


# ---- tenancy and uploads ----------------------------------------------------------------------------


def admin_key_for(data_dir: Path) -> str | None:
    """The admin key of the stack whose data dir is `data_dir` (settings first, then the stored file)."""
    settings = Settings(data_dir=data_dir)
    return settings.admin_key_value()


def create_tenant(root: str, admin_key: str, name: str) -> tuple[str, str]:
    """An organisation and an API key through the admin API. Returns (org id, key)."""
    headers = {"Authorization": f"Bearer {admin_key}"}
    with httpx.Client(base_url=root, headers=headers, timeout=30) as http:
        made = provision_tenant(http, name, "quickstart")
        return made.org_id, made.key


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


def read_tasks(tasks_path: Path) -> list[dict[str, Any]]:
    """The rows of a tasks JSONL file."""
    return [json.loads(line) for line in tasks_path.read_text().splitlines() if line.strip()]


def question_of(task: dict[str, Any]) -> str:
    """The user's question of a task row."""
    return str(next(m["content"] for m in task["messages"] if m["role"] == "user"))


# ---- the tour ---------------------------------------------------------------------------------------


def _train(
    client: openai.OpenAI,
    console: Console,
    env_file: str,
    training_file: str,
    validation_file: str,
    timeout_s: float,
) -> FollowResult:
    from tunegate.follow import estimate_job, follow_job, print_estimate

    body: dict[str, Any] = {
        "model": BASE_MODEL,
        "training_file": training_file,
        "validation_file": validation_file,
        "method": environment_method(env_file),
        "suffix": "quickstart",
        "seed": 1,
    }
    estimate = estimate_job(client, **body)
    if estimate is not None:
        print_estimate(console, estimate)
    job = client.fine_tuning.jobs.create(**body)
    hp = job.method.reinforcement.hyperparameters if job.method and job.method.reinforcement else None
    console.print(f"job [bold]{job.id}[/bold] created", highlight=False)
    if hp is not None:
        extra = hp.model_extra or {}
        console.print(
            f"hyperparameters (auto): {hp.batch_size} prompts x {extra.get('num_generations')} answers a "
            f"step, {hp.n_epochs} epochs, learning rate {extra.get('learning_rate'):.1e}",
            highlight=False,
        )
    return follow_job(client, job.id, console=console, poll_s=0.5, timeout_s=timeout_s)


def _run_eval(client: openai.OpenAI, eval_id: str, model: str, items: list[dict[str, Any]]) -> Any:
    """One eval run of `model` on `items` (greedy answers), waited for."""
    run: Any = client.evals.runs.create(
        eval_id,
        name=model,
        data_source={
            "type": "completions",
            "model": model,
            "input_messages": {
                "type": "template",
                "template": [{"role": "user", "content": "{{ item.question }}"}],
            },
            "sampling_params": {"temperature": 0.0, "max_completion_tokens": 16},
            "source": {"type": "file_content", "content": [{"item": item} for item in items]},
        },
    )
    deadline = time.monotonic() + 300
    while run.status in ("queued", "in_progress"):
        if time.monotonic() > deadline:
            raise QuickstartError(f"eval run {run.id} of {model} did not finish within 300 s")
        time.sleep(0.5)
        run = client.evals.runs.retrieve(run.id, eval_id=eval_id)
    if run.status != "completed":
        raise QuickstartError(f"eval run {run.id} of {model} ended {run.status}: {run.error}")
    return run


def _run_answers(client: openai.OpenAI, eval_id: str, run: Any) -> dict[str, str]:
    """The run's answer to each question."""
    answers: dict[str, str] = {}
    for item in client.evals.runs.output_items.list(run.id, eval_id=eval_id, limit=100):
        output = item.sample.output[0].content if item.sample.output else ""
        answers[str(item.datasource_item.get("question"))] = (output or "").strip()
    return answers


def compare_on_heldout(
    client: openai.OpenAI, report: QuickstartReport, heldout: list[dict[str, Any]]
) -> None:
    """Score the base and the fine-tuned model on the held-out problems with one eval (two runs)."""
    assert report.fine_tuned_model is not None
    items = [{"question": question_of(t), "answer": str(t["answer"])} for t in heldout]
    ev = client.evals.create(
        name="arithmetic held-out",
        data_source_config=QUESTION_ITEMS,  # type: ignore[arg-type]
        testing_criteria=[EXACT],  # type: ignore[list-item]
    )
    report.eval_id = ev.id
    base = _run_eval(client, ev.id, BASE_MODEL, items)
    tuned = _run_eval(client, ev.id, report.fine_tuned_model, items)
    report.base_exact = base.result_counts.passed / max(base.result_counts.total, 1)
    report.tuned_exact = tuned.result_counts.passed / max(tuned.result_counts.total, 1)
    base_answers, tuned_answers = _run_answers(client, ev.id, base), _run_answers(client, ev.id, tuned)
    report.answers = [
        (
            i["question"],
            i["answer"],
            base_answers.get(i["question"], ""),
            tuned_answers.get(i["question"], ""),
        )
        for i in items
    ]


def run_tour(
    client: openai.OpenAI,
    console: Console,
    report: QuickstartReport,
    *,
    env_dir: Path = EXAMPLE_ENV,
    job_timeout_s: float = 900.0,
) -> QuickstartReport:
    """Upload, train with the environment, compare base and fine-tuned on held-out problems, draw curves."""
    tasks, heldout_path = env_dir / "tasks.jsonl", env_dir / "heldout.jsonl"
    heldout = read_tasks(heldout_path)
    training_file = upload_tasks(client, tasks)
    validation_file = upload_tasks(client, heldout_path)
    env_file = upload_environment(client, env_dir, report.data_dir / "quickstart")
    console.print(
        f"uploaded environment {env_dir.name} ({env_file}), {len(read_tasks(tasks))} training problems and "
        f"{len(heldout)} held-out problems",
        highlight=False,
    )
    console.rule("reinforcement learning with the environment")
    result = _train(client, console, env_file, training_file, validation_file, job_timeout_s)
    report.job_id = result.job.id
    report.fine_tuned_model = result.job.fine_tuned_model
    if result.job.status in ("validating_files", "queued", "running"):
        raise QuickstartError(
            f"the job {result.job.id} is still {result.job.status} after {job_timeout_s:.0f} s: it trains "
            "slowly on a machine this busy"
        )
    if result.job.status != "succeeded" or not report.fine_tuned_model:
        error = result.job.error
        cause = f": {error.code}: {error.message}" if error is not None and error.message else ""
        raise QuickstartError(f"the job {result.job.id} ended {result.job.status}{cause}")

    console.rule("held-out problems (never trained on)")
    compare_on_heldout(client, report, heldout)
    print_heldout(console, report)
    show_rewards(console, report, result)
    return report


def run_quickstart(
    settings: Settings,
    *,
    console: Console,
    base_url: str,
    keep_running: bool = False,
    engine_port: int | None = None,
    engine: str | None = None,
    env_dir: Path = EXAMPLE_ENV,
) -> QuickstartReport:
    """The whole quickstart. `base_url` ends in `/v1`; `settings.data_dir` is the stack's data dir; a stack
    started here serves with `engine` (`auto`, `vllm` or `embedded`; default: the `engine` setting)."""
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
            engine=engine,
        )
        report.started_stack = True
    try:
        if stack is not None:
            started = time.monotonic()
            stack.wait_ready(root)
            report.stack_start_s = time.monotonic() - started
            report.engine = engine_summary(stack.engines())
            console.print(f"the stack is ready at {root} ({report.stack_start_s:.0f} s)", highlight=False)
            if report.engine:
                console.print(report.engine, highlight=False)
        admin_key = settings.admin_key_value()
        if not admin_key:
            raise RuntimeError(
                f"no admin key in {report.data_dir / 'admin_key'}: pass the --data-dir of the running stack "
                "or set TUNEGATE_ADMIN_KEY"
            )
        report.org_id, report.api_key = create_tenant(root, admin_key, "quickstart")
        console.print(f"organisation {report.org_id} and a key made with the admin API", highlight=False)
        # Retries ride out a 503 with its retry-after: the first chat with the new model loads its adapter
        # into the engine, which a busy machine may not finish within one call's wait.
        client = openai.OpenAI(base_url=base_url, api_key=report.api_key, timeout=120, max_retries=6)
        run_tour(client, console, report, env_dir=env_dir)
    finally:
        if stack is not None and not keep_running:
            console.print("stopping the stack ...", highlight=False)
            stack.stop()
    print_summary(console, report, keep_running)
    return report

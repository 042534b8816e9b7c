"""The `tunegate` client commands: `jobs follow` on a real job, the quickstart's pieces, and (slow) a
whole quickstart that starts and stops its own stack."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from gateway.settings import Settings
from inference.vllm import VllmUnavailable, find_vllm
from tests.support.data import SFT
from tests.support.fixtures import worker_fixture
from tests.support.stack import (
    ROOT,
    GatewayServer,
    Services,
    Tenant,
    WorkerProcess,
    admin_of,
    command_lines,
    free_port,
    make_settings,
)
from tunegate.client import api_base_url, make_client, root_url
from tunegate.follow import follow_job
from tunegate.plot import resample, save_curve, save_curves, sparkline
from tunegate.quickstart import (
    EXAMPLE_ENV,
    create_tenant,
    environment_method,
    question_of,
    read_tasks,
    stack_ready,
    upload_environment,
)
from tunegate.quickstart_report import QuickstartReport, print_summary


def _cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = 240
) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("TUNEGATE_")}
    return subprocess.run(
        [sys.executable, "-m", "tunegate", *args],
        env={**clean, "COLUMNS": "200", **(env or {})},
        cwd=str(ROOT),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


# ---- pieces without a stack -------------------------------------------------------------------------


def test_sparkline_scales_lowest_to_highest() -> None:
    assert sparkline([0.0, 0.5, 1.0]) == "▁▅█"
    assert sparkline([2.0, 2.0]) == "▄▄"
    assert sparkline([]) == ""
    assert len(sparkline([float(i) for i in range(500)], width=40)) == 40
    assert resample([1.0, 3.0, 5.0, 7.0], 2) == [2.0, 6.0]


def test_reward_png_is_written(tmp_path: Path) -> None:
    path = save_curve([1, 2, 3], [0.1, 0.4, 0.3], tmp_path / "sub" / "reward.png", title="t", ylabel="r")
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 2000
    two = save_curves(
        [("train", [1, 2, 3], [0.1, 0.4, 0.3]), ("held-out", [0, 2], [0.2, 0.5])],
        tmp_path / "two.png",
        title="t",
        ylabel="r",
    )
    assert two.read_bytes()[:4] == b"\x89PNG" and two.stat().st_size != path.stat().st_size


def test_client_settings_from_options_and_settings() -> None:
    settings = Settings(host="10.0.0.5", port=9000)
    assert api_base_url(settings) == "http://10.0.0.5:9000/v1"
    assert api_base_url(settings, "http://gw:8000") == "http://gw:8000/v1"
    assert api_base_url(Settings(base_url="http://gw/v1/")) == "http://gw/v1"
    assert root_url("http://gw:8000/v1") == "http://gw:8000"
    with pytest.raises(ValueError, match="API key"):
        make_client(Settings())
    client = make_client(Settings(api_key="sk-tg-x", base_url="http://gw:1/v1"))  # type: ignore[arg-type]
    assert str(client.base_url).rstrip("/") == "http://gw:1/v1" and client.api_key == "sk-tg-x"


def test_quickstart_summary_ends_with_the_jobs_dashboard_page(tmp_path: Path) -> None:
    report = QuickstartReport(data_dir=tmp_path, base_url="http://127.0.0.1:8000/v1")
    report.job_id = "ftjob-" + "x" * 24
    console = Console(record=True, width=60)  # narrower than the line: it is still one line
    print_summary(console, report, keep_running=True)
    last = console.export_text().rstrip().splitlines()[-1]
    assert last.split() == ["dashboard:", f"http://127.0.0.1:8000/dashboard/jobs/{report.job_id}"]


def test_quickstart_method_and_tasks() -> None:
    env = environment_method("file-abc")["reinforcement"]
    assert env["environment"]["file_id"] == "file-abc" and "hyperparameters" not in env  # all "auto"
    tasks, heldout = read_tasks(EXAMPLE_ENV / "tasks.jsonl"), read_tasks(EXAMPLE_ENV / "heldout.jsonl")
    assert (len(tasks), len(heldout)) == (70, 30)
    questions = {question_of(t) for t in tasks}
    assert all(q.startswith("What is") for q in questions)
    assert not questions & {question_of(t) for t in heldout}  # held-out problems are never trained on


def test_models_add_registers_a_local_folder(tiny_model_dir: Path, tmp_path: Path) -> None:
    data_dir = tmp_path / "stack"
    out = _cli("models", "add", "my-model", str(tiny_model_dir), "--data-dir", str(data_dir))
    assert out.returncode == 0, out.stderr
    settings = Settings(data_dir=data_dir)
    assert settings.base_model_path("my-model") == tiny_model_dir.resolve()
    assert "tiny-chat" in settings.base_models  # added beside the configured ones
    # Tinker clients load its tokenizer from its folder; from the hub id a model was added from, where given
    assert settings.tokenizer_of("my-model") == str(tiny_model_dir.resolve())
    entries = json.loads((data_dir / "base_models.json").read_text())
    entries["my-model"]["tokenizer"] = "Qwen/Qwen2.5-0.5B-Instruct"
    (data_dir / "base_models.json").write_text(json.dumps(entries))
    assert Settings(data_dir=data_dir).tokenizer_of("my-model") == "Qwen/Qwen2.5-0.5B-Instruct"
    broken = tmp_path / "not-a-model"
    broken.mkdir()
    out = _cli("models", "add", "other", str(broken), "--data-dir", str(data_dir))
    assert out.returncode == 2 and "config.json" in out.stderr
    assert "other" not in Settings(data_dir=data_dir).base_models


def test_a_registered_model_can_be_fine_tuned(
    services: Services, database: str, tiny_model_dir: Path, tmp_path: Path
) -> None:
    """A gateway on a data dir where `models add` registered a model lists it and takes jobs for it."""
    data_dir = tmp_path / "stack"
    assert _cli("models", "add", "my-model", str(tiny_model_dir), "--data-dir", str(data_dir)).returncode == 0
    settings = make_settings(
        data_dir=data_dir, database_url=database, redis_url=services.redis_url, tiny_model=tiny_model_dir
    )
    assert settings.base_model_path("my-model") == tiny_model_dir.resolve()
    gateway = GatewayServer(settings).start()
    try:
        t = admin_of(gateway).tenant("registered")
        assert "my-model" in [m.id for m in t.client.models.list()]
        rows = "\n".join(json.dumps(r) for r in SFT).encode()
        training = t.client.files.create(file=("train.jsonl", rows), purpose="fine-tune").id
        job = t.client.fine_tuning.jobs.create(model="my-model", training_file=training)
        assert job.status == "queued" and job.model == "my-model"
        t.client.fine_tuning.jobs.cancel(job.id)
    finally:
        gateway.stop()


def test_models_add_explains_a_hub_id_it_cannot_fetch(tmp_path: Path) -> None:
    out = _cli(
        "models",
        "add",
        "qwen",
        "tunegate-test/no-such-model",
        "--data-dir",
        str(tmp_path),
        env={"HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path / "hf")},
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "cannot fetch tunegate-test/no-such-model" in out.stderr and "folder instead" in out.stderr


def test_follow_needs_an_api_key() -> None:
    out = _cli("jobs", "follow", "ftjob-x", "--base-url", "http://127.0.0.1:1/v1")
    assert out.returncode == 2 and "API key" in out.stderr


def test_quickstart_refuses_an_unknown_engine_before_starting_anything(tmp_path: Path) -> None:
    out = _cli("quickstart", "--engine", "gpu", "--data-dir", str(tmp_path / "qs"))
    assert out.returncode == 2 and "--engine must be auto, vllm or embedded" in out.stderr
    assert not (tmp_path / "qs").exists()


def test_docs_settings_command_prints_every_setting() -> None:
    out = _cli("docs-settings")
    assert out.returncode == 0
    for name in Settings.model_fields:
        assert f"`TUNEGATE_{name.upper()}`" in out.stdout


# ---- against the running stack ----------------------------------------------------------------------


def test_quickstart_helpers_against_the_stack(stack: GatewayServer, tenant: Tenant, tmp_path: Path) -> None:
    assert stack_ready(stack.url)
    assert not stack_ready(f"http://127.0.0.1:{free_port()}")
    key = stack.settings.admin_key
    assert key is not None
    org_id, api_key = create_tenant(stack.url, key.get_secret_value(), "qs-helpers")
    assert org_id.startswith("org-") and api_key.startswith("sk-tg-")
    file_id = upload_environment(tenant.client, EXAMPLE_ENV, tmp_path)
    uploaded = tenant.client.files.retrieve(file_id)
    assert uploaded.purpose == "environment" and uploaded.filename == "arithmetic.tar.gz"
    assert (tmp_path / "arithmetic.tar.gz").stat().st_size == uploaded.bytes


worker = worker_fixture(of="stack")


@pytest.mark.slow
def test_jobs_follow_a_supervised_job(stack: GatewayServer, worker: WorkerProcess, tenant: Tenant) -> None:
    data = "\n".join(json.dumps(r) for r in SFT).encode()
    training = tenant.client.files.create(file=("train.jsonl", data), purpose="fine-tune")
    job = tenant.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=training.id,
        suffix="follow",
        method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 2, "batch_size": 4}}},
    )
    # The command, configured through TUNEGATE_BASE_URL / TUNEGATE_API_KEY, follows it live to the end.
    out = _cli(
        "jobs",
        "follow",
        job.id,
        "--poll",
        "0.3",
        env={"TUNEGATE_BASE_URL": f"{stack.url}/v1", "TUNEGATE_API_KEY": tenant.key},
    )
    assert out.returncode == 0, out.stdout + out.stderr
    done = tenant.client.fine_tuning.jobs.retrieve(job.id)
    assert done.status == "succeeded" and done.fine_tuned_model
    assert f"job {job.id}: succeeded" in out.stdout
    assert done.fine_tuned_model in out.stdout.replace("\n", "")
    assert "step 4/4" in out.stdout  # 8 rows, batch 4, 2 epochs

    # Following a finished job returns at once with every step's metrics.
    console = Console(file=open(os.devnull, "w"), width=120)  # noqa: SIM115 - closed with the console below
    try:
        result = follow_job(tenant.client, job.id, console=console, poll_s=0.1)
    finally:
        console.file.close()
    assert result.job.status == "succeeded"
    steps, losses = result.series("train_loss")
    assert steps == [1, 2, 3, 4] and all(loss > 0 for loss in losses)
    assert any("successfully completed" in m for m in result.messages)


@pytest.mark.slow
@pytest.mark.timeout(1000)
def test_quickstart_end_to_end(tmp_path: Path) -> None:
    """The README's first command: its own stack (embedded PostgreSQL and Redis), an RL job, answers from
    the fine-tuned model, the reward PNG, and nothing left running afterwards."""
    data_dir = tmp_path / "qs"
    port, engine_port = free_port(), free_port()
    out = _cli(
        "quickstart",
        "--data-dir",
        str(data_dir),
        "--base-url",
        f"http://127.0.0.1:{port}",
        "--engine-port",
        str(engine_port),
        timeout=900,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    text = out.stdout.replace("\n", "")
    assert "fine-tuned model: ft:tiny-chat:" in text
    base, tuned = (
        int(x) for x in re.findall(r"held-out exact answers: base (\d+)% -> fine-tuned (\d+)%", text)[0]
    )
    assert tuned >= base + 25, text[-3000:]
    assert (data_dir / "quickstart" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert (data_dir / "admin_key").exists() and "the stack was stopped" in text
    # It names the engine that served, and the other one: vLLM where it can run here (scripts/install puts
    # it in .venv-vllm), else the embedded engine.
    try:
        find_vllm()
        engine = r"vLLM \S+ \((CPU|CUDA) build\); --engine embedded serves it"
    except VllmUnavailable:
        engine = r"the embedded engine; (vLLM is not used: |--engine vllm serves it)"
    assert re.search(rf"engine: +tiny-chat is served by {engine}", text), text[:3000]
    # It ends with the job's page in the dashboard.
    assert re.search(rf"dashboard: +http://127\.0\.0\.1:{port}/dashboard/jobs/ftjob-[\w-]+$", text.rstrip())
    assert not stack_ready(f"http://127.0.0.1:{port}")
    assert [cmd for cmd in command_lines().values() if str(data_dir) in cmd] == []

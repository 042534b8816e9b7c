"""The `tunegate` client commands: `jobs follow` on a real job, the quickstart's pieces, and (slow) a
whole quickstart that starts and stops its own stack."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from rich.console import Console

from gateway.settings import Settings
from tests.support.stack import ROOT, GatewayServer, Tenant, WorkerProcess, free_port
from tunegate.client import api_base_url, make_client, root_url
from tunegate.follow import follow_job
from tunegate.plot import resample, save_curve, sparkline
from tunegate.quickstart import (
    EXAMPLE_ENV,
    create_tenant,
    environment_method,
    grader_method,
    load_prompts,
    stack_ready,
    upload_environment,
)

SFT = [
    {
        "messages": [
            {"role": "user", "content": f"What is {i} plus {i}?"},
            {"role": "assistant", "content": f"{2 * i}"},
        ]
    }
    for i in range(8)
]


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


def test_quickstart_methods_and_prompts() -> None:
    env = environment_method("file-abc", 7)["reinforcement"]
    assert env["environment"]["file_id"] == "file-abc" and env["hyperparameters"]["max_steps"] == 7
    grader = grader_method(7)["reinforcement"]
    assert grader["grader"]["type"] == "text_similarity" and "environment" not in grader
    prompts = load_prompts(EXAMPLE_ENV / "tasks.jsonl", 3)
    assert len(prompts) == 3 and all(p.startswith("What is") for p in prompts)


def test_follow_needs_an_api_key() -> None:
    out = _cli("jobs", "follow", "ftjob-x", "--base-url", "http://127.0.0.1:1/v1")
    assert out.returncode == 2 and "API key" in out.stderr


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


@pytest.fixture(scope="module")
def worker(stack: GatewayServer, tmp_path_factory: pytest.TempPathFactory) -> Iterator[WorkerProcess]:
    w = WorkerProcess(stack.settings, tmp_path_factory.mktemp("cli-worker") / "worker.log")
    yield w
    w.stop()


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
        "--steps",
        "8",
        timeout=280,
    )
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-4000:]
    text = out.stdout.replace("\n", "")
    assert "fine-tuned model: ft:tiny-chat:" in text
    assert "(rewards from the environment)" in text  # the example environment, not the fallback grader
    assert (data_dir / "quickstart" / "reward.png").read_bytes()[:4] == b"\x89PNG"
    assert (data_dir / "admin_key").exists() and "the stack was stopped" in text
    assert not stack_ready(f"http://127.0.0.1:{port}")
    leftovers = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if str(data_dir) in cmd:
            leftovers.append(cmd)
    assert leftovers == []

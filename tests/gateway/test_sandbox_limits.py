"""The operator's sandbox maxima hold for what the gateway runs, blobs are private to the service's uid, and
the trainer's environment holds no secrets.

The packages are canaries: they return 1.0 only if the forbidden act succeeded.
"""

from __future__ import annotations

import os
import stat
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest

from envsdk.archive import pack
from gateway.work.process import trainer_env
from tests.support.fixtures import gateway_fixture
from tests.support.stack import GatewayServer, Tenant, admin_of

HIGH = {"timeout_s": 3600, "startup_timeout_s": 600, "memory_mb": 65536, "disk_mb": 65536, "fsize_mb": 65536}
"""What the hostile packages declare: the most a manifest allows."""
MESSAGES = [{"role": "user", "content": "Act."}]
CANARY = """import os, time
from envsdk import SingleTurnEnv

time.sleep({slow_import})


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        if task["act"] == "sleep":
            time.sleep(60)
        if task["act"] == "write":
            for i in range(64):
                with open(f"/tmp/part{{i}}", "wb") as out:
                    out.write(b"x" * 2**20)
        return 1.0
"""


gateway = gateway_fixture(
    "sandbox-limits",
    engine=False,
    sandbox_max_timeout_s=2,
    sandbox_max_startup_timeout_s=3,
    sandbox_max_disk_mb=16,
)


def _package(tmp: Path, name: str, *, slow_import: float = 0) -> bytes:
    root = tmp / name
    root.mkdir()
    limits = "".join(f"{k} = {v}\n" for k, v in HIGH.items())
    (root / "environment.toml").write_text(
        f'name = "{name}"\nversion = "0.1.0"\nentrypoint = "canary:Env"\n\n[limits]\n{limits}'
    )
    (root / "canary.py").write_text(CANARY.format(slow_import=slow_import))
    archive, _ = pack(root, tmp / f"{name}.tar.gz")
    return archive.read_bytes()


def test_the_upload_check_waits_only_the_operators_start_up_cap(
    gateway: GatewayServer, tmp_path: Path
) -> None:
    tenant = admin_of(gateway).tenant("slow-start")
    started = time.monotonic()
    with pytest.raises(openai.BadRequestError) as err:
        tenant.client.files.create(
            file=("slow.tar.gz", _package(tmp_path, "slow", slow_import=60)), purpose="environment"
        )
    assert time.monotonic() - started < 45  # the package asked for 600 s, and sleeps 60 s
    body = err.value.body
    assert isinstance(body, dict) and body["code"] == "invalid_environment" and body["param"] == "file"
    assert "did not start within 3 s" in body["message"]


def test_environment_runs_are_held_to_the_operators_maxima(gateway: GatewayServer, tmp_path: Path) -> None:
    tenant = admin_of(gateway).tenant("hostile-run")
    file_id = tenant.client.files.create(
        file=("canary.tar.gz", _package(tmp_path, "canary")), purpose="environment"
    ).id

    def run(act: str) -> dict[str, object]:
        answer = httpx.post(
            f"{gateway.url}/v1/fine_tuning/alpha/environments/run",
            json={"file_id": file_id, "task": {"act": act, "messages": MESSAGES}, "completion": "x"},
            headers={"Authorization": f"Bearer {tenant.key}"},
            timeout=120,
        )
        assert answer.status_code == 200, answer.text
        result: dict[str, object] = answer.json()
        return result

    assert run("nothing")["reward"] == 1.0  # the canary itself works
    slept = run("sleep")
    assert slept["reward"] != 1.0
    assert "timeout" in str(slept["error"]) and "within 2 s" in str(slept["error"])
    wrote = run("write")  # 64 MiB into a 16 MiB scratch
    assert wrote["reward"] != 1.0 and "No space left on device" in str(wrote["error"])


def _modes(path: Path, root: Path) -> list[tuple[Path, int]]:
    """The mode of `path` and of each folder above it up to `root`."""
    chain = [p for p in (path, *path.parents) if p == root or root in p.parents]
    return [(p, stat.S_IMODE(p.stat().st_mode)) for p in chain]


def test_blobs_are_private_to_the_service_uid(stack: GatewayServer, tenant: Tenant) -> None:
    uploaded = tenant.client.files.create(file=("secret.txt", b"tenant secret"), purpose="user_data")
    root = stack.settings.blob_dir
    [blob] = [p for p in root.rglob(uploaded.id) if p.is_file()]
    for path, mode in _modes(blob, root):
        assert mode == (0o600 if path == blob else 0o700), (path, oct(mode))
    if os.geteuid() != 0:
        pytest.skip("reading as another uid needs root")
    # The canary: a process of another uid (as a sandbox's would be) tries to read it.
    canary = 'cat "$1" > /dev/null && echo 1.0 || echo 0.0'
    command = ["sh", "-c", canary, "sh", str(blob)]
    read = subprocess.run(command, user=65534, group=65534, capture_output=True, text=True, cwd="/")
    assert read.stdout.strip() == "0.0", read.stderr


def test_the_trainer_gets_no_secrets(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name, value in {
        "TUNEGATE_DATABASE_URL": "postgresql://admin:hunter2@db/tunegate",
        "TUNEGATE_REDIS_URL": "redis://:hunter2@redis:6379/0",
        "TUNEGATE_ADMIN_KEY": "hunter2",
        "TUNEGATE_STRIPE_API_KEY": "sk_live_hunter2",
        "AWS_SECRET_ACCESS_KEY": "hunter2",
        "CUDA_VISIBLE_DEVICES": "0",
        "HF_HOME": "/models/hf",
    }.items():
        monkeypatch.setenv(name, value)
    env = trainer_env(tmp_path)
    assert not [name for name, value in env.items() if "hunter2" in value or name.startswith("TUNEGATE_")]
    assert env["CUDA_VISIBLE_DEVICES"] == "0" and env["HF_HOME"] == "/models/hf"
    assert env["HOME"] == str(tmp_path) and env["PATH"]

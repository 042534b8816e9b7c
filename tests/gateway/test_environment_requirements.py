"""Environment packages with requirements, through the `openai` SDK against a running gateway: sympy is
built into a venv at the first upload, reused by another organisation's package with the same set and by
the job's trainer; an unbuildable set fails its upload with pip's reason and leaves nothing behind.
"""

from __future__ import annotations

import io
import json
import tarfile
import textwrap
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from envsdk.archive import pack
from envsdk.venvs import BUILD_PREFIX, READY
from tests.support.fixtures import worker_fixture
from tests.support.jobs import metrics, upload_rows, wait_for
from tests.support.stack import GatewayServer, Tenant, WorkerProcess

pytestmark = pytest.mark.slow

SYMPY = "sympy==1.14.0"
CODE = """
import sympy
from envsdk import SingleTurnEnv, completion_text


class SymbolicEnv(SingleTurnEnv):
    def reward(self, task, completion):
        try:
            given = sympy.sympify(completion_text(completion).strip())
        except (sympy.SympifyError, SyntaxError, TypeError, ValueError):
            return 0.0
        return 1.0 if sympy.simplify(given - sympy.sympify(task["answer"])) == 0 else 0.0
"""

worker = worker_fixture(of="stack")


def upload(t: Tenant, root: Path, requirements: list[str]) -> str:
    root.mkdir(parents=True)
    listed = ", ".join(json.dumps(r) for r in requirements)
    (root / "environment.toml").write_text(
        f'name = "{root.name}"\nversion = "0.1.0"\nentrypoint = "symbolic:SymbolicEnv"\n'
        f"requirements = [{listed}]\n"
    )
    (root / "symbolic.py").write_text(textwrap.dedent(CODE))
    archive, _ = pack(root, root.parent / f"{root.name}.tar.gz")
    return t.client.files.create(file=(archive.name, archive.read_bytes()), purpose="environment").id


def tar_gz(files: dict[str, str]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as tar:
        for name, text in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(text.encode())
            tar.addfile(info, io.BytesIO(text.encode()))
    return buffer.getvalue()


def venvs_of(stack: GatewayServer) -> list[Path]:
    root = stack.settings.venv_builder().root
    return sorted(p for p in root.iterdir() if p.name != ".locks") if root.exists() else []


def score(stack: GatewayServer, t: Tenant, file_id: str, answer: str, completion: str) -> Any:
    task = {"messages": [{"role": "user", "content": "Simplify."}], "answer": answer}
    response = httpx.post(
        f"{stack.url}/v1/fine_tuning/alpha/environments/run",
        json={"file_id": file_id, "task": task, "completion": completion},
        headers={"Authorization": f"Bearer {t.key}"},
        timeout=120,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_requirements_built_once_and_shared_across_organisations(
    stack: GatewayServer, tenant: Tenant, other_tenant: Tenant, tmp_path: Path
) -> None:
    first = upload(tenant, tmp_path / "symbolic", [SYMPY])
    [venv] = [p for p in venvs_of(stack) if (p / READY).read_text().count(SYMPY)]
    built = (venv / READY).stat()
    # the reward is sympy's: equal expressions written differently score 1
    assert score(stack, tenant, first, "x**2 + 2*x + 1", "(x + 1)**2")["reward"] == 1.0
    assert score(stack, tenant, first, "sin(x)**2 + cos(x)**2", "1")["reward"] == 1.0
    assert score(stack, tenant, first, "x + 1", "x - 1")["reward"] == 0.0
    # another organisation, another package, the same set (spelled differently): the same venv, not rebuilt
    second = upload(other_tenant, tmp_path / "algebra", ["SymPy==1.14.0"])
    again = (venv / READY).stat()
    assert (again.st_ino, again.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)
    assert [p for p in venvs_of(stack) if (p / READY).read_text().count(SYMPY)] == [venv]
    assert score(stack, other_tenant, second, "2*x", "x + x")["reward"] == 1.0
    with pytest.raises(openai.NotFoundError):  # the package is still the other organisation's alone
        tenant.client.files.retrieve(second)


def test_unbuildable_requirements_fail_the_upload_and_leave_nothing(
    stack: GatewayServer, tenant: Tenant, tmp_path: Path
) -> None:
    before_venvs = venvs_of(stack)
    blobs = stack.settings.blob_dir
    before_blobs = sorted(blobs.rglob("*")) if blobs.exists() else []
    with pytest.raises(openai.BadRequestError) as refused:
        upload(tenant, tmp_path / "broken", ["nonexistent-pkg==1.0"])
    error = refused.value.body
    assert isinstance(error, dict)
    assert error["code"] == "invalid_environment" and error["param"] == "file"
    assert error["message"].endswith(
        "could not build the requirements: No matching distribution found for nonexistent-pkg==1.0"
    )
    assert "\n" not in error["message"]
    assert list(tenant.client.files.list(purpose="environment")) == []  # no row
    assert (sorted(blobs.rglob("*")) if blobs.exists() else []) == before_blobs  # no blob
    assert venvs_of(stack) == before_venvs  # no venv, no half-made build
    assert not [p for p in venvs_of(stack) if p.name.startswith(BUILD_PREFIX)]
    # pack refuses an unpinned requirement; an archive made otherwise is refused at upload, naming it
    manifest = (
        'name = "loose"\nversion = "1"\nentrypoint = "symbolic:SymbolicEnv"\nrequirements = ["sympy>=1.14"]\n'
    )
    with pytest.raises(openai.BadRequestError, match="'sympy>=1.14' must pin one version with '=='"):
        tenant.client.files.create(
            file=("loose.tar.gz", tar_gz({"environment.toml": manifest})), purpose="environment"
        )
    assert list(tenant.client.files.list(purpose="environment")) == []


def test_job_with_requirements_succeeds_on_the_cached_venv(
    stack: GatewayServer, worker: WorkerProcess, tenant: Tenant, tmp_path: Path
) -> None:
    env_file = upload(tenant, tmp_path / "symbolic_job", [SYMPY])
    [venv] = [p for p in venvs_of(stack) if (p / READY).read_text().count(SYMPY)]
    built = (venv / READY).stat()
    question = "What is {} + {}? Answer with the number."
    rows = [
        {"messages": [{"role": "user", "content": question.format(a, b)}], "answer": a + b}
        for a, b in ((2, 3), (4, 5), (1, 6), (3, 3))
    ]
    job = tenant.client.fine_tuning.jobs.create(
        model="tiny-chat",
        training_file=upload_rows(tenant, rows),
        method={
            "type": "reinforcement",
            "reinforcement": {
                "environment": {"file_id": env_file, "config": {}},
                "hyperparameters": {
                    "batch_size": 2,
                    "num_generations": 2,
                    "max_completion_length": 16,
                    "max_steps": 2,
                    "checkpoint_every": 10,
                },
            },
        },  # type: ignore[typeddict-unknown-key]
    )
    done = wait_for(tenant, job.id)
    assert done.status == "succeeded", done.error
    steps = metrics(tenant, job.id)
    assert [d["step"] for d in steps] == [1, 2]
    for data in steps:  # rewards from the environment's sympy code, no episode failed to import it
        assert "rewards/environment" in data and data["episode_failures"] == 0
        assert 0.0 <= data["reward_mean"] <= 1.0
    again = (venv / READY).stat()  # the trainer ran on the venv the upload built
    assert (again.st_ino, again.st_mtime_ns) == (built.st_ino, built.st_mtime_ns)

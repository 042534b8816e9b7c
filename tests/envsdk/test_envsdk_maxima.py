"""Canaries for the operator's maxima and the sandbox's confinement, on every backend that works here.

Each package declares the highest limits a manifest allows and then tries the forbidden act; it returns
1.0 only if the act succeeded. The sandbox runs under small operator maxima, so every canary must fail,
with an error that says why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from envsdk import Maxima, Sandbox, SandboxError
from envsdk.sandbox import owned_tempdir, probe_backend, remove_stale_dirs

HIGH = (
    "timeout_s = 3600\nstartup_timeout_s = 600\nmemory_mb = 65536\ncpu_s = 86400\n"
    "nproc = 4096\nnofile = 65536\nfsize_mb = 65536\ndisk_mb = 65536\n"
)
"""The most a package may declare."""
SMALL = Maxima(
    timeout_s=30, startup_timeout_s=30, memory_mb=256, cpu_s=60, nproc=16, nofile=32, fsize_mb=8, disk_mb=16
)
"""The operator's maxima of these tests."""


@pytest.fixture(params=["bwrap", "unshare"])
def backend(request: pytest.FixtureRequest) -> str:
    if not probe_backend(request.param):
        pytest.skip(f"the {request.param} backend does not work here")
    return str(request.param)


def _canary(body: str, *, header: str = "") -> str:
    """A single-turn environment whose reward runs ``body``; it returns 1.0 when the forbidden act worked."""
    indented = "\n".join("        " + line for line in body.strip().splitlines())
    return (
        f"import os, time\nfrom envsdk import SingleTurnEnv\n{header}\n\n"
        f"class Env(SingleTurnEnv):\n    def reward(self, task, completion):\n{indented}\n"
    )


def _score(sandbox: Sandbox, task: dict[str, object] | None = None) -> dict[str, object]:
    [result] = sandbox.reward_batch([{"task": task or {}, "completion": ""}])
    return result


def test_declared_limits_are_capped_by_the_maxima(make_package, backend):
    package = make_package(_canary("return 1.0"), limits=HIGH)
    sandbox = Sandbox(package, maxima=SMALL, backend=backend)
    assert sandbox.limits.model_dump() == {**SMALL.as_dict(), "max_turns": 8}
    # A sandbox made without maxima is held to envsdk's conservative defaults.
    assert Sandbox(package, backend=backend).limits.memory_mb == Maxima().memory_mb


def test_memory_beyond_the_maxima(make_package, backend):
    package = make_package(_canary("block = bytearray(2**30)\nreturn 1.0"), limits=HIGH)
    with Sandbox(package, maxima=SMALL, backend=backend) as sandbox:
        result = _score(sandbox)
    assert result["reward"] != 1.0
    assert result["error"] == "MemoryError"


FORKS = """
for _ in range(64):
    if os.fork() == 0:
        time.sleep(5)
        os._exit(0)
return 1.0
"""
"""Forks past the process cap."""

DISK = """
written = 0
chunk = b"x" * 2**20
for i in range(64):
    folder = ("/scratch", "/tmp", os.environ["HOME"], os.environ["TMPDIR"])[i % 4]
    with open(f"{folder}/part{i}", "wb") as out:
        for _ in range(4):
            out.write(chunk)
            written += len(chunk)
return float(written > 16 * 2**20)
"""
"""Files under the file-size cap, spread over every writable place: the total is what is bounded."""

OPEN_FILES = """
files = [open("/dev/null") for _ in range(100)]
return 1.0
"""
"""Opens past the open-files cap."""


@pytest.mark.parametrize(
    ("body", "refusal"),
    [
        (FORKS, "Resource temporarily unavailable"),
        (DISK, "No space left on device"),
        (OPEN_FILES, "Too many open files"),
    ],
    ids=["processes", "disk", "open_files"],
)
def test_the_maxima_stop_what_the_package_allows_itself(make_package, backend, body, refusal):
    package = make_package(_canary(body), limits=HIGH)
    with Sandbox(package, maxima=SMALL, backend=backend) as sandbox:
        result = _score(sandbox)
    assert result["reward"] != 1.0
    assert refusal in str(result["error"])


def test_wall_time_beyond_the_maxima(make_package, backend):
    package = make_package(_canary("time.sleep(20)\nreturn 1.0"), limits=HIGH)
    maxima = Maxima(**{**SMALL.as_dict(), "timeout_s": 2})
    with Sandbox(package, maxima=maxima, backend=backend) as sandbox:
        with pytest.raises(SandboxError, match="did not answer within 2 s") as info:
            _score(sandbox)
    assert info.value.code == "timeout"


def test_cpu_time_beyond_the_maxima(make_package, backend):
    package = make_package(
        _canary("""
while time.process_time() < 5:
    pass
return 1.0
"""),
        limits=HIGH,
    )
    maxima = Maxima(**{**SMALL.as_dict(), "cpu_s": 1, "timeout_s": 60})
    with Sandbox(package, maxima=maxima, backend=backend) as sandbox:
        with pytest.raises(SandboxError, match="CPU-time limit") as info:
            _score(sandbox)
    assert info.value.code == "cpu_limit"


def test_start_up_beyond_the_maxima(make_package, backend):
    package = make_package(_canary("return 1.0", header="time.sleep(20)"), limits=HIGH)
    maxima = Maxima(**{**SMALL.as_dict(), "startup_timeout_s": 2})
    sandbox = Sandbox(package, maxima=maxima, backend=backend)
    started = time.monotonic()
    with pytest.raises(SandboxError, match="did not start within 2 s") as info:
        sandbox.start()
    assert info.value.code == "timeout"
    assert time.monotonic() - started < 15  # not the package's 600 s
    assert not sandbox.running


def test_host_files_are_out_of_reach(make_package, backend, tmp_path):
    # Readable by every uid on the host: only the sandbox's own file-system view keeps them out.
    data = tmp_path / "data"
    (data / "blobs" / "files" / "org-a").mkdir(parents=True)
    (data / "blobs" / "files" / "org-a" / "file-1").write_text("another tenant's upload")
    (data / "admin_key").write_text("sk-admin")
    for path in (tmp_path, *data.rglob("*"), data):
        path.chmod(0o755 if path.is_dir() else 0o644)
    package = make_package(
        _canary("""
read = []
for path in ("/etc/passwd", "/etc/hostname", task["blob"], task["key"], "/root/.bashrc"):
    try:
        with open(path) as f:
            f.read()
        read.append(path)
    except OSError:
        pass
try:
    os.listdir(task["data"])
    read.append(task["data"])
except OSError:
    pass
return float(bool(read))
"""),
        limits=HIGH,
    )
    task = {
        "blob": str(data / "blobs" / "files" / "org-a" / "file-1"),
        "key": str(data / "admin_key"),
        "data": str(data),
    }
    with Sandbox(package, maxima=SMALL, backend=backend) as sandbox:
        result = _score(sandbox, task)
    assert result == {"reward": 0.0, "error": None}


def test_scratch_of_a_killed_process_is_removed_at_the_next_start(make_package, tmp_path, monkeypatch):
    package = make_package(_canary("return 1.0"))
    code = (
        "import sys, time\nfrom envsdk import Sandbox\n"
        f"box = Sandbox({str(package)!r}, allow_unsandboxed=True)\nbox.start()\n"
        "print(box._host_dir, flush=True)\ntime.sleep(600)\n"
    )
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=env, text=True)
    try:
        assert child.stdout is not None
        left = Path(child.stdout.readline().strip())
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    assert left.parent == tmp_path and left.is_dir()
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    mine = owned_tempdir("scratch")  # a live process's directory stays
    assert remove_stale_dirs(tmp_path) == 1
    assert not left.exists() and mine.is_dir()

"""Hostile packages: each is contained with a clear error and this process stays unharmed."""

from __future__ import annotations

import os
import socket
import time

import pytest

from envsdk import Limits, Sandbox, SandboxError
from envsdk.sandbox_backends import pids_of

FAST = Limits(timeout_s=3, startup_timeout_s=20, memory_mb=512, nproc=24, fsize_mb=8)


def _env(body: str) -> str:
    """A single-turn environment whose reward runs ``body`` (``task`` in scope)."""
    indented = "\n".join("        " + line for line in body.strip().splitlines())
    header = "import os, socket, time\nfrom envsdk import SingleTurnEnv\n\n"
    return f"{header}class Env(SingleTurnEnv):\n    def reward(self, task, completion):\n{indented}\n"


def _stderr_when_it_has(sandbox: Sandbox, *needles: str, within_s: float = 10.0) -> str:
    """The sandbox's stderr once every needle is in it (its reader thread runs behind the RPC answer)."""
    deadline = time.monotonic() + within_s
    tail = sandbox.stderr_tail()
    while not all(needle in tail for needle in needles) and time.monotonic() < deadline:
        time.sleep(0.02)
        tail = sandbox.stderr_tail()
    return tail


def test_no_network(make_package, sandbox_backend):
    listener = socket.create_server(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    package = make_package(
        _env("""
errors = []
for port in task["ports"]:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError as exc:
        errors.append(type(exc).__name__)
        continue
    raise RuntimeError(f"connected to {port}")
try:
    socket.getaddrinfo("pypi.org", 443)
    raise RuntimeError("resolved a name")
except socket.gaierror:
    pass
return float(len(errors))
""")
    )
    with listener, Sandbox(package, limits=FAST) as sandbox:
        [result] = sandbox.reward_batch([{"task": {"ports": [5432, 6379, port]}, "completion": ""}])
        socket.create_connection(
            ("127.0.0.1", port), timeout=1
        ).close()  # reachable from here, not from there
    assert result == {"reward": 3.0, "error": None}


def test_unshare_fallback_has_no_network_and_drops_root(make_package):
    from envsdk.sandbox import probe_backend

    if not probe_backend("unshare"):
        pytest.skip("unshare backend unavailable: needs root and util-linux")
    # The package lies under pytest's folder, private to this uid: unshare binds it into the sandbox's own
    # root, as bubblewrap does, so where the repository is cloned does not matter.
    package = make_package(
        _env("""
try:
    socket.create_connection(("127.0.0.1", 5432), timeout=1).close()
except OSError:
    return float(os.getuid() != 0 and os.getpid() < 10)
return -1.0
""")
    )
    with Sandbox(package, limits=FAST, backend="unshare") as sandbox:
        assert sandbox.reward_batch([{"task": {}, "completion": ""}]) == [{"reward": 1.0, "error": None}]


def test_secrets_files_and_environment_are_invisible(make_package, sandbox_backend, tmp_path, monkeypatch):
    blobs = tmp_path / "blobstore"
    blobs.mkdir()
    (blobs / "other-tenant.jsonl").write_text("secret data")
    os.chmod(tmp_path, 0o755)
    monkeypatch.setenv("TUNEGATE_DATABASE_URL", "postgresql://admin:hunter2@db/tunegate")
    package = make_package(
        _env("""
seen = []
for path in ["/etc/shadow", "/etc/passwd", task["blobs"] + "/other-tenant.jsonl", "/work/main/README.md"]:
    try:
        open(path).read()
        seen.append(path)
    except OSError:
        pass
if any("hunter2" in value for value in os.environ.values()):
    seen.append("environment")
if seen:
    raise RuntimeError(f"visible: {seen}")
return 1.0
""")
    )
    with Sandbox(package, limits=FAST) as sandbox:
        [result] = sandbox.reward_batch([{"task": {"blobs": str(blobs)}, "completion": ""}])
    assert result == {"reward": 1.0, "error": None}


def test_code_is_read_only_scratch_is_writable_and_uid_is_not_root(make_package, sandbox_backend):
    package = make_package(
        _env("""
assert os.getuid() != 0 and os.geteuid() != 0
open(os.environ["HOME"] + "/notes.txt", "w").write("ok")
try:
    open(os.path.join(os.path.dirname(__file__), "env.py"), "a").write("# tampered")
except OSError as exc:
    raise PermissionError("code is read-only") from exc
return 1.0
""")
    )
    with Sandbox(package, limits=FAST) as sandbox:
        [result] = sandbox.reward_batch([{"task": {}, "completion": ""}])
    assert result == {"reward": None, "error": "PermissionError: code is read-only"}
    assert not (package / "env.py").read_text().endswith("# tampered")


def test_fork_bomb(make_package, sandbox_backend):
    package = make_package(
        _env("""
while True:
    try:
        os.fork()
    except OSError:
        pass
""")
    )
    sandbox = Sandbox(package, limits=FAST)
    sandbox.start()
    uid = sandbox.uid
    with pytest.raises(SandboxError) as info:
        sandbox.reward_batch([{"task": {}, "completion": ""}])
    assert info.value.code == "timeout"
    assert not sandbox.running
    if uid is not None:
        assert pids_of(uid) == []
    sandbox.start()  # restartable
    assert sandbox.describe()["kind"] == "single_turn"
    sandbox.close()


def test_huge_allocation(make_package, sandbox_backend):
    package = make_package(
        _env("""
block = bytearray(50 * 2**30)
return float(len(block))
""")
    )
    with Sandbox(package, limits=FAST) as sandbox:
        [result] = sandbox.reward_batch([{"task": {}, "completion": ""}])
        assert sandbox.running  # MemoryError is an error of this item, not of the sandbox
    assert result == {"reward": None, "error": "MemoryError"}


def test_infinite_loop_times_out_and_restarts(make_package, sandbox_backend):
    package = make_package(
        _env("""
if task.get("spin"):
    while True:
        pass
return 1.0
""")
    )
    with Sandbox(package, limits=FAST) as sandbox:
        with pytest.raises(SandboxError, match="did not answer within 3 s") as info:
            sandbox.reward_batch([{"task": {"spin": True}, "completion": ""}])
        assert info.value.code == "timeout"
        with pytest.raises(SandboxError) as info:
            sandbox.describe()
        assert info.value.code == "not_running"
        sandbox.start()
        assert sandbox.reward_batch([{"task": {}, "completion": ""}]) == [{"reward": 1.0, "error": None}]


def test_writing_ten_gigabytes_stops_at_fsize(make_package, sandbox_backend):
    package = make_package(
        _env("""
chunk = b"\\0" * 2**20
with open(os.environ["TMPDIR"] + "/big.bin", "wb") as out:
    for _ in range(10 * 1024):
        out.write(chunk)
return 1.0
""")
    )
    with Sandbox(package, limits=FAST) as sandbox:
        [result] = sandbox.reward_batch([{"task": {}, "completion": ""}])
    assert result["reward"] is None and "File too large" in result["error"]


def test_prints_do_not_reach_the_channel_but_garbage_on_it_is_caught(make_package, sandbox_backend):
    package = make_package(
        _env("""
print("print goes to stderr")
os.write(1, b"raw write to fd 1\\n")
if task.get("flood"):
    for fd in range(3, 64):
        try:
            os.write(fd, b"not json at all\\n")
        except OSError:
            pass
return 1.0
""")
    )
    with Sandbox(package, limits=FAST) as sandbox:
        assert sandbox.reward_batch([{"task": {}, "completion": ""}]) == [{"reward": 1.0, "error": None}]
        tail = _stderr_when_it_has(sandbox, "print goes to stderr", "raw write to fd 1")
        assert "print goes to stderr" in tail and "raw write to fd 1" in tail
        with pytest.raises(SandboxError, match="something else than an RPC answer") as info:
            sandbox.reward_batch([{"task": {"flood": True}, "completion": ""}])
        assert info.value.code == "protocol_error"
        assert not sandbox.running


def test_a_non_finite_reward_fails_its_item_and_the_batch_goes_on(make_package, sandbox_backend):
    package = make_package(_env('return float(task["value"])'))
    with Sandbox(package, limits=FAST) as sandbox:
        results = sandbox.reward_batch(
            [{"task": {"value": v}, "completion": ""} for v in ("1", "nan", "0.25")]
        )
        assert results == [
            {"reward": 1.0, "error": None},
            {"reward": None, "error": "ValueError: reward must be a finite number, got nan"},
            {"reward": 0.25, "error": None},
        ]
        assert sandbox.running
        # an integer beyond 64 bits travels too (through the standard library's encoder)
        assert sandbox.reward_batch([{"task": {"value": 2**70}, "completion": ""}]) == [
            {"reward": float(2**70), "error": None}
        ]


def test_crash_at_call_time_is_reported(make_package, sandbox_backend):
    package = make_package(
        _env("""
os._exit(7)
""")
    )
    with Sandbox(package, limits=FAST) as sandbox:
        with pytest.raises(SandboxError, match="status") as info:
            sandbox.reward_batch([{"task": {}, "completion": ""}])
    assert info.value.code == "crashed"


def test_unsandboxed_needs_explicit_permission(make_package):
    package = make_package(_env("return 1.0"))
    with pytest.raises(SandboxError) as info:
        Sandbox(package, backend="none")
    assert info.value.code == "unsandboxed_refused"
    with Sandbox(package, backend="none", allow_unsandboxed=True, limits=FAST) as sandbox:
        assert sandbox.reward_batch([{"task": {}, "completion": ""}]) == [{"reward": 1.0, "error": None}]


async def test_async_calls(make_package, sandbox_backend):
    package = make_package(_env("return float(len(completion))"))
    sandbox = Sandbox(package, limits=FAST)
    await sandbox.astart()
    try:
        assert await sandbox.areward_batch([{"task": {}, "completion": "abcd"}]) == [
            {"reward": 4.0, "error": None}
        ]
    finally:
        await sandbox.aclose()

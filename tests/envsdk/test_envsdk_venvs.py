"""Packages with requirements: pinned requirements, one venv per set (built once, shared, nothing half-made),
mounted read-only into the sandbox, which still has no network and sees no other package.

sympy comes from the registry pip reaches here, built once for the session; the "shipped wheels" case uses
a tiny pure-Python wheel written by the test itself.
"""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import tarfile
import textwrap
import threading
import zipfile
from collections.abc import Callable
from pathlib import Path

import pytest

from envsdk import cli
from envsdk.errors import PackageError
from envsdk.manifest import parse_manifest
from envsdk.sandbox import Sandbox, probe_backend
from envsdk.venvs import (
    BUILD_PREFIX,
    READY,
    RequirementsError,
    VenvBuilder,
    normalise_requirements,
    venv_key,
    wheel_digests,
)

SYMPY = "sympy==1.14.0"
SYMPY_ENV = """
import sympy
from envsdk import SingleTurnEnv, completion_text


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        try:
            given = sympy.sympify(completion_text(completion))
        except (sympy.SympifyError, SyntaxError, TypeError):
            return 0.0
        return 1.0 if sympy.simplify(given - sympy.sympify(task["answer"])) == 0 else 0.0
"""
PROBE_ENV = """
import os
import socket

import tinyreward
from envsdk import SingleTurnEnv, completion_text


def attempt(action):
    try:
        action()
    except Exception as exc:
        return type(exc).__name__
    return "done"


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        what = completion_text(completion)
        if what == "score":
            return tinyreward.score(task["answer"])
        if what == "write-venv":
            target = os.path.join(os.path.dirname(tinyreward.__file__), "planted.py")
            raise RuntimeError(attempt(lambda: open(target, "w").write("x = 1")))
        if what == "network":
            raise RuntimeError(attempt(lambda: socket.create_connection(("1.1.1.1", 53), timeout=2)))
        raise RuntimeError(attempt(lambda: open(what).read()))  # a host path
"""


def write_package(root: Path, code: str, requirements: list[str], wheels: tuple[Path, ...] = ()) -> Path:
    root.mkdir(parents=True)
    listed = ", ".join(f'"{r}"' for r in requirements)
    (root / "environment.toml").write_text(
        f'name = "{root.name}"\nversion = "0.1.0"\nentrypoint = "env:Env"\nrequirements = [{listed}]\n'
        "\n[limits]\ntimeout_s = 20\nstartup_timeout_s = 30\n"
    )
    (root / "env.py").write_text(textwrap.dedent(code))
    if wheels:
        (root / "wheels").mkdir()
        for wheel in wheels:
            (root / "wheels" / wheel.name).write_bytes(wheel.read_bytes())
    return root


def make_wheel(directory: Path, name: str = "tinyreward", version: str = "1.0", source: str = "") -> Path:
    """A pure-Python wheel of one module, written by hand (what ``pip wheel`` makes of a tiny project)."""
    source = source or "def score(answer):\n    return float(len(str(answer)))\n"
    dist = f"{name}-{version}.dist-info"
    files = {
        f"{name}.py": source,
        f"{dist}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
        f"{dist}/WHEEL": "Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    record.append(f"{dist}/RECORD,,")
    files[f"{dist}/RECORD"] = "\n".join(record) + "\n"
    directory.mkdir(parents=True, exist_ok=True)
    wheel = directory / f"{name}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        for path, text in files.items():
            archive.writestr(path, text)
    return wheel


def leftovers(root: Path) -> list[str]:
    """What a cache holds besides its locks."""
    return sorted(p.name for p in root.iterdir() if p.name != ".locks") if root.exists() else []


@pytest.fixture(scope="session")
def sympy_cache(tmp_path_factory: pytest.TempPathFactory) -> tuple[VenvBuilder, Path]:
    """One venv cache for the session, with sympy built into it once (from pip's index)."""
    builder = VenvBuilder(tmp_path_factory.mktemp("venvs"))
    venv = builder.ensure([SYMPY])
    assert venv is not None
    return builder, venv


@pytest.fixture
def wheel_package(tmp_path: Path) -> Callable[[str], Path]:
    wheel = make_wheel(tmp_path / "dist")
    return lambda name: write_package(tmp_path / name, PROBE_ENV, ["tinyreward==1.0"], (wheel,))


def test_requirements_must_be_pinned_with_double_equals() -> None:
    for bad in ("sympy", "sympy>=1.14", "sympy==1.*", "sympy~=1.14", "sympy @ https://example.com/s.whl"):
        with pytest.raises(RequirementsError, match="must pin one version with '=='") as caught:
            normalise_requirements([bad])
        assert repr(bad) in caught.value.message
    with pytest.raises(PackageError, match=r"requirements.*'numpy>=2' must pin"):
        parse_manifest('name = "p"\nversion = "1"\nentrypoint = "m:C"\nrequirements = ["numpy>=2"]\n')
    with pytest.raises(RequirementsError, match="listed twice"):
        normalise_requirements(["SymPy==1.14.0", "sympy==1.13"])
    # the key is of the normalised, sorted set (names canonical, extras sorted)
    one = normalise_requirements(["SymPy==1.14.0", "Foo_Bar[b,a]==2"])
    assert one == ["foo-bar[a,b]==2", "sympy==1.14.0"]
    assert venv_key(one) == venv_key(normalise_requirements(["foo-bar[a,b]==2", "sympy==1.14.0"]))
    assert venv_key(one) != venv_key(one, {"foo_bar-2-py3-none-any.whl": "ab" * 32})


def test_sympy_venv_reward_in_the_sandbox(
    sympy_cache: tuple[VenvBuilder, Path], tmp_path: Path, sandbox_backend: str
) -> None:
    builder, venv = sympy_cache
    ready = (venv / READY).stat()
    package = write_package(tmp_path / "symbolic", SYMPY_ENV, [SYMPY])
    with Sandbox(package, venvs=builder, backend=sandbox_backend) as sandbox:
        assert sandbox.venv == venv  # the session's venv, not a second build
        items = [
            {"task": {"answer": "x**2 + 2*x + 1"}, "completion": "(x + 1)**2"},
            {"task": {"answer": "sin(x)**2 + cos(x)**2"}, "completion": "1"},
            {"task": {"answer": "2"}, "completion": "3"},
        ]
        assert [r["reward"] for r in sandbox.reward_batch(items)] == [1.0, 1.0, 0.0]
    # another package, the same set in another order and spelling: the same venv, untouched
    again = write_package(tmp_path / "other", SYMPY_ENV, ["SymPy==1.14.0"])
    assert Sandbox(again, venvs=builder).ensure_venv() == venv
    after = (venv / READY).stat()
    assert (after.st_ino, after.st_mtime_ns) == (ready.st_ino, ready.st_mtime_ns)
    assert leftovers(builder.root) == [venv.name]


def test_shipped_wheels_concurrent_builds_happen_once(
    tmp_path: Path, wheel_package: Callable[[str], Path], caplog: pytest.LogCaptureFixture
) -> None:
    builder = VenvBuilder(tmp_path / "cache")
    first, second = wheel_package("first"), wheel_package("second")
    results: list[Path | None] = []
    caplog.set_level(logging.INFO, logger="envsdk.venvs")
    threads = [
        threading.Thread(target=lambda p=p: results.append(Sandbox(p, venvs=builder).ensure_venv()))
        for p in (first, second, first)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(results) == 3 and len(set(results)) == 1 and results[0] is not None
    builds = [r for r in caplog.records if r.getMessage().startswith("built venv")]
    assert len(builds) == 1, [r.getMessage() for r in builds]
    assert leftovers(builder.root) == [results[0].name]
    # a different wheel under the same name and version is another set: never given the first one's venv
    other = write_package(
        tmp_path / "impostor",
        PROBE_ENV,
        ["tinyreward==1.0"],
        (make_wheel(tmp_path / "dist2", source="def score(answer):\n    return -1.0\n"),),
    )
    assert Sandbox(other, venvs=builder).ensure_venv() != results[0]


@pytest.mark.parametrize("backend", ["bwrap", "unshare"])
def test_venv_is_read_only_and_the_sandbox_stays_closed(
    tmp_path: Path, wheel_package: Callable[[str], Path], backend: str
) -> None:
    if not probe_backend(backend):
        pytest.skip(f"the {backend} backend does not work here")
    sandbox_backend = backend
    builder = VenvBuilder(tmp_path / "cache")
    package = wheel_package("probe")
    neighbour = wheel_package("neighbour")  # another package's files, beside this one on the host
    (neighbour / "secret.txt").write_text("other tenant")
    with Sandbox(package, venvs=builder, backend=sandbox_backend) as sandbox:
        assert sandbox.venv is not None

        def outcome(what: str) -> str | None:
            [result] = sandbox.reward_batch([{"task": {"answer": "abc"}, "completion": what}])
            return result["reward"] if result["error"] is None else result["error"]

        assert outcome("score") == 3.0  # the shipped wheel's code, imported from /venv
        assert "OSError" in str(outcome("write-venv"))  # read-only file system (or not permitted)
        assert not (sandbox.venv / "lib").joinpath("planted.py").exists()
        assert "OSError" in str(outcome("network"))  # no network in the sandbox
        for host_path in (neighbour / "secret.txt", sandbox.venv / READY, builder.root / ".locks"):
            assert "FileNotFoundError" in str(outcome(str(host_path))), host_path
    assert not any(p.name == "planted.py" for p in sandbox.venv.rglob("*.py"))


def test_unsandboxed_development_runs_see_the_venv_too(
    tmp_path: Path, wheel_package: Callable[[str], Path]
) -> None:
    builder = VenvBuilder(tmp_path / "cache")
    with Sandbox(wheel_package("dev"), venvs=builder, backend="none", allow_unsandboxed=True) as sandbox:
        [result] = sandbox.reward_batch([{"task": {"answer": "ab"}, "completion": "score"}])
        assert result == {"reward": 2.0, "error": None}


def test_unbuildable_requirements_leave_nothing(tmp_path: Path) -> None:
    builder = VenvBuilder(tmp_path / "cache")
    with pytest.raises(RequirementsError) as caught:
        builder.ensure(["nonexistent-pkg==1.0"])
    assert caught.value.code == "requirements_build_failed"
    assert caught.value.message == (
        "could not build the requirements: No matching distribution found for nonexistent-pkg==1.0"
    )
    assert leftovers(builder.root) == []


def test_time_and_size_caps_leave_nothing(tmp_path: Path, wheel_package: Callable[[str], Path]) -> None:
    package = wheel_package("capped")
    small = VenvBuilder(tmp_path / "small", max_bytes=1024)
    with pytest.raises(RequirementsError, match="over the cap of 1024 bytes"):
        Sandbox(package, venvs=small).ensure_venv()
    assert leftovers(small.root) == []
    hurried = VenvBuilder(tmp_path / "hurried", timeout_s=0.05)
    with pytest.raises(RequirementsError, match="took longer than 0.05 s"):
        Sandbox(package, venvs=hurried).ensure_venv()
    assert leftovers(hurried.root) == []


def test_a_killed_build_is_cleaned_by_the_next(tmp_path: Path, wheel_package: Callable[[str], Path]) -> None:
    builder = VenvBuilder(tmp_path / "cache")
    sandbox = Sandbox(wheel_package("again"), venvs=builder)
    key = venv_key(["tinyreward==1.0"], wheel_digests(sandbox.package_dir / "wheels"))
    builder.root.mkdir()
    half = builder.root / f"{BUILD_PREFIX}{key}-dead"  # what a build killed mid-way leaves
    (half / "lib").mkdir(parents=True)
    (builder.root / key).mkdir()  # and a directory without the finished marker
    venv = sandbox.ensure_venv()
    assert venv == builder.root / key and (venv / READY).is_file()
    assert leftovers(builder.root) == [key]
    assert os.access(venv, os.R_OK | os.X_OK)


def test_cli_pack_records_and_test_runs_in_a_user_cache_venv(
    tmp_path: Path,
    wheel_package: Callable[[str], Path],
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    sandbox_backend: str,
) -> None:
    package = wheel_package("clipkg")
    archive = tmp_path / "clipkg.tar.gz"
    assert cli.main(["pack", str(package), "-o", str(archive)]) == 0
    assert "requirements: tinyreward==1.0" in capsys.readouterr().err
    with tarfile.open(archive) as tar:
        member = tar.extractfile("environment.toml")
        assert member is not None
        manifest = parse_manifest(member.read().decode())
        assert manifest.requirements == ["tinyreward==1.0"]
        assert "wheels/tinyreward-1.0-py3-none-any.whl" in tar.getnames()
    monkeypatch.delenv("ENVSDK_VENV_DIR", raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tasks = tmp_path / "tasks.jsonl"
    tasks.write_text(json.dumps({"messages": [{"role": "user", "content": "?"}], "answer": "four"}) + "\n")
    assert cli.main(["test", str(package), "--tasks", str(tasks), "--completions", "score"]) == 0
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert lines[0]["reward"] == 4.0 and lines[-1]["mean_reward"] == 4.0
    [venv] = leftovers(tmp_path / "cache" / "envsdk" / "venvs")
    assert (tmp_path / "cache" / "envsdk" / "venvs" / venv / READY).is_file()
    # an unpinned requirement: pack refuses it, naming it
    (package / "environment.toml").write_text(
        (package / "environment.toml").read_text().replace("tinyreward==1.0", "tinyreward>=1")
    )
    assert cli.main(["pack", str(package), "-o", str(archive)]) == 1
    assert "'tinyreward>=1' must pin one version with '=='" in capsys.readouterr().err


def test_a_venv_built_under_a_strict_umask_is_readable_in_the_sandbox(
    tmp_path: Path, wheel_package: Callable[[str], Path], sandbox_backend: str
) -> None:
    builder = VenvBuilder(tmp_path / "cache")
    previous = os.umask(0o077)  # the builder's process keeps its files to itself...
    try:
        venv = Sandbox(wheel_package("strict"), venvs=builder).ensure_venv()
    finally:
        os.umask(previous)
    assert venv is not None
    # ...and the sandbox's own uid (as root, a fresh one) still imports the venv's code
    with Sandbox(wheel_package("strict2"), venvs=builder, backend=sandbox_backend) as sandbox:
        assert sandbox.venv == venv
        [result] = sandbox.reward_batch([{"task": {"answer": "ab"}, "completion": "score"}])
        assert result == {"reward": 2.0, "error": None}

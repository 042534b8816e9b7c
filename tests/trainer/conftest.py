"""Helpers for the trainer tests: write a spec and data, run ``python -m trainer run`` as a real process."""

from __future__ import annotations

import json
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[2]

SFT_ROWS = [
    {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello! How can I help you?"},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "What is 2 plus 3?"},
            {"role": "assistant", "content": "2 plus 3 is 5."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Capital of France?"},
            {"role": "assistant", "content": "Paris."},
        ]
    },
    {
        "messages": [
            {"role": "user", "content": "Count from 1 to 4."},
            {"role": "assistant", "content": "1, 2, 3, 4."},
        ]
    },
]

DPO_ROWS = [
    {
        "input": {"messages": [{"role": "user", "content": q}]},
        "preferred_output": [{"role": "assistant", "content": good}],
        "non_preferred_output": [{"role": "assistant", "content": bad}],
    }
    for q, good, bad in [
        ("Hi", "Hello! How can I help you?", "Go away."),
        ("Is 5 bigger than 3?", "Yes, 5 is bigger than 3.", "No."),
        ("Capital of France?", "Paris.", "Rome."),
        ("Say yes", "Yes", "No"),
    ]
]


@dataclass
class Job:
    """A finished trainer process: exit code, parsed stdout events and stderr."""

    rc: int
    events: list[dict[str, Any]]
    stderr: str

    def of(self, kind: str) -> list[dict[str, Any]]:
        """Events of one type, in order."""
        return [e for e in self.events if e["type"] == kind]


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def make_spec(tmp: Path, base_model: Path, method: str, rows: list[dict[str, Any]], **extra: Any) -> Path:
    """Write the training file and SPEC.json into ``tmp``; ``extra`` overrides spec keys."""
    spec: dict[str, Any] = {
        "job_id": f"ftjob-test-{method}",
        "method": method,
        "base_model": str(base_model),
        "training_file": str(write_jsonl(tmp / "train.jsonl", rows)),
        "validation_file": None,
        "output_dir": str(tmp / "out"),
        "resume_from_checkpoint": None,
        "seed": 42,
        "hyperparameters": {},
        "grader": None,
        "environment": None,
        "inference_base_url": None,
        "inference_api_key": None,
        "use_vllm": False,
    }
    spec.update(extra)
    path = tmp / "spec.json"
    path.write_text(json.dumps(spec))
    return path


def parse_events(stdout: str) -> list[dict[str, Any]]:
    """Every stdout line must be one JSON event."""
    return [json.loads(line) for line in stdout.splitlines()]


def run_trainer(spec_path: Path, timeout: float = 240) -> Job:
    proc = subprocess.run(
        [sys.executable, "-m", "trainer", "run", str(spec_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return Job(proc.returncode, parse_events(proc.stdout), proc.stderr)


def start_trainer(spec_path: Path) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "trainer", "run", str(spec_path)],
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def lora_tensors(adapter_dir: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(str(adapter_dir / "adapter_model.safetensors"))


@pytest.fixture
def tiny(tiny_model_dir: Path) -> Path:
    """The session's tiny chat model (built once by the root conftest)."""
    return tiny_model_dir

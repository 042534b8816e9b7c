"""Sandboxed code runs at a lower CPU priority than the process that started it, under every backend, and so
does what it starts: a package that spins every core it may use leaves the gateway and the worker theirs."""

from __future__ import annotations

import os

import pytest

from envsdk import Limits, Sandbox
from envsdk.sandbox_backends import SANDBOX_NICE, probe_backend

FAST = Limits(timeout_s=10, startup_timeout_s=20)

# The reward is the niceness of the environment's process (the 19th field of /proc/self/stat) and, as the
# fractional part, that of a child it starts: both must be lowered.
NICENESS = """
import subprocess, sys
from envsdk import SingleTurnEnv


def niceness(stat: str) -> int:
    return int(stat.rsplit(")", 1)[1].split()[16])


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        own = niceness(open("/proc/self/stat").read())
        child = subprocess.run(
            [sys.executable, "-S", "-c", "print(open('/proc/self/stat').read())"],
            capture_output=True, text=True, check=True,
        ).stdout
        return own + niceness(child) / 100
"""


@pytest.mark.parametrize("backend", ["bwrap", "unshare", "none"])
def test_sandboxed_code_runs_at_a_lower_priority(make_package, backend: str) -> None:
    if backend != "none" and not probe_backend(backend):
        pytest.skip(f"sandbox backend {backend} unavailable here")
    package = make_package(NICENESS)
    expected = min(19, os.nice(0) + SANDBOX_NICE)
    with Sandbox(package, limits=FAST, backend=backend, allow_unsandboxed=backend == "none") as sandbox:
        [result] = sandbox.reward_batch([{"task": {}, "completion": ""}])
    assert result == {"reward": expected + expected / 100, "error": None}
    assert expected > os.nice(0)  # this process keeps its own priority

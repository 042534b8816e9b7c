"""The worker's sandbox maxima travel in the spec and hold for the trainer's environment sandbox."""

from __future__ import annotations

from pathlib import Path

import pytest

from envsdk import Maxima, SandboxError
from envsdk.sandbox import probe_backend
from tests.trainer.conftest import make_spec
from trainer.environment import EnvironmentSession
from trainer.run import read_spec

CANARY = """import time
from envsdk import SingleTurnEnv


class Env(SingleTurnEnv):
    def reward(self, task, completion):
        time.sleep(60)
        return 1.0
"""


def test_the_specs_maxima_cap_the_environments_limits(tiny: Path, tmp_path: Path) -> None:
    if not (probe_backend("bwrap") or probe_backend("unshare")):
        pytest.skip("no sandbox backend here")
    package = tmp_path / "canary"
    package.mkdir()
    (package / "environment.toml").write_text(
        'name = "canary"\nversion = "0.1.0"\nentrypoint = "canary:Env"\n\n'
        "[limits]\ntimeout_s = 3600\nmemory_mb = 65536\nnproc = 4096\n"
    )
    (package / "canary.py").write_text(CANARY)
    maxima = Maxima(timeout_s=2, memory_mb=512, nproc=16)
    hyperparameters = {"max_steps": 1, "batch_size": 2, "num_generations": 2, "max_completion_length": 8}
    rows = [{"messages": [{"role": "user", "content": q}]} for q in ("unused", "also unused")]
    spec = read_spec(
        make_spec(
            tmp_path,
            tiny,
            "reinforcement",
            rows,
            hyperparameters=hyperparameters,
            environment={"package_dir": str(package), "config": {}},
            sandbox_maxima=maxima.as_dict(),
        )
    )
    session = EnvironmentSession(spec)
    try:
        limits = session.sandbox.limits
        assert (limits.timeout_s, limits.memory_mb, limits.nproc) == (2, 512, 16)
        with pytest.raises(SandboxError, match="within 2 s"):
            session.sandbox.reward_batch([{"task": {}, "completion": ""}])
    finally:
        session.close()

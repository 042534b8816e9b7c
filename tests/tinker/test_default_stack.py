"""The Tinker examples of docs/tinker.md against a stack started as a user starts one.

`tunegate up` runs as the venv's own command with default settings: no `TUNEGATE_*` variable, so embedded
PostgreSQL and Redis, and `tiny-chat` made in the data directory (the base model has no configured path).
Only the data directory and the ports are chosen, with `up`'s own options, so that the test touches no
user's `~/.tunegate` and no port in use. The organisation and key come from the admin API with the key
`up` stores in the data directory; the examples run as scripts with `TINKER_BASE_URL` and `TINKER_API_KEY`
and must end with a held-out reward above the one they started from. SIGTERM stops the stack, which must
leave nothing running.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from tests.support.stack import ROOT, command_lines, free_port

pytestmark = [pytest.mark.slow]

EXAMPLES = ROOT / "examples" / "tinker"
TUNEGATE = Path(sys.executable).with_name("tunegate")
"""The command `pip install` put beside the venv's Python, as a user runs it."""
READY_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 120.0
STEPS = {"sft_loop": 4, "rl_loop": 6}
"""Fewer training steps than the examples' defaults (9 and 24): enough to move held-out reward (measured,
seed 0: SFT 0.717 -> 0.800 in 3 steps; RL 0.717 -> 0.767 in 4 and 6)."""
HELDOUT = re.compile(r"^held-out reward (\d\.\d+) -> (\d\.\d+)$", re.MULTILINE)


def _user_env() -> dict[str, str]:
    """This environment without tunegate's settings, as in a user's fresh shell."""
    return {k: v for k, v in os.environ.items() if not k.startswith("TUNEGATE_")}


def _wait_ready(stack: subprocess.Popen[bytes], root: str, log: Path) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        assert stack.poll() is None, f"tunegate up exited ({stack.returncode}):\n{log.read_text()[-4000:]}"
        try:
            if httpx.get(f"{root}/readyz", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(1)
    raise AssertionError(f"tunegate up not ready in {READY_TIMEOUT_S:.0f} s:\n{log.read_text()[-4000:]}")


def _stop(stack: subprocess.Popen[bytes]) -> int:
    """SIGTERM (as `tunegate up` documents), then SIGKILL to its process group if it hangs."""
    if stack.poll() is None:
        stack.send_signal(signal.SIGTERM)
    try:
        return stack.wait(timeout=STOP_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(stack.pid, signal.SIGKILL)
        stack.wait()
        raise


def _run_example(name: str, root: str, key: str) -> tuple[float, float]:
    env = {**_user_env(), "TINKER_BASE_URL": root, "TINKER_API_KEY": "tml-" + key}
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / f"{name}.py"), "--steps", str(STEPS[name])],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1200,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-5000:]
    found = HELDOUT.findall(done.stdout)
    assert len(found) == 1, done.stdout[-3000:]
    before, after = (float(x) for x in found[0])
    return before, after


@pytest.mark.timeout(2400)
def test_the_docs_tinker_examples_pass_on_a_default_tunegate_up(tmp_path: Path) -> None:
    data_dir = tmp_path / "tunegate"
    port, engine_port = free_port(), free_port()
    root = f"http://127.0.0.1:{port}"
    log = tmp_path / "up.log"
    argv = [str(TUNEGATE), "up", "--data-dir", str(data_dir), "--port", str(port)]
    argv += ["--engine-port", str(engine_port)]
    with open(log, "wb") as out:
        stack = subprocess.Popen(
            argv, cwd=ROOT, env=_user_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
    try:
        _wait_ready(stack, root, log)
        admin_key = (data_dir / "admin_key").read_text().strip()
        with httpx.Client(
            base_url=root, headers={"Authorization": f"Bearer {admin_key}"}, timeout=60
        ) as admin:
            org = admin.post("/v1/admin/organizations", json={"name": "tinker-user"})
            assert org.status_code == 200, org.text
            made = admin.post(f"/v1/admin/organizations/{org.json()['id']}/api_keys", json={"name": "sdk"})
            assert made.status_code == 200, made.text
        key = made.json()["key"]

        # Each example finishes its session at the end, so the next one gets the stack's one training slot.
        sft = _run_example("sft_loop", root, key)
        assert sft[1] > sft[0], sft
        rl = _run_example("rl_loop", root, key)
        assert rl[1] > rl[0], rl
        print(f"held-out reward: SFT {sft[0]:.3f} -> {sft[1]:.3f}, RL {rl[0]:.3f} -> {rl[1]:.3f}")
    finally:
        code = _stop(stack)
    assert code == 0, log.read_text()[-4000:]
    assert [cmd for cmd in command_lines().values() if str(data_dir) in cmd] == []

"""The reference proxy: LiteLLM's proxy (`litellm[proxy]`) in a venv of its own (`bench/.venv-litellm`),
in front of the same fake upstream, one worker, pinned to the gateway's core, master-key auth on.
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from bench.common import ROOT, free_port, pinned, wait_port
from bench.stack import Process

logger = logging.getLogger(__name__)

VENV = ROOT / "bench" / ".venv-litellm"
MASTER_KEY = "sk-bench-litellm"
CONFIG = """model_list:
  - model_name: tiny-chat
    litellm_params:
      model: openai/tiny-chat
      api_base: {api_base}/v1
      api_key: sk-fake
general_settings:
  master_key: {master_key}
litellm_settings:
  drop_params: true
  telemetry: false
"""


def ensure_installed(timeout_s: float = 900, *, install: bool = True) -> tuple[Path | None, str]:
    """The `litellm` executable (installing it on first use unless `install` is False) and a note."""
    exe = VENV / "bin" / "litellm"
    if exe.exists():
        return exe, "installed in bench/.venv-litellm"
    if not install:
        return None, "not installed (quick runs do not install it; a full run does)"
    try:
        subprocess.run([sys.executable, "-m", "venv", str(VENV)], check=True, timeout=120)
        subprocess.run(
            [str(VENV / "bin" / "pip"), "install", "-q", "litellm[proxy]"],
            check=True,
            timeout=timeout_s,
            capture_output=True,
        )
    except (subprocess.SubprocessError, OSError) as exc:
        logger.warning("could not install litellm[proxy]: %s", exc)
        return None, f"could not install litellm[proxy]: {type(exc).__name__}"
    return (exe, "installed now into bench/.venv-litellm") if exe.exists() else (None, "litellm missing")


def version() -> str | None:
    py = VENV / "bin" / "python"
    if not py.exists():
        return None
    out = subprocess.run(
        [str(py), "-c", "from importlib.metadata import version; print(version('litellm'))"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return out.stdout.strip() or None


def start(exe: Path, upstream_url: str, workdir: Path, core: int | None) -> tuple[Process, str]:
    """LiteLLM's proxy on a free port; returns it and its base URL (without `/v1`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "litellm.yaml"
    config.write_text(CONFIG.format(api_base=upstream_url, master_key=MASTER_KEY))
    port = free_port()
    cmd = pinned(
        [str(exe), "--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"],
        core,
    )
    env = {
        "PATH": f"{VENV / 'bin'}:/usr/bin:/bin",
        "HOME": str(workdir),
        "LITELLM_LOG": "ERROR",
        "LITELLM_MODE": "PRODUCTION",
        "NO_DOCS": "True",
        "DISABLE_ADMIN_UI": "True",
    }
    proc = Process(cmd, workdir / "litellm.log", env=env)
    wait_port(port, 180, proc.proc)
    return proc, f"http://127.0.0.1:{port}"

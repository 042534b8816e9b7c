"""Schema-driven fuzzing: schemathesis over the gateway's own `/openapi.json`, tenant API then admin API.

Every operation gets generated requests (valid, invalid and boundary values: NUL bytes, huge integers, odd
unicode, missing and extra fields), bounded in examples and in time, and no answer may be a 5xx. The gateway
has a database of its own, so what the admin run creates, revokes or limits touches no other test.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from tests.support.fixtures import gateway_fixture
from tests.support.stack import GatewayServer, admin_of

MAX_EXAMPLES = 15
"""Generated requests per operation and phase."""
MAX_TIME_S = 40
"""Time budget of each of the two runs."""

CONFIG = """\
headers = { Authorization = "Bearer ${TUNEGATE_FUZZ_KEY}" }
"""


gateway = gateway_fixture("fuzz", scope="function", engine=False, own_database=True)


def _fuzz(gateway: GatewayServer, workdir: Path, key: str, *, include: str, exclude: str | None) -> str:
    """One schemathesis run over the operations whose path matches `include` (and not `exclude`)."""
    workdir.mkdir(parents=True, exist_ok=True)
    config = workdir / "schemathesis.toml"
    config.write_text(CONFIG)
    command = [
        sys.executable,
        "-m",
        "schemathesis.cli",
        "--config-file",
        str(config),
        "run",
        f"{gateway.url}/openapi.json",
        "--checks",
        "not_a_server_error",
        "--include-path-regex",
        include,
        "--max-examples",
        str(MAX_EXAMPLES),
        "--max-time",
        str(MAX_TIME_S),
        "--workers",
        "1",
        "--seed",
        "18",
        "--generation-database",
        "none",
        "--no-color",
        "--request-timeout",
        "30",
    ]
    if exclude:
        command += ["--exclude-path-regex", exclude]
    env = {**os.environ, "TUNEGATE_FUZZ_KEY": key, "NO_COLOR": "1"}
    done = subprocess.run(
        command, cwd=workdir, env=env, capture_output=True, text=True, timeout=MAX_TIME_S + 120
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-8000:]
    summary = re.search(r"\d+ generated, \d+ passed.*", output)
    assert summary is not None, output[-3000:]
    return summary.group(0)


def test_no_5xx_on_the_tenant_and_admin_apis(gateway: GatewayServer, tmp_path: Path) -> None:
    admin = admin_of(gateway)
    tenant = admin.tenant("fuzz")
    admin_key = gateway.settings.admin_key
    assert admin_key is not None
    # The tenant's API first: the admin run may revoke the tenant's key (it lists every organisation's keys).
    tenant_run = _fuzz(gateway, tmp_path / "tenant", tenant.key, include="^/", exclude="^/v1/admin/")
    admin_run = _fuzz(
        gateway, tmp_path / "admin", admin_key.get_secret_value(), include="^/v1/admin/", exclude=None
    )
    print(f"tenant API: {tenant_run}; admin API: {admin_run}")

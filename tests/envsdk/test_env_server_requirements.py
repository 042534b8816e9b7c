"""An env server that lacks a package's venv builds it (in its own settings' cache) before the first call."""

from __future__ import annotations

import secrets
from pathlib import Path

from envsdk.remote import RemoteSandbox
from envsdk.venvs import READY
from gateway.settings import Settings
from gateway.worker import redis_acl
from tests.envsdk.test_env_server import on_redis
from tests.envsdk.test_envsdk_venvs import PROBE_ENV, make_wheel, write_package
from tests.support.stack import Services
from tunegate.role_processes import EnvServerProcess


def test_env_server_builds_the_missing_venv(services: Services, tmp_path: Path, sandbox_backend: str) -> None:
    pool = "t-" + secrets.token_hex(3)
    settings = Settings(redis_url=services.redis_url, data_dir=tmp_path / "server")
    package = write_package(
        tmp_path / "probe", PROBE_ENV, ["tinyreward==1.0"], (make_wheel(tmp_path / "dist"),)
    )
    cache = settings.venv_builder().root
    assert not cache.exists()  # the server has never built this set
    server = EnvServerProcess(settings, tmp_path / "server.log", overrides={"TUNEGATE_ENV_POOL": pool})
    granted = on_redis(
        services,
        lambda c: redis_acl.grant(
            c, redis_url=services.redis_url, pool=pool, org_id="org-reqs", job_id="ftjob-requirements"
        ),
    )
    remote = RemoteSandbox(granted.url, package, org="org-reqs", pool=pool, job_id="ftjob-requirements")
    try:
        server.wait_registered()
        remote.start()
        [result] = remote.reward_batch([{"task": {"answer": "abcde"}, "completion": "score"}])
        assert result == {"reward": 5.0, "error": None}  # the shipped wheel's code, on the server
    finally:
        remote.close()
        server.kill()
        on_redis(services, lambda c: redis_acl.revoke(c, granted))
    [venv] = [p for p in cache.iterdir() if p.name != ".locks"]
    assert (venv / READY).is_file()

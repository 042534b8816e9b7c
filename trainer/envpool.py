"""Where a job's environment runs: the one place that chooses.

With ``ENV_POOL_REDIS_ENV`` and ``ENV_POOL_ORG_ENV`` set (the worker sets them for environment jobs: a Redis
URL with the job's own user, which reaches the organisation's namespace of the pool and nothing else) and an
env server registered in the pool (``tunegate env-server``), the environment runs on the pool's servers
(:class:`envsdk.remote.RemoteSandbox`); otherwise in a sandbox of the trainer's own, exactly as on one
machine (:class:`envsdk.sandbox.Sandbox`). Both have the same calls.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING

from envsdk.manifest import Maxima
from trainer.contract import ENV_POOL_NAME_ENV, ENV_POOL_ORG_ENV, ENV_POOL_REDIS_ENV, TrainerSpec

if TYPE_CHECKING:
    from envsdk.remote import RemoteSandbox
    from envsdk.sandbox import Sandbox

logger = logging.getLogger(__name__)


def registered_servers(redis_url: str, pool: str, org: str) -> int:
    """How many servers of ``pool`` take work for ``org`` now (0 when Redis does not answer)."""
    import redis

    from envsdk.remote_wire import live_servers

    client = redis.Redis.from_url(redis_url, socket_timeout=5, socket_connect_timeout=5)
    try:
        return sum(1 for r in live_servers(client, pool, org).values() if not r.draining)
    except redis.RedisError as exc:
        logger.warning("env pool %s: registrations unreadable (%s); running the environment here", pool, exc)
        return 0
    finally:
        client.close()


def open_sandbox(spec: TrainerSpec) -> Sandbox | RemoteSandbox:
    """The job's environment, not started: on the pool's servers when any is registered, else here."""
    assert spec.environment is not None
    package_dir = Path(spec.environment.package_dir)
    maxima = Maxima.from_dict(spec.sandbox_maxima)
    redis_url = os.environ.get(ENV_POOL_REDIS_ENV)
    org = os.environ.get(ENV_POOL_ORG_ENV)
    pool = os.environ.get(ENV_POOL_NAME_ENV) or "default"
    if redis_url and org and registered_servers(redis_url, pool, org):
        from envsdk.remote import RemoteSandbox

        logger.info("environment on the env servers of pool %s", pool)
        return RemoteSandbox(
            redis_url,
            package_dir,
            org=org,
            pool=pool,
            config=spec.environment.config,
            maxima=maxima,
            job_id=spec.job_id,
        )
    from envsdk.sandbox import Sandbox

    return Sandbox(
        package_dir, config=spec.environment.config, maxima=maxima, allow_unsandboxed=spec.allow_unsandboxed
    )

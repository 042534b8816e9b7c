"""Shared fixtures: one running stack per test session, and a fresh organisation per test.

The suite runs in as many processes as the machine has cores, four at most (pytest-xdist, `-n auto
--dist loadfile` in pyproject.toml: a module's tests stay in one process, with its module fixtures). Each
process is a test session of its own, with its own stack and database; they share the services and the venv
cache. With more than one process, every torch computes on one thread (`OMP_NUM_THREADS=1`, which the
workers pass on to their trainers, and vLLM's CPU build unbound from the cores): the tiny models gain nothing
from a second thread, and threads that outnumber the cores they get wait on each other at every operation (a
DPO job took 9 times as long). `pytest -n 0` runs the suite in one process.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import openai
import pytest

from gateway.db import create_pool, migrate
from tests.support.engine import EngineServer
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Services, Tenant, admin_of
from tests.support.vllm import vllm_server  # noqa: F401 - the session's vLLM, for any test package
from tunegate.services import scratch_database

MAX_WORKERS = 4
"""The most test processes `-n auto` starts: each holds its own stack, and a vLLM where its modules ask."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(os.cpu_count() or 1, MAX_WORKERS))


def pytest_configure(config: pytest.Config) -> None:
    processes = getattr(config.option, "numprocesses", None)
    if isinstance(processes, int) and processes > 1:  # the controller, before it starts its workers
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


@pytest.fixture(scope="session")
def services(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    svc = Services.start(tmp_path_factory.mktemp("services"))
    yield svc
    svc.stop()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from trainer.tiny import make_tiny_model

    return Path(make_tiny_model(tmp_path_factory.mktemp("tiny-model") / "tiny-chat"))


@pytest.fixture(scope="session")
def venv_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One cache of environment packages' venvs for the whole run, so that each framework's requirement set
    is built once: the envsdk tests' builder, every test gateway and its workers (`gateway_fixture`) and the
    formats bench (`tests/test_bench.py`) share it. Tests of building itself use caches of their own. The
    test processes of one run share it too (a build is locked across processes: `envsdk.venvs`)."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = tmp_path_factory.getbasetemp().parent / "venvs"
        shared.mkdir(exist_ok=True)
        return shared
    return tmp_path_factory.mktemp("venvs")


@pytest.fixture(scope="session")
def database(services: Services) -> Iterator[str]:
    with scratch_database(services.pg_dsn, "tunegate_test") as dsn:
        yield dsn


@pytest.fixture
def own_database(services: Services) -> Iterator[str]:
    """An empty database for one test whose workers must not see (or claim) the shared database's jobs."""
    with scratch_database(services.pg_dsn, "tunegate_test") as dsn:
        yield dsn


@pytest.fixture
async def migrated_pool(own_database: str) -> AsyncIterator[asyncpg.Pool]:
    """A pool on an empty database of the test's own, migrated: for store functions without a stack."""
    await migrate(own_database)
    pool = await create_pool(own_database, min_size=1, max_size=2)
    yield pool
    await pool.close()


stack = gateway_fixture("stack", scope="session", engine=False)
"""The session's gateway, on the shared database, serving no model."""


@pytest.fixture(scope="session")
def admin(stack: GatewayServer) -> Admin:
    return admin_of(stack)


@pytest.fixture(scope="module")
def gw_admin(gw: GatewayServer) -> Admin:
    """The admin API of the module's own gateway, `gw` (see `tests.support.fixtures.gateway_fixture`)."""
    return admin_of(gw)


def _cancel_open_jobs(t: Tenant) -> None:
    """Workers claim queued jobs of any organisation: a test leaves none behind for later tests' workers."""
    with contextlib.suppress(openai.APIError):
        for job in t.client.fine_tuning.jobs.list(limit=100):
            if job.status in ("validating_files", "queued", "running", "paused"):
                with contextlib.suppress(openai.APIError):
                    t.client.fine_tuning.jobs.cancel(job.id)


@pytest.fixture
def tenant(admin: Admin) -> Iterator[Tenant]:
    """A fresh organisation for this test (tenancy is the isolation between tests)."""
    t = admin.tenant("org-" + secrets.token_hex(3))
    yield t
    _cancel_open_jobs(t)


@pytest.fixture
def other_tenant(admin: Admin) -> Iterator[Tenant]:
    t = admin.tenant("other-" + secrets.token_hex(3))
    yield t
    _cancel_open_jobs(t)


@pytest.fixture(scope="module")
def engine(tiny_model_dir: Path) -> Iterator[EngineServer]:
    """An embedded engine serving `tiny-chat`, one per test module (adapters one module loads stay there)."""
    server = EngineServer.start({"tiny-chat": str(tiny_model_dir)})
    yield server
    server.stop()

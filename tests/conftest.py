"""Shared fixtures: one running stack per test session, and a fresh organisation per test."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.support.engine import EngineServer
from tests.support.stack import (
    Admin,
    GatewayServer,
    Services,
    Tenant,
    drop_database,
    make_database,
    make_settings,
)


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
def database(services: Services) -> Iterator[str]:
    name = f"tunegate_test_{secrets.token_hex(4)}"
    dsn = make_database(services.pg_dsn, name)
    yield dsn
    drop_database(services.pg_dsn, name)


@pytest.fixture
def own_database(services: Services) -> Iterator[str]:
    """An empty database for one test whose workers must not see (or claim) the shared database's jobs."""
    name = f"tunegate_test_{secrets.token_hex(4)}"
    yield make_database(services.pg_dsn, name)
    drop_database(services.pg_dsn, name)


@pytest.fixture(scope="session")
def stack(
    services: Services, database: str, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayServer]:
    settings = make_settings(
        data_dir=tmp_path_factory.mktemp("data"),
        database_url=database,
        redis_url=services.redis_url,
        tiny_model=tiny_model_dir,
    )
    server = GatewayServer(settings).start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def admin(stack: GatewayServer) -> Admin:
    key = stack.settings.admin_key
    assert key is not None
    return Admin(stack.url, key.get_secret_value())


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

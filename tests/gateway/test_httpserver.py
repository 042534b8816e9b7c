"""The gateway's HTTP server accepts every waiting connection in one turn of the loop, and serves them; a
kept-alive connection outlives an error answer."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import asyncpg
import httpx
import pytest
import uvicorn

from gateway.httpserver import ACCEPT_PER_TURN, Server, _Acceptor
from tests.support.fixtures import gateway_fixture
from tests.support.stack import Admin, GatewayServer, Services, free_port


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


# ---- keep-alive after an error -----------------------------------------------------------------------

gw = gateway_fixture("keepalive", engine=False, own_database=True, max_upload_bytes=4096)
"""A gateway of its own (its database is closed to connections in one test), uploads capped at 4 KiB."""


def _local_port(resp: httpx.Response) -> int:
    """The client's port of the connection a response came on: the same port, the same connection."""
    port: int = resp.extensions["network_stream"].get_extra_info("client_addr")[1]
    return port


def _megabytes(n: int, chunk: bytes = b"x" * 65536) -> Iterator[bytes]:
    """A chunked body of `n` MiB: still being sent when an early answer comes."""
    for _ in range(16 * n):
        yield chunk


def _multipart(data: bytes) -> tuple[bytes, dict[str, str]]:
    boundary = "keepalive-boundary"
    body = (
        f'--{boundary}\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nfine-tune\r\n'
        f'--{boundary}\r\nContent-Disposition: form-data; name="file"; filename="a.jsonl"\r\n\r\n'
    ).encode()
    body += data + f"\r\n--{boundary}--\r\n".encode()
    return body, {"content-type": f"multipart/form-data; boundary={boundary}"}


ERRORS: dict[str, tuple[Callable[[httpx.Client], httpx.Response], int, str | None]] = {
    "json body that is not JSON": (
        lambda c: c.post("/v1/evals", content=b"{not json", headers={"content-type": "application/json"}),
        400,
        "invalid_json",
    ),
    "unknown URL": (lambda c: c.get("/v1/nothing-here"), 404, "unknown_url"),
    "wrong key": (
        lambda c: c.get("/v1/files", headers={"Authorization": "Bearer sk-wrong"}),
        401,
        "invalid_api_key",
    ),
    "body over the request cap": (
        lambda c: c.post("/v1/evals", content=b"x" * (3 * 1024 * 1024)),
        413,
        "request_too_large",
    ),
    "upload over the upload cap": (
        lambda c: c.post("/v1/files", content=_multipart(b"x" * 100_000)[0], headers=_multipart(b"")[1]),
        413,
        "file_too_large",
    ),
    "upload that is not multipart, still streaming": (
        lambda c: c.post("/v1/files", content=_megabytes(4), headers=_multipart(b"")[1]),
        400,
        None,
    ),
}


@pytest.mark.parametrize("case", list(ERRORS))
def test_a_kept_alive_connection_serves_the_next_request_after_an_error(
    gw: GatewayServer, gw_admin: Admin, case: str
) -> None:
    """An error answer leaves the connection open for the client's next request (the body it did not read
    is skipped), with the error in OpenAI's envelope."""
    tenant = gw_admin.tenant("keepalive")
    make, status, code = ERRORS[case]
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60) as c:
        failed = make(c)
        assert failed.status_code == status, failed.text[:500]
        error = failed.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == code, error
        assert "connection" not in failed.headers
        served = c.get("/v1/files")
        assert served.status_code == 200 and served.json()["object"] == "list"
        assert _local_port(served) == _local_port(failed)


def _set_connections(database_url: str, allowed: bool, maintenance: str) -> None:
    """Open or close the database to connections; closing also ends the open ones (the gateway's pool)."""
    name = database_url.rsplit("/", 1)[1].split("?", 1)[0]

    async def run() -> None:
        conn = await asyncpg.connect(maintenance)
        try:
            await conn.execute(f'ALTER DATABASE "{name}" WITH ALLOW_CONNECTIONS {str(allowed).lower()}')
            if not allowed:
                await conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1", name
                )
        finally:
            await conn.close()

    asyncio.run(run())


def test_a_database_outage_answers_503_and_keeps_the_connection(
    gw: GatewayServer, gw_admin: Admin, services: Services
) -> None:
    """An exception no route handles (here: the database refusing connections) is answered through the one
    mapper, and the kept-alive connection serves the next request."""
    tenant = gw_admin.tenant("outage")
    database_url = gw.settings.database_url
    assert database_url is not None
    with httpx.Client(base_url=gw.url, headers={"Authorization": f"Bearer {tenant.key}"}, timeout=60) as c:
        assert c.get("/v1/files").status_code == 200
        _set_connections(database_url, False, services.pg_dsn)
        try:
            failed = c.get("/v1/files")
            assert failed.status_code == 503, failed.text[:500]
            assert failed.json() == {
                "error": {
                    "message": "The database is unavailable; retry shortly.",
                    "type": "server_error",
                    "param": None,
                    "code": "database_unavailable",
                }
            }
            assert failed.headers["retry-after"] == "1" and "connection" not in failed.headers
            alive = c.get("/healthz")
            assert alive.status_code == 200 and _local_port(alive) == _local_port(failed)
        finally:
            _set_connections(database_url, True, services.pg_dsn)
        served = c.get("/v1/files")
        assert served.status_code == 200 and _local_port(served) == _local_port(failed)

"""The cheapest proxy Python can be: the floor a Python gateway's added latency is measured against.

Raw asyncio streams on uvloop, one upstream connection per client connection, each request's bytes
forwarded as they came and the answer's bytes sent back: no parsing beyond `content-length`, no auth, no
limits, no metering. Run on the same core as the gateway, the latency it adds is what the machine charges
for one more process hop (scheduling, wake-ups across cores, loopback TCP), which no gateway can avoid.
Answers with a content length only (the gateway bench's non-streamed load).
`python -m bench.nullproxy PORT UPSTREAM_PORT` serves until killed.
"""

from __future__ import annotations

import asyncio
import sys

HEAD_END = b"\r\n\r\n"


def _length(head: bytes) -> int:
    pos = head.lower().find(b"content-length:")
    if pos < 0:
        return 0
    end = head.find(b"\r\n", pos)
    return int(head[pos + 15 : end if end >= 0 else len(head)])


async def _relay(upstream_port: int, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    up_reader, up_writer = await asyncio.open_connection("127.0.0.1", upstream_port)
    try:
        while True:
            try:
                head = await reader.readuntil(HEAD_END)
            except (asyncio.IncompleteReadError, ConnectionError):
                return
            up_writer.write(head + await reader.readexactly(_length(head)))
            answer = await up_reader.readuntil(HEAD_END)
            writer.write(answer + await up_reader.readexactly(_length(answer)))
    finally:
        up_writer.close()
        writer.close()


async def serve(port: int, upstream_port: int) -> None:
    server = await asyncio.start_server(
        lambda r, w: _relay(upstream_port, r, w), "127.0.0.1", port, backlog=4096, reuse_address=True
    )
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    try:
        import uvloop

        uvloop.install()
    except ImportError:  # the plain asyncio loop is fine, only slower
        pass
    asyncio.run(serve(int(argv[0]), int(argv[1])))


if __name__ == "__main__":
    main(sys.argv[1:])

"""HTTP/1.1 Upgrade to a raw byte stream (``sbx-stream/1`` for attach, ``sbx-tunnel/1`` for tunnels).

aiohttp only upgrades to WebSocket, so an upgrade answers ``101 Switching Protocols`` itself and then takes
the connection away from aiohttp: the transport gets a ``StreamReaderProtocol`` of its own, and the handler
works with a plain asyncio reader and writer, with flow control both ways (reading pauses when the reader's
buffer is full; ``drain`` waits while the transport's write buffer is full). A client sends its first bytes
after it has read the 101 answer, as with WebSocket.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

from aiohttp import web

from sbx.api.errors import InvalidRequest

#: Bytes buffered from the client before reading pauses (per direction, per connection).
READ_LIMIT_BYTES = 256 * 1024


@dataclass
class RawStream:
    """The upgraded connection."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter

    async def close(self) -> None:
        self.writer.close()
        try:
            await self.writer.wait_closed()
        except (ConnectionError, OSError):
            pass


def check_upgrade(request: web.Request, protocol: str) -> None:
    """Raise InvalidRequest unless the request asks to upgrade to ``protocol``."""
    connection = {t.strip().lower() for t in request.headers.get("Connection", "").split(",")}
    wanted = request.headers.get("Upgrade", "").strip().lower()
    if "upgrade" not in connection or wanted != protocol:
        raise InvalidRequest(
            f"this endpoint switches protocols: send 'Connection: Upgrade' and 'Upgrade: {protocol}'"
        )


async def upgrade(request: web.Request, protocol: str) -> RawStream:
    """Answer 101 and return the raw stream; the handler then owns the connection until it closes it."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away before the upgrade")
    loop = asyncio.get_running_loop()
    reader = asyncio.StreamReader(limit=READ_LIMIT_BYTES, loop=loop)
    stream_protocol = asyncio.StreamReaderProtocol(reader, loop=loop)
    # aiohttp must not parse what follows as HTTP; it closes the connection once the handler returns.
    request.protocol.keep_alive(False)
    transport.set_protocol(stream_protocol)
    stream_protocol.connection_made(transport)
    transport.resume_reading()
    writer = asyncio.StreamWriter(transport, stream_protocol, reader, loop)
    writer.write(
        f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n".encode()
    )
    await writer.drain()
    return RawStream(reader, writer)


def finished_response() -> web.StreamResponse:
    """What a handler returns after its upgraded session; aiohttp finds the connection closed and stops."""
    response = web.Response(status=101)
    response.force_close()
    return response

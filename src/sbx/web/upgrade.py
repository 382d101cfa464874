"""HTTP/1.1 Upgrade to a raw byte stream (``sbx-stream/1`` for attach, ``sbx-tunnel/1`` for tunnels), both sides.

Server side: aiohttp only upgrades to WebSocket, so an upgrade answers ``101 Switching Protocols`` itself and
then takes the connection away from aiohttp: the transport gets a ``StreamReaderProtocol`` of its own, and the
handler works with a plain asyncio reader and writer, with flow control both ways (reading pauses when the
reader's buffer is full; ``drain`` waits while the transport's write buffer is full). A client sends its first
bytes after it has read the 101 answer, as with WebSocket.

Client side (the SDK, and a gateway relaying to a node): :func:`request_head` is the one ``GET`` to send,
:func:`parse_head` reads the answer's head, :func:`read_refusal_body` the body of an answer that is not 101.
"""

from __future__ import annotations

import asyncio
import os
import socket
from dataclasses import dataclass

from aiohttp import web

from sbx.api.errors import Internal, InvalidRequest

#: Bytes buffered from the peer before reading pauses (per direction, per connection), and the largest answer
#: head a client accepts.
READ_LIMIT_BYTES = 256 * 1024
#: Largest error body read from a refused upgrade (bytes); the spec's error bodies are small.
MAX_ERROR_BODY_BYTES = 1 << 20


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
    return await take_over(
        request,
        f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n".encode(),
    )


async def take_over(request: web.Request, head: bytes) -> RawStream:
    """Take the connection away from aiohttp, send ``head`` (an answer's status line and headers, through the
    blank line: a 101 another server gave, passed on as it gave it) and return the raw stream."""
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
    writer.write(head)
    await writer.drain()
    return RawStream(reader, writer)


@dataclass
class RawSocket:
    """An upgraded connection as a plain non-blocking socket, for a handler that relays it in the kernel."""

    sock: socket.socket
    transport: asyncio.Transport

    def close(self) -> None:
        self.sock.close()
        self.transport.abort()  # nothing is buffered in it: everything went through ``sock``


async def take_over_socket(request: web.Request, protocol: str) -> RawSocket | None:
    """Answer 101 and return the connection's socket, or None (nothing sent) when the connection is not a
    plain socket (TLS): :func:`upgrade` serves those. The socket is a duplicate of the transport's, which
    stays paused (aiohttp reads nothing more) and is closed by :meth:`RawSocket.close`. As with :func:`upgrade`,
    the client sends its first bytes after it has read the 101."""
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client went away before the upgrade")
    plain = transport.get_extra_info("socket") if transport.get_extra_info("sslcontext") is None else None
    if plain is None or not isinstance(transport, asyncio.Transport):
        return None
    request.protocol.keep_alive(False)
    transport.pause_reading()
    sock = socket.socket(fileno=os.dup(plain.fileno()))
    sock.setblocking(False)
    raw = RawSocket(sock, transport)
    try:
        head = f"HTTP/1.1 101 Switching Protocols\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n"
        await asyncio.get_running_loop().sock_sendall(sock, head.encode())
    except BaseException:
        raw.close()
        raise
    return raw


def finished_response() -> web.StreamResponse:
    """What a handler returns after its upgraded session; aiohttp finds the connection closed and stops."""
    response = web.Response(status=101)
    response.force_close()
    return response


# --- client side -----------------------------------------------------------------------------------------


def request_head(target: str, host: str, protocol: str, headers: dict[str, str] | None = None) -> bytes:
    """The bytes of ``GET target`` asking to switch to ``protocol``, with ``headers`` (e.g. the token)."""
    lines = [f"GET {target} HTTP/1.1", f"Host: {host}", "Connection: Upgrade", f"Upgrade: {protocol}"]
    lines += [f"{name}: {value}" for name, value in (headers or {}).items()]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")


def parse_head(head: bytes) -> tuple[int, dict[str, str]]:
    """``(status, headers)`` of an answer head (through the blank line); names are lowercased.

    Raises ``Internal`` when it is not an HTTP/1.x answer.
    """
    text = head.decode("latin-1")
    status_line, _, rest = text.partition("\r\n")
    parts = status_line.split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise Internal(f"the server did not answer the upgrade with HTTP: {status_line[:80]!r}")
    headers: dict[str, str] = {}
    for line in rest.split("\r\n"):
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep:
            raise Internal(f"the server sent a malformed header line: {line[:80]!r}")
        headers[name.strip().lower()] = value.strip()
    return int(parts[1]), headers


async def read_refusal_body(reader: asyncio.StreamReader, headers: dict[str, str]) -> bytes:
    """The body of an answer that refused an upgrade (at most MAX_ERROR_BODY_BYTES), after its head."""
    length = headers.get("content-length", "")
    if length.isdigit():
        return await reader.readexactly(min(int(length), MAX_ERROR_BODY_BYTES))
    # No length: the body runs to the end of the connection (an upgrade never asks for keep-alive).
    return await reader.read(MAX_ERROR_BODY_BYTES)

"""Tunnel (sbx-tunnel/1): the raw bytes of a TCP connection to 127.0.0.1:port inside the sandbox.

The agent opens the connection inside the guest (only guest loopback is reachable). Where the agent takes raw
tunnels (protocol version 4) the tunnel is a connection of its own to the agent's tunnel socket, and the bytes
are spliced in the kernel between it and the client's socket (:func:`_splice`); a TLS client connection, which
cannot be spliced, is copied through the event loop, and an older agent's tunnel is framed on its main
connection (:func:`_pump`). Either way flow control on both sides keeps every buffer bounded. A half-close in
either direction is passed through (over TLS, which has none, the guest's end of data ends the tunnel); the
tunnel ends when both directions are closed, either side fails, or the client has half-closed and the guest
stays silent for HALF_CLOSED_IDLE_SECS. At most streams.MAX_TUNNELS are open per sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import socket
import time
from collections.abc import Callable
from typing import Final, Protocol

from aiohttp import web

from sbx.agent.client import AgentConnectionLost, AgentRequestError
from sbx.api.errors import Conflict, InvalidRequest, SandboxError
from sbx.net.splice import SpliceRelay
from sbx.node.context import NodeContext
from sbx.node.streams import holding
from sbx.web.http import query_one
from sbx.web.upgrade import RawStream, check_upgrade, finished_response, take_over_socket, upgrade

PROTOCOL = "sbx-tunnel/1"
_CHUNK_BYTES = 64 * 1024
#: After the client's EOF, the tunnel ends when the guest has sent nothing for this long (seconds).
HALF_CLOSED_IDLE_SECS: Final = 60.0


def parse_port(raw: str) -> int:
    """A TCP port 1-65535 from the query."""
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise InvalidRequest(f"port {raw!r} must be an integer from 1 to 65535")
    return int(raw)


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    async def tunnel(request: web.Request) -> web.StreamResponse:
        sandbox = ctx.manager.resolve_guest(request.match_info["ref"])
        port = parse_port(query_one(request, "port"))
        check_upgrade(request, PROTOCOL)
        await ctx.manager.wake_for_guest(sandbox)
        await sandbox.wake()
        agent = sandbox.processes.require_agent()
        with holding(ctx.streams.tunnels, sandbox.record.id, "tunnels"):
            try:
                # A raw tunnel connection where the agent takes one (relayed in the kernel); else frames on
                # the agent's main connection (an agent started before protocol version 4).
                raw = await agent.open_raw_tcp(port)
                guest: GuestStream = _GuestSocket(raw) if raw is not None else await agent.open_tcp(port)
            except AgentRequestError as exc:
                # Refused before switching protocols, so the client gets an ordinary error answer.
                raise Conflict(f"cannot connect to 127.0.0.1:{port} in the sandbox: {exc.message}") from None
            ctx.audit.record("tunnel.opened", sandbox.record.id, port=port)
            try:
                if raw is not None and (plain := await take_over_socket(request, PROTOCOL)) is not None:
                    try:
                        await _splice(raw, plain.sock, sandbox.touch)
                    finally:
                        plain.close()
                else:  # a framed tunnel, or a TLS client connection that the kernel cannot splice
                    stream = await upgrade(request, PROTOCOL)
                    try:
                        await _pump(guest, stream, sandbox.touch)
                    finally:
                        await stream.close()
            finally:
                await guest.close()
        return finished_response()

    return [web.get("/v1/sandboxes/{ref}/tunnel", tunnel)]


class GuestStream(Protocol):
    """The guest's end of a tunnel: :class:`AgentTcpStream` (framed) or :class:`_GuestSocket` (raw)."""

    async def read(self) -> bytes: ...
    async def write(self, data: bytes) -> None: ...
    async def write_eof(self) -> None: ...
    async def close(self) -> None: ...


class _GuestSocket:
    """A raw tunnel connection read and written through the event loop (for a TLS client connection)."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._loop = asyncio.get_running_loop()

    async def read(self) -> bytes:
        return await self._loop.sock_recv(self._sock, _CHUNK_BYTES)

    async def write(self, data: bytes) -> None:
        await self._loop.sock_sendall(self._sock, data)

    async def write_eof(self) -> None:
        self._sock.shutdown(socket.SHUT_WR)

    async def close(self) -> None:
        self._sock.close()


async def _splice(
    guest: socket.socket,
    client: socket.socket,
    touch: Callable[[], None],
    half_closed_idle_secs: float = HALF_CLOSED_IDLE_SECS,
) -> None:
    """:func:`_pump` in the kernel: splice both ways between two plain sockets, with the same end rules."""
    last_from_guest = time.monotonic()

    def moved(direction: int, _n: int) -> None:
        nonlocal last_from_guest
        if direction == 0:
            touch()
        else:
            last_from_guest = time.monotonic()

    relay = SpliceRelay(client, guest, on_moved=moved)
    finished = asyncio.ensure_future(relay.wait())
    client_eof = asyncio.ensure_future(relay.ended[0].wait())
    try:
        await asyncio.wait({finished, client_eof}, return_when=asyncio.FIRST_COMPLETED)
        last_from_guest = max(last_from_guest, time.monotonic())  # the silence counts from the client's EOF
        while not finished.done():
            # As in _pump: once the client's EOF is in, the guest's silence ends the tunnel.
            left = last_from_guest + half_closed_idle_secs - time.monotonic()
            if left <= 0:
                break
            await asyncio.wait({finished}, timeout=left)
        if finished.done():
            finished.result()
    except OSError:
        pass  # either side failed (reset, gone): the tunnel ends
    finally:
        relay.stop()
        for task in (finished, client_eof):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(finished, client_eof, return_exceptions=True)


async def _pump(
    guest: GuestStream,
    client: RawStream,
    touch: Callable[[], None],
    half_closed_idle_secs: float = HALF_CLOSED_IDLE_SECS,
) -> None:
    """Copy both ways until both directions have ended, either fails, or the client has sent its EOF and
    the guest has then sent nothing for ``half_closed_idle_secs``."""
    last_from_guest = time.monotonic()

    async def client_to_guest() -> None:
        nonlocal last_from_guest
        while data := await client.reader.read(_CHUNK_BYTES):
            await guest.write(data)
            touch()
        await guest.write_eof()
        # The silence counts from the EOF on: a guest that answers only once the upload is complete (however long
        # it took) gets its whole allowance.
        last_from_guest = max(last_from_guest, time.monotonic())

    async def guest_to_client() -> None:
        nonlocal last_from_guest
        while data := await guest.read():
            last_from_guest = time.monotonic()
            client.writer.write(data)
            await client.writer.drain()
        if not client.writer.can_write_eof():
            # A TLS connection has no half-close: the guest's end of data reaches the client as the end of the
            # connection (what it sent is flushed first), so a client that reads to the end is not left waiting.
            raise ConnectionResetError("the client's connection cannot be half-closed")
        client.writer.write_eof()

    sending, receiving = asyncio.create_task(client_to_guest()), asyncio.create_task(guest_to_client())
    try:
        while not (sending.done() and receiving.done()):
            # A client that closed its socket cannot be told from one that only half-closed it until a write
            # fails, and a guest that never answers nor closes would hold a gone client's tunnel (and its
            # slot) for ever: once the client's EOF is in, the guest's silence ends the tunnel.
            timeout = None
            if sending.done():
                timeout = max(0.0, last_from_guest + half_closed_idle_secs - time.monotonic())
            done, _ = await asyncio.wait(
                {t for t in (sending, receiving) if not t.done()}, timeout=timeout,
                return_when=asyncio.FIRST_COMPLETED,
            )  # fmt: skip
            for task in done:
                task.result()  # a failure of either direction ends the tunnel
            if not done and time.monotonic() - last_from_guest >= half_closed_idle_secs:
                break
    except (ConnectionError, AgentConnectionLost, AgentRequestError, SandboxError, OSError):
        pass
    finally:
        for task in (sending, receiving):
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(sending, receiving, return_exceptions=True)

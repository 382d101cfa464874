"""Tunnel (sbx-tunnel/1): the raw bytes of a TCP connection to 127.0.0.1:port inside the sandbox.

The agent opens the connection inside the guest (only guest loopback is reachable); bytes are copied both
ways with the agent's flow control on one side and the transport's on the other, so neither side buffers
without bound. A half-close in either direction is passed through; the tunnel ends when both directions
are closed, either side fails, or the client has half-closed and the guest stays silent for
HALF_CLOSED_IDLE_SECS. At most streams.MAX_TUNNELS are open per sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable
from typing import Final

from aiohttp import web

from sbx.agent.client import AgentConnectionLost, AgentRequestError, AgentTcpStream
from sbx.api.errors import Conflict, InvalidRequest, SandboxError
from sbx.node.context import NodeContext
from sbx.node.streams import holding
from sbx.web.http import query_one
from sbx.web.upgrade import RawStream, check_upgrade, finished_response, upgrade

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
                guest = await agent.open_tcp(port)
            except AgentRequestError as exc:
                # Refused before switching protocols, so the client gets an ordinary error answer.
                raise Conflict(f"cannot connect to 127.0.0.1:{port} in the sandbox: {exc.message}") from None
            ctx.audit.record("tunnel.opened", sandbox.record.id, port=port)
            stream: RawStream | None = None
            try:
                stream = await upgrade(request, PROTOCOL)
                await _pump(guest, stream, sandbox.touch)
            finally:
                await guest.close()
                if stream is not None:
                    await stream.close()
        return finished_response()

    return [web.get("/v1/sandboxes/{ref}/tunnel", tunnel)]


async def _pump(
    guest: AgentTcpStream,
    client: RawStream,
    touch: Callable[[], None],
    half_closed_idle_secs: float = HALF_CLOSED_IDLE_SECS,
) -> None:
    """Copy both ways until both directions have ended, either fails, or the client has sent its EOF and
    the guest has then sent nothing for ``half_closed_idle_secs``."""
    last_from_guest = time.monotonic()

    async def client_to_guest() -> None:
        while data := await client.reader.read(_CHUNK_BYTES):
            await guest.write(data)
            touch()
        await guest.write_eof()

    async def guest_to_client() -> None:
        nonlocal last_from_guest
        while data := await guest.read():
            last_from_guest = time.monotonic()
            client.writer.write(data)
            await client.writer.drain()
        if client.writer.can_write_eof():
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

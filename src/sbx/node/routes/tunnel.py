"""Tunnel (sbx-tunnel/1): the raw bytes of a TCP connection to 127.0.0.1:port inside the sandbox.

The agent opens the connection inside the guest (only guest loopback is reachable); bytes are copied both
ways with the agent's flow control on one side and the transport's on the other, so neither side buffers
without bound. A half-close in either direction is passed through; the tunnel ends when both directions
are closed or either side fails.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable

from aiohttp import web

from sbx.agent.client import AgentConnectionLost, AgentRequestError, AgentTcpStream
from sbx.api.errors import Conflict, InvalidRequest, SandboxError
from sbx.node.context import NodeContext
from sbx.web.http import query_one
from sbx.web.upgrade import RawStream, check_upgrade, finished_response, upgrade

PROTOCOL = "sbx-tunnel/1"
_CHUNK_BYTES = 64 * 1024


def parse_port(raw: str) -> int:
    """A TCP port 1-65535 from the query."""
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise InvalidRequest(f"port {raw!r} must be an integer from 1 to 65535")
    return int(raw)


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    async def tunnel(request: web.Request) -> web.StreamResponse:
        sandbox = ctx.manager.resolve_running(request.match_info["ref"])
        port = parse_port(query_one(request, "port"))
        check_upgrade(request, PROTOCOL)
        agent = sandbox.processes.require_agent()
        try:
            guest = await agent.open_tcp(port)
        except AgentRequestError as exc:
            # Refused before switching protocols, so the client gets an ordinary error answer.
            raise Conflict(f"cannot connect to 127.0.0.1:{port} in the sandbox: {exc.message}") from None
        ctx.audit.record("tunnel.opened", sandbox.record.id, port=port)
        stream = await upgrade(request, PROTOCOL)
        try:
            await _pump(guest, stream, sandbox.touch)
        finally:
            await guest.close()
            await stream.close()
        return finished_response()

    return [web.get("/v1/sandboxes/{ref}/tunnel", tunnel)]


async def _pump(guest: AgentTcpStream, client: RawStream, touch: Callable[[], None]) -> None:
    async def client_to_guest() -> None:
        while data := await client.reader.read(_CHUNK_BYTES):
            await guest.write(data)
            touch()
        await guest.write_eof()

    async def guest_to_client() -> None:
        while data := await guest.read():
            client.writer.write(data)
            await client.writer.drain()
        if client.writer.can_write_eof():
            client.writer.write_eof()

    tasks = [asyncio.create_task(client_to_guest()), asyncio.create_task(guest_to_client())]
    try:
        # Both directions run until each has closed; a failure of either ends the tunnel.
        for finished in asyncio.as_completed(tasks):
            await finished
    except (ConnectionError, AgentConnectionLost, SandboxError, OSError):
        pass
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(BaseException):
            await asyncio.gather(*tasks, return_exceptions=True)

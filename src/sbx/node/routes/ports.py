"""``GET /v1/sandboxes/{ref}/listening`` (an addition, capability ``listening_ports``): the TCP ports the guest
listens on, which a gateway turns into port URLs (docs/ports.md). It never wakes a dormant persistent sandbox."""

from __future__ import annotations

from aiohttp import web

from sbx.agent.client import AgentClient, AgentError
from sbx.api.errors import Internal
from sbx.api.ports import ListeningPorts
from sbx.node.context import NodeContext
from sbx.node.listening import listening_ports
from sbx.node.records import SandboxState
from sbx.web.http import json_response

#: The guest's tables of TCP sockets (IPv4, IPv6); a guest without IPv6 has no second one.
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")
#: The most of each table read, in bytes (about 25,000 sockets of 150 bytes): a guest with more sockets than
#: that cannot make the node hold more; the rows past it are not listed.
MAX_TABLE_BYTES = 4 * 1024 * 1024


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    uid, gid = ctx.backend.guest.uid, ctx.backend.guest.gid

    async def listening(request: web.Request) -> web.Response:
        sandbox = ctx.manager.resolve(request.match_info["ref"])
        if sandbox.record.state is not SandboxState.RUNNING or sandbox.processes.paused_reason is not None:
            return json_response(ListeningPorts(ports=[], awake=False))
        await sandbox.wake()  # unparked for the read (the request holds it)
        agent = sandbox.processes.require_agent()
        tables = []
        for path in TABLES:
            try:
                tables.append(await _read_capped(agent, path, uid, gid))
            except AgentError as exc:
                if path == TABLES[0]:
                    raise Internal(f"the guest's {path} could not be read: {exc}") from exc
        return json_response(ListeningPorts(ports=listening_ports(tables), awake=True))

    return [web.get("/v1/sandboxes/{ref}/listening", listening)]


async def _read_capped(agent: AgentClient, path: str, uid: int, gid: int) -> str:
    """The guest file ``path``, at most MAX_TABLE_BYTES of it (a cut last row is skipped by the parse)."""
    reader = await agent.open_read(path, uid, gid)
    data = bytearray()
    try:
        async for chunk in reader:
            data += chunk[: MAX_TABLE_BYTES - len(data)]
            if len(data) >= MAX_TABLE_BYTES:
                break
    finally:
        await reader.aclose()
    return data.decode(errors="replace")

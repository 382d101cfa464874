"""``GET /v1/sandboxes/{ref}/listening`` (an addition, capability ``listening_ports``): the TCP ports the guest
listens on, which a gateway turns into port URLs (docs/ports.md). It never wakes a dormant persistent sandbox."""

from __future__ import annotations

from aiohttp import web

from sbx.agent.client import AgentError
from sbx.api.errors import Internal
from sbx.api.ports import ListeningPorts
from sbx.node.context import NodeContext
from sbx.node.listening import listening_ports
from sbx.node.records import SandboxState
from sbx.web.http import json_response

#: The guest's tables of TCP sockets (IPv4, IPv6); a guest without IPv6 has no second one.
TABLES = ("/proc/net/tcp", "/proc/net/tcp6")


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
                tables.append(b"".join([chunk async for chunk in agent.read_file(path, uid, gid)]).decode())
            except AgentError as exc:
                if path == TABLES[0]:
                    raise Internal(f"the guest's {path} could not be read: {exc}") from exc
        return json_response(ListeningPorts(ports=listening_ports(tables), awake=True))

    return [web.get("/v1/sandboxes/{ref}/listening", listening)]

"""Sandbox audit events."""

from __future__ import annotations

import asyncio

from aiohttp import web

from sbx.api.errors import NotFound, Unsupported
from sbx.api.events import EventList
from sbx.node.context import NodeContext
from sbx.web.http import json_response

#: Events returned per call (spec: the newest 5000).
MAX_EVENTS = 5000


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    async def events(request: web.Request) -> web.Response:
        if not ctx.config.audit.enabled:
            raise Unsupported("this node keeps no audit log ([audit] enabled = false)")
        ref = request.match_info["ref"]
        sandbox = ctx.manager.resolve_or_none(ref)
        # A forgotten terminated sandbox is still answered by id; a name matches live sandboxes only.
        sandbox_id = sandbox.record.id if sandbox is not None else ref
        found, truncated = await asyncio.to_thread(ctx.audit.events_for, sandbox_id, limit=MAX_EVENTS)
        if sandbox is None and not found:
            raise NotFound(f"no sandbox {ref!r} on this node")
        return json_response(EventList(found, truncated))

    return [web.get("/v1/sandboxes/{ref}/events", events)]

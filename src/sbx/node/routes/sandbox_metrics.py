"""Per-sandbox metrics: the last hour of host-side samples (see sampler.py)."""

from __future__ import annotations

from aiohttp import web

from sbx.api.errors import Unsupported
from sbx.api.metrics import SandboxMetrics
from sbx.node.context import NodeContext
from sbx.web.http import json_response


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    async def metrics(request: web.Request) -> web.Response:
        sampler = ctx.sampler
        if sampler is None:
            raise Unsupported("this node keeps no per-sandbox metrics (capability metrics)")
        # Reading metrics is not activity: it must not keep a sandbox from idling out.
        sandbox = ctx.manager.resolve(request.match_info["ref"], touch=False)
        samples = sampler.samples(sandbox.record.id)
        return json_response(SandboxMetrics(sampler.interval_secs, [s.wire() for s in samples]))

    return [web.get("/v1/sandboxes/{ref}/metrics", metrics)]

"""Route tables of sandboxd, one module per resource; each module's ``routes(ctx)`` lists its endpoints, bound to
the API's catalogue (``sbx.api.endpoints``)."""

from __future__ import annotations

from aiohttp import web

from sbx.api.endpoints import served_by
from sbx.node.context import NodeContext
from sbx.node.routes import (
    attach,
    events,
    files,
    images,
    node,
    ports,
    processes,
    sandbox_metrics,
    sandboxes,
    snapshots,
    tunnel,
    volumes,
)


def all_routes(ctx: NodeContext) -> list[web.RouteDef]:
    """Every endpoint sandboxd serves: exactly those the API's catalogue marks for a node (checked here, and by
    a test)."""
    routes = [
        *node.routes(ctx),
        *sandboxes.routes(ctx),
        *processes.routes(ctx),
        *attach.routes(ctx),
        *tunnel.routes(ctx),
        *ports.routes(ctx),
        *files.routes(ctx),
        *events.routes(ctx),
        *images.routes(ctx),
        *sandbox_metrics.routes(ctx),
        *volumes.routes(ctx),
        *snapshots.routes(ctx),
    ]
    served = {(r.method, r.path) for r in routes if isinstance(r, web.RouteDef)}
    wanted = {ep.key for ep in served_by("node")}
    if served != wanted:
        raise RuntimeError(f"sandboxd's routes and the API catalogue differ: {sorted(served ^ wanted)}")
    return routes

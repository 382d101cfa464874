"""Route tables of sandboxd, one module per resource; each module's ``routes(ctx)`` lists its endpoints."""

from __future__ import annotations

from aiohttp import web

from sbx.node.context import NodeContext
from sbx.node.routes import (
    attach,
    events,
    files,
    images,
    node,
    processes,
    sandbox_metrics,
    sandboxes,
    snapshots,
    tunnel,
    volumes,
)


def all_routes(ctx: NodeContext) -> list[web.RouteDef]:
    """Every endpoint sandboxd serves under /v1."""
    return [
        *node.routes(ctx),
        *sandboxes.routes(ctx),
        *processes.routes(ctx),
        *attach.routes(ctx),
        *tunnel.routes(ctx),
        *files.routes(ctx),
        *events.routes(ctx),
        *images.routes(ctx),
        *sandbox_metrics.routes(ctx),
        *volumes.routes(ctx),
        *snapshots.routes(ctx),
    ]

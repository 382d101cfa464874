"""Route tables of the gateway, one module per resource; each module's ``routes(gw)`` lists its endpoints.

Order matters where patterns overlap: ``meta`` comes before ``sandboxes`` so ``/v1/sandboxes/{ref}/ssh-access``
is the gateway's own 404 and never relayed. The organisations routes live in ``sbx.gateway.orgs``."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from sbx.gateway import orgs
from sbx.gateway.routes import admin, meta, sandboxes, snapshots, volumes

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


def all_routes(gw: Gateway) -> list[web.RouteDef]:
    """Every endpoint the gateway serves under /v1."""
    return [
        *meta.routes(gw),
        *sandboxes.routes(gw),
        *volumes.routes(gw),
        *snapshots.routes(gw),
        *admin.routes(gw),
        *orgs.routes(gw),
    ]

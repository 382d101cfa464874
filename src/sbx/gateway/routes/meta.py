"""What the gateway answers itself: health, whoami, capabilities, and the refusals of what it does not serve
(``/v1/node`` 404, images 501; SSH without ``--ssh-listen`` is ``ssh.py``'s)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.errors import NotFound, Unavailable, Unsupported
from sbx.api.gateway import Health
from sbx.api.openapi import openapi_json
from sbx.gateway.capabilities import intersect_capabilities
from sbx.gateway.http import principal_of
from sbx.web.http import json_response

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class MetaRoutes:
    """Health, whoami, capabilities, and the endpoints this gateway refuses."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def openapi(self, request: web.Request) -> web.Response:
        return web.Response(body=openapi_json(), content_type="application/json")

    async def health(self, request: web.Request) -> web.Response:
        return json_response(Health("ok"))

    async def whoami(self, request: web.Request) -> web.Response:
        return json_response(principal_of(request).whoami())

    async def capabilities(self, request: web.Request) -> web.Response:
        caps = [n.status.capabilities for n in self.gw.registry.healthy() if n.status is not None]
        if not caps:
            raise Unavailable("no node is answering: the gateway cannot say what it offers now")
        return json_response(intersect_capabilities(caps))

    async def not_node(self, request: web.Request) -> web.Response:
        raise NotFound("a gateway does not serve /v1/node: use GET /v1/admin/nodes with an admin key")

    async def no_images(self, request: web.Request) -> web.Response:
        raise Unsupported("a gateway does not manage images: install them on each node with its images API")

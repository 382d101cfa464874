"""Capabilities, node status and cordon, and the API description."""

from __future__ import annotations

from aiohttp import web

from sbx.api.openapi import PATH as OPENAPI_PATH
from sbx.api.openapi import openapi_json
from sbx.api.requests import parse_cordon
from sbx.node.context import NodeContext
from sbx.web.http import json_response, read_json_body


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    async def capabilities(request: web.Request) -> web.Response:
        return json_response(ctx.capabilities())

    async def node_status(request: web.Request) -> web.Response:
        return json_response(ctx.node_status())

    async def openapi(request: web.Request) -> web.Response:
        return web.Response(body=openapi_json(), content_type="application/json")

    async def cordon(request: web.Request) -> web.Response:
        ctx.manager.cordoned = parse_cordon(await read_json_body(request))
        return json_response(ctx.node_status())

    return [
        web.get("/v1/capabilities", capabilities),
        web.get("/v1/node", node_status),
        web.post("/v1/node/cordon", cordon),
        web.get(OPENAPI_PATH, openapi),
    ]

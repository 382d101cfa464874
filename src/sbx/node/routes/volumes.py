"""Volumes: create, list and delete (always served; there is no capability for them)."""

from __future__ import annotations

from aiohttp import web

from sbx.api.requests import parse_volume_create
from sbx.api.volumes import VolumeList
from sbx.node.context import NodeContext
from sbx.web.http import json_response, read_json_body


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    volumes = ctx.manager.volumes

    async def create(request: web.Request) -> web.Response:
        req = parse_volume_create(await read_json_body(request), ctx.config)
        return json_response(await volumes.create(req.name, req.size_mb), status=201)

    async def list_volumes(request: web.Request) -> web.Response:
        return json_response(VolumeList(volumes.listing()))

    async def delete(request: web.Request) -> web.Response:
        # Looked up among existing volumes only (a malformed name is simply not one of them: 404).
        await volumes.delete(request.match_info["name"])
        return web.Response(status=204)

    return [
        web.post("/v1/volumes", create),
        web.get("/v1/volumes", list_volumes),
        web.delete("/v1/volumes/{name}", delete),
    ]

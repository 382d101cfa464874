"""Handlers of ``/v1/secrets``: the secrets of the tenant the request acts in; names and times only, never a
value (``sbx.gateway.secrets``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.codec import decode_request
from sbx.api.services import SecretList, SecretRequest
from sbx.gateway import auth
from sbx.gateway.http import principal_of
from sbx.web.http import json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class SecretRoutes:
    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def put(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        request[auth.TARGET_KEY] = name
        self.gw.secrets.require()
        req = decode_request(await read_json_body(request), SecretRequest)
        await self.gw.secrets.put(principal_of(request).tenant, name, req.value)
        return web.Response(status=204)

    async def list(self, request: web.Request) -> web.Response:
        return json_response(SecretList(self.gw.secrets.listing(principal_of(request).tenant)))

    async def delete(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        request[auth.TARGET_KEY] = name
        await self.gw.secrets.delete(principal_of(request).tenant, name)
        return web.Response(status=204)

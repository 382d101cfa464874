"""Handlers of the volume routes: one name space across the gateway; a volume is placed like a sandbox, and
listed, used and deleted only by its owner."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from aiohttp import web
from msgspec import UNSET

from sbx.api.codec import decode_request
from sbx.api.errors import Conflict, NotFound, SandboxError, Unavailable
from sbx.api.validation import validate_volume_name
from sbx.api.volumes import Volume, VolumeCreateRequest, VolumeList
from sbx.gateway import auth
from sbx.gateway.http import principal_of, relayed_path
from sbx.gateway.placement import Requested, choose_node
from sbx.gateway.relay import forward
from sbx.gateway.state import VolumeRecord, now_rfc3339
from sbx.web.http import json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class VolumeRoutes:
    """``/v1/volumes``."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def list(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        store = self.gw.store
        nodes = self.gw.registry.healthy()
        results = await asyncio.gather(*(n.client.volumes() for n in nodes), return_exceptions=True)
        found: list[Volume] = []
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, BaseException):
                continue  # a node failing now is left out, as an unhealthy one is
            for volume in result:
                rec = store.volumes.get(volume.name)
                if rec is not None and rec.node == node.name and principal.owns(rec.user, rec.tenant):
                    found.append(volume)
        return json_response(VolumeList(found))

    async def create(self, request: web.Request) -> web.Response:
        principal = principal_of(request)
        req = decode_request(await read_json_body(request), VolumeCreateRequest)
        validate_volume_name(req.name)
        gw = self.gw
        async with gw.reservation(gw.name_lock("volume", req.name)):
            if req.name in gw.store.volumes:
                raise Conflict(
                    f"a volume named {req.name!r} exists: volume names are shared across the gateway"
                )
            wanted = Requested(0, 0, req.size_mb if req.size_mb is not UNSET else None)
            excluded: set[str] = set()
            while (choice := choose_node(gw.registry.candidates(), excluded, wanted)) is not None:
                excluded.add(choice.name)
                node = gw.registry.nodes[choice.name]
                gw.metrics.scheduled.labels(node.name).inc()
                try:
                    volume = await node.client.create_volume(req)
                except SandboxError as exc:
                    if exc.status in (502, 503):
                        continue  # no room there, or no answer: the next node
                    raise
                await gw.write(gw.store.put_volume, VolumeRecord(
                    volume.name, principal.user, principal.tenant, node.name, now_rfc3339()))  # fmt: skip
                request[auth.TARGET_KEY] = volume.name
                return json_response(volume, status=201)
        raise Unavailable("no node can take this volume now (none answering with free disk and not cordoned); "
                          "try again later or ask for a smaller one")  # fmt: skip

    async def delete(self, request: web.Request) -> web.StreamResponse:
        principal = principal_of(request)
        name = request.match_info["name"]
        rec = self.gw.store.volumes.get(name)
        if rec is None or not principal.owns(rec.user, rec.tenant):
            raise NotFound(f"no volume {name!r} among yours")
        request[auth.TARGET_KEY] = name
        node = self.gw.node_for(rec.node, f"volume {name}").client
        response = await forward(request, node, request.method, relayed_path(request), None, None)
        if response.status == 204:
            await self.gw.write(self.gw.store.forget_volume, name)
        return response

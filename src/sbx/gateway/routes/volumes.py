"""Volume routes: one name space across the gateway; a volume is placed like a sandbox, and listed, used and
deleted only by its owner."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from sbx.api.errors import Conflict, InvalidRequest, NotFound
from sbx.gateway import bodies
from sbx.gateway.http import path_qs, principal_of
from sbx.gateway.placement import Resources
from sbx.gateway.relay import forward
from sbx.gateway.routes.fanout import list_owned, place_create
from sbx.gateway.state import VolumeRecord, now_rfc3339
from sbx.node.http import read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


def routes(gw: Gateway) -> list[web.RouteDef]:
    """List (one's own), create (placed), and calls on one volume relayed to its node."""
    store = gw.store

    async def list_volumes(request: web.Request) -> web.Response:
        principal = principal_of(request)

        def mine(v: dict[str, Any], node: str) -> bool:
            rec = store.volumes.get(str(v.get("name")))
            return rec is not None and rec.node == node and principal.owns(rec.user, rec.tenant)

        return await list_owned(gw, "/v1/volumes", "volumes", mine)

    async def create_volume(request: web.Request) -> web.Response:
        principal = principal_of(request)
        raw = await read_json_body(request)
        body = bodies.json_object(raw)
        name = body.get("name")
        if not isinstance(name, str) or not name:
            raise InvalidRequest("name is required: a volume name")
        async with gw.volume_lock:
            if name in store.volumes:
                raise Conflict(f"a volume named {name!r} exists: volume names are shared across the gateway")
            wanted = Resources(disk_mb=body["size_mb"] if isinstance(body.get("size_mb"), int) else 0)
            status, data, node_name = await place_create(gw, request, raw, wanted, None, path="/v1/volumes")
            if status == 201:
                await gw.write(store.put_volume, VolumeRecord(name, principal.user, principal.tenant, node_name,
                                                              now_rfc3339()))  # fmt: skip
        return web.Response(status=status, body=data, content_type="application/json")

    async def volume_call(request: web.Request) -> web.StreamResponse:
        principal = principal_of(request)
        name = request.match_info["name"]
        rec = store.volumes.get(name)
        if rec is None or not principal.owns(rec.user, rec.tenant):
            raise NotFound(f"no volume {name!r} among yours")
        node = gw.node_for(rec.node, f"volume {name}")
        body = await read_json_body(request) if request.method in ("POST", "PUT", "PATCH") else None
        response = await forward(request, node, request.method, path_qs(request, request.path), body, None)
        if request.method == "DELETE" and response.status == 204:
            await gw.write(store.forget_volume, name)
        return response

    return [
        web.get("/v1/volumes", list_volumes),
        web.post("/v1/volumes", create_volume),
        web.route("*", "/v1/volumes/{name}", volume_call),
    ]

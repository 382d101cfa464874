"""Snapshot routes and ownership: a snapshot taken through the gateway is recorded as its taker's; a scheduled
one belongs to whoever owns its sandbox."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from aiohttp import web

from sbx.api.errors import NotFound, SandboxError
from sbx.gateway import auth
from sbx.gateway.http import path_qs, principal_of
from sbx.gateway.relay import forward
from sbx.gateway.routes.fanout import list_owned

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


def routes(gw: Gateway) -> list[web.RouteDef]:
    """List (one's own) and calls on one snapshot relayed to its node."""
    store = gw.store

    async def list_snapshots(request: web.Request) -> web.Response:
        principal = principal_of(request)

        def mine(s: dict[str, Any], node: str) -> bool:
            return snapshot_owner(gw, principal, s, node)

        return await list_owned(gw, "/v1/snapshots", "snapshots", mine)

    async def snapshot_call(request: web.Request) -> web.StreamResponse:
        principal = principal_of(request)
        snapshot_id = request.match_info["id"]
        node = gw.node_for(await snapshot_node(gw, principal, snapshot_id), f"snapshot {snapshot_id}")
        response = await forward(request, node, request.method, path_qs(request, request.path), None, None)
        if request.method == "DELETE" and response.status == 204:
            await gw.write(store.forget_snapshot, snapshot_id)
        return response

    return [
        web.get("/v1/snapshots", list_snapshots),
        web.route("*", "/v1/snapshots/{id}", snapshot_call),
    ]


def snapshot_owner(gw: Gateway, principal: auth.Principal, snap: dict[str, Any], node: str) -> bool:
    """A snapshot is the caller's when recorded as theirs, or (scheduled ones) when its sandbox is theirs."""
    rec = gw.store.snapshots.get(str(snap.get("id")))
    if rec is not None:
        return rec.node == node and principal.owns(rec.user, rec.tenant)
    sandbox = gw.store.sandboxes.get(str(snap.get("sandbox")))
    return sandbox is not None and sandbox.node == node and principal.owns(sandbox.user, sandbox.tenant)


async def snapshot_node(gw: Gateway, principal: auth.Principal, snapshot_id: str) -> str:
    """The node holding the caller's snapshot ``snapshot_id``; 404 when it is not theirs or does not exist.

    A snapshot taken through the gateway is recorded; a scheduled one is found in the answering nodes'
    listings and belongs to whoever owns its sandbox."""
    rec = gw.store.snapshots.get(snapshot_id)
    if rec is not None:
        if principal.owns(rec.user, rec.tenant):
            return rec.node
        raise NotFound(f"no snapshot {snapshot_id!r} among yours")
    for node in gw.registry.healthy():
        try:
            listing = await node.call("GET", "/v1/snapshots")
        except SandboxError:
            continue
        if not isinstance(listing, dict):
            continue
        for snap in listing.get("snapshots") or []:
            if (
                isinstance(snap, dict)
                and snap.get("id") == snapshot_id
                and snapshot_owner(gw, principal, snap, node.name)
            ):
                return node.name
    raise NotFound(f"no snapshot {snapshot_id!r} among yours")

"""Handlers of the snapshot routes: the caller's snapshots from every answering node, and a delete relayed to
the node holding one (see ``sbx.gateway.snapshots`` for who owns a snapshot)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from aiohttp import web

from sbx.api.snapshots import SnapshotList
from sbx.gateway import auth
from sbx.gateway.http import principal_of, relayed_path
from sbx.gateway.relay import forward
from sbx.web.http import json_response

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class SnapshotRoutes:
    """``/v1/snapshots``."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    async def list(self, request: web.Request) -> web.Response:
        return json_response(SnapshotList(await self.gw.snapshots.list(principal_of(request))))

    async def delete(self, request: web.Request) -> web.StreamResponse:
        snapshot_id = request.match_info["id"]
        request[auth.TARGET_KEY] = snapshot_id
        node_name = await self.gw.snapshots.where(principal_of(request), snapshot_id)
        node = self.gw.node_for(node_name, f"snapshot {snapshot_id}").client
        response = await forward(request, node, request.method, relayed_path(request), None, None)
        if response.status == 204:
            await self.gw.write(self.gw.store.forget_snapshot, snapshot_id)
        return response

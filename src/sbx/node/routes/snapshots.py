"""Suspend and resume, snapshots and snapshot schedules (capabilities suspend, memory_snapshot, disk_snapshot)."""

from __future__ import annotations

from aiohttp import web

from sbx.api.errors import Unsupported
from sbx.api.requests import parse_schedule, parse_snapshot_create
from sbx.api.snapshots import SnapshotList
from sbx.node.checkpoints import Checkpoints
from sbx.node.context import NodeContext
from sbx.web.http import json_response, read_json_body


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    manager = ctx.manager

    def checkpoints(what: str) -> Checkpoints:
        if manager.checkpoints is None:
            raise Unsupported(
                f"the {ctx.backend.name} backend cannot {what} (capabilities suspend, memory_snapshot)"
            )
        return manager.checkpoints

    async def suspend(request: web.Request) -> web.Response:
        record = await checkpoints("suspend sandboxes").suspend(request.match_info["ref"])
        return json_response(record.wire())

    async def resume(request: web.Request) -> web.Response:
        service = checkpoints("resume sandboxes")
        sandbox = manager.resolve(request.match_info["ref"])
        if sandbox.record.dormant and manager.persistent is not None:
            # Suspended or stopped persistent: resumed, or booted from its disk (also when its memory image
            # cannot be restored); answered as it is now.
            await manager.persistent.wake(sandbox)
            return json_response(sandbox.record.wire())
        record = await service.resume(request.match_info["ref"])
        return json_response(record.wire())

    async def stop(request: web.Request) -> web.Response:
        if manager.persistent is None:
            raise Unsupported(
                f"the {ctx.backend.name} backend cannot keep a stopped sandbox's disk (capability persistent)"
            )
        record = await manager.persistent.stop(request.match_info["ref"])
        return json_response(record.wire())

    async def take(request: web.Request) -> web.Response:
        service = checkpoints("take snapshots")
        ref = request.match_info["ref"]
        sandbox = manager.resolve(ref)  # 404 before parsing, so a typo in the ref is named first
        kind = parse_snapshot_create(await read_json_body(request))
        await manager.wake_for_guest(
            sandbox, running=False
        )  # a dormant persistent sandbox is snapshotted awake
        snapshot = await service.snapshot(ref, kind)
        return json_response(snapshot.wire(), status=201)

    async def list_snapshots(request: web.Request) -> web.Response:
        service = checkpoints("take snapshots")
        return json_response(SnapshotList([s.wire() for s in service.store.records()]))

    async def delete(request: web.Request) -> web.Response:
        checkpoints("take snapshots").delete_snapshot(request.match_info["id"])
        return web.Response(status=204)

    async def schedule(request: web.Request) -> web.Response:
        ref = request.match_info["ref"]
        sandbox = manager.resolve(ref)
        req = parse_schedule(await read_json_body(request), ctx.config)
        await manager.wake_for_guest(sandbox, running=False)
        # Rule 4: a node that takes no snapshots answers 501, after the request is known to be well-formed.
        record = checkpoints("take snapshots, so it keeps no schedule").set_schedule(
            ref, req.every_secs, req.keep
        )
        return json_response(record.wire())

    return [
        web.post("/v1/sandboxes/{ref}/suspend", suspend),
        web.post("/v1/sandboxes/{ref}/resume", resume),
        web.post("/v1/sandboxes/{ref}/stop", stop),
        web.post("/v1/sandboxes/{ref}/snapshots", take),
        web.put("/v1/sandboxes/{ref}/snapshot-schedule", schedule),
        web.get("/v1/snapshots", list_snapshots),
        web.delete("/v1/snapshots/{id}", delete),
    ]

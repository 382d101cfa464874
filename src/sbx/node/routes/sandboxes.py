"""Sandboxes: create, list, get, change, terminate."""

from __future__ import annotations

import time

from aiohttp import web

from sbx.api.errors import InvalidRequest, SandboxError
from sbx.api.requests import parse_create, parse_patch
from sbx.api.sandboxes import SandboxList
from sbx.node.context import NodeContext
from sbx.web.http import json_response, read_json_body


def parse_label_filters(request: web.Request) -> dict[str, str]:
    """``label=key=value`` query parameters, repeatable; all must match."""
    wanted: dict[str, str] = {}
    for item in request.query.getall("label", []):
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise InvalidRequest(f"label filter {item!r} must be key=value")
        wanted[key] = value
    return wanted


def routes(ctx: NodeContext) -> list[web.RouteDef]:
    manager = ctx.manager

    async def create(request: web.Request) -> web.Response:
        started = time.monotonic()
        status = "error"
        try:
            req = parse_create(await read_json_body(request), ctx.config)
            record = await manager.create(req)
            status = "created"
            return json_response(record.wire(), status=201)
        except SandboxError as exc:
            status = exc.code
            raise
        finally:
            ctx.on_create(status, time.monotonic() - started)

    async def list_sandboxes(request: web.Request) -> web.Response:
        records = manager.records(parse_label_filters(request))
        return json_response(SandboxList([r.wire() for r in records]))

    async def get(request: web.Request) -> web.Response:
        return json_response(manager.resolve(request.match_info["ref"]).record.wire())

    async def patch(request: web.Request) -> web.Response:
        ref = request.match_info["ref"]
        manager.resolve(ref)  # 404 before parsing, so a typo in the ref is named first
        req = parse_patch(await read_json_body(request), ctx.config)
        record = await manager.patch(ref, req)
        return json_response(record.wire())

    async def delete(request: web.Request) -> web.Response:
        await manager.delete(request.match_info["ref"])
        return web.Response(status=204)

    return [
        web.post("/v1/sandboxes", create),
        web.get("/v1/sandboxes", list_sandboxes),
        web.get("/v1/sandboxes/{ref}", get),
        web.patch("/v1/sandboxes/{ref}", patch),
        web.delete("/v1/sandboxes/{ref}", delete),
    ]

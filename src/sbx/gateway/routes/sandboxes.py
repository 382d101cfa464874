"""Sandbox routes: create (labels stamped, pinned to the node holding its snapshot or volumes, name and quota
checked under locks, placed), the merged listing, and every per-sandbox call relayed to its node."""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused
from sbx.gateway import auth, bodies
from sbx.gateway.http import path_qs, principal_of, shape_of
from sbx.gateway.labels import OWNER_LABEL, TENANT_LABEL, check_client_labels, patch_body
from sbx.gateway.placement import Resources
from sbx.gateway.quotas import check_quota
from sbx.gateway.relay import Body, CappedBody, forward, guarded, relay_upgrade
from sbx.gateway.revocation import OpenRequest
from sbx.gateway.routes.fanout import place_create
from sbx.gateway.routes.snapshots import snapshot_node
from sbx.gateway.state import SandboxRecord, SnapshotRecord, now_rfc3339
from sbx.node.http import FILE_BODY_CAP, json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway

UPGRADE_PROTOCOLS = {"attach": "sbx-stream/1", "tunnel": "sbx-tunnel/1"}


def routes(gw: Gateway) -> list[web.RouteDef]:
    """Create, list, and every call under ``/v1/sandboxes/{ref}`` relayed to the sandbox's node."""
    store = gw.store

    async def create(request: web.Request) -> web.Response:
        principal = principal_of(request)
        started = time.monotonic()
        raw = await read_json_body(request)
        body = bodies.json_object(raw)
        labels = body.get("labels", {})
        if labels is None:
            labels = {}
        if not isinstance(labels, dict):
            raise InvalidRequest("labels must be an object of strings")
        check_client_labels(labels)
        stamped = {**labels, OWNER_LABEL: principal.user}
        if principal.tenant:
            stamped[TENANT_LABEL] = principal.tenant
        body["labels"] = stamped
        wanted = Resources(
            _int_field(body, "cpus"), _int_field(body, "memory_mb"), _int_field(body, "disk_mb")
        )
        pinned = await pinned_node(gw, principal, body)
        name = body.get("name") if isinstance(body.get("name"), str) and body.get("name") else None
        quota = store.quotas.get(principal.tenant)
        user_lock = gw.user_locks[(principal.user, principal.tenant)] if name else None
        tenant_lock = gw.tenant_locks[principal.tenant] if quota is not None else None
        async with _maybe(user_lock), _maybe(tenant_lock):
            if name is not None and gw.name_taken(principal, name):
                raise Conflict(
                    f"you already have a live sandbox named {name!r}: pick another name or delete it"
                )
            if quota is not None:
                check_quota(gw, principal.tenant, 1, wanted.cpus, wanted.memory_mb)
            status, data, node_name = await place_create(
                gw, request, json.dumps(body).encode(), wanted, pinned
            )
            if status != 201:
                return web.Response(status=status, body=data, content_type="application/json")
            wire = json.loads(data)
            rec = gw.record_from(wire, node_name, principal.user, principal.tenant)
            await gw.write(store.put_sandbox, rec)
            if quota is not None:
                try:
                    check_quota(gw, principal.tenant, 0, 0, 0)
                except Refused:
                    # The node's defaults took the tenant past its quota: undo, leaving nothing behind.
                    node = gw.registry.get(node_name)
                    if node is not None:
                        await node.call("DELETE", f"/v1/sandboxes/{rec.id}")
                    await gw.write(store.forget_sandboxes, [rec.id])
                    raise
        request[auth.TARGET_KEY] = rec.id
        gw.metrics.created.inc()
        gw.metrics.create_seconds.observe(time.monotonic() - started)
        return web.Response(status=201, body=data, content_type="application/json")

    async def list_sandboxes(request: web.Request) -> web.Response:
        principal = principal_of(request)
        nodes = gw.registry.healthy()
        results = await asyncio.gather(
            *(n.call("GET", path_qs(request, "/v1/sandboxes")) for n in nodes), return_exceptions=True
        )
        merged: list[dict[str, Any]] = []
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, InvalidRequest):
                raise result  # a bad label filter: every node says the same
            if isinstance(result, BaseException) or not isinstance(result, dict):
                continue  # a node failing now vanishes from the listing like an unhealthy one
            for s in result.get("sandboxes") or []:
                rec = store.sandboxes.get(str(s.get("id"))) if isinstance(s, dict) else None
                mine = rec is not None and rec.node == node.name and principal.owns(rec.user, rec.tenant)
                if mine or (rec is None and principal.admin and isinstance(s, dict)):
                    merged.append(s)
        merged.sort(key=lambda s: str(s.get("created_at", "")), reverse=True)
        return json_response({"sandboxes": merged})

    async def sandbox_call(request: web.Request) -> web.StreamResponse:
        principal = principal_of(request)
        rec = gw.resolve(principal, request.match_info["ref"])
        request[auth.TARGET_KEY] = rec.id
        node = gw.node_for(rec.node, f"sandbox {rec.id}")
        tail = request.match_info.get("tail", "")
        path = f"/v1/sandboxes/{rec.id}" + (f"/{tail}" if tail else "")
        op = OpenRequest(
            key_id=principal.key.id, user=principal.user, key_tenant=principal.key.tenant, tenant=principal.tenant,
            scopes=request.get(auth.SCOPES_KEY, ()), route=f"{request.method} {shape_of(request)}",
            sandbox=rec.id, node=node.name,
        )  # fmt: skip
        protocol = upgrade_protocol(request, tail)
        if protocol is not None:
            return await guarded(
                request, op, gw.open, relay_upgrade(request, node, path_qs(request, path), protocol, op)
            )
        body: Body = None
        if not tail and request.method == "PATCH":
            raw = await read_json_body(request)
            # Renames of one user run one at a time with their creates, so two cannot take one name together.
            async with gw.user_locks[(principal.user, principal.tenant)]:
                body = json.dumps(patch_body(gw, principal, rec, bodies.json_object(raw))).encode()
                response = await guarded(
                    request,
                    op,
                    gw.open,
                    forward(request, node, request.method, path_qs(request, path), body, op),
                )
                await after_sandbox_call(gw, request, principal, rec, tail, response)
            return response
        if tail == "files" and request.method == "PUT" or tail.endswith("/stdin"):
            body = CappedBody(request, FILE_BODY_CAP)
        elif request.method in ("POST", "PUT", "PATCH"):
            body = await read_json_body(request)
        response = await guarded(
            request, op, gw.open, forward(request, node, request.method, path_qs(request, path), body, op)
        )
        await after_sandbox_call(gw, request, principal, rec, tail, response)
        return response

    return [
        web.post("/v1/sandboxes", create),
        web.get("/v1/sandboxes", list_sandboxes),
        web.route("*", "/v1/sandboxes/{ref}", sandbox_call),
        web.route("*", "/v1/sandboxes/{ref}/{tail:.+}", sandbox_call),
    ]


def _int_field(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


class _maybe:
    """``async with`` an optional lock."""

    def __init__(self, lock: asyncio.Lock | None) -> None:
        self._lock = lock

    async def __aenter__(self) -> None:
        if self._lock is not None:
            await self._lock.acquire()

    async def __aexit__(self, *exc: object) -> None:
        if self._lock is not None:
            self._lock.release()


def upgrade_protocol(request: web.Request, tail: str) -> str | None:
    if request.method != "GET" or "upgrade" not in request.headers.get("Connection", "").lower():
        return None
    last = tail.rsplit("/", 1)[-1]
    if (
        last in UPGRADE_PROTOCOLS
        and request.headers.get("Upgrade", "").strip().lower() == UPGRADE_PROTOCOLS[last]
    ):
        return UPGRADE_PROTOCOLS[last]
    return None


async def after_sandbox_call(
    gw: Gateway, request: web.Request, principal: auth.Principal, rec: SandboxRecord, tail: str,
    response: web.StreamResponse,
) -> None:  # fmt: skip
    """Keep the records in step with what the node did: renames, terminations, snapshots taken."""
    if not isinstance(response, web.Response) or response.status >= 300:
        return
    if not tail and request.method == "PATCH" and response.body:
        wire = json.loads(bytes(response.body))  # type: ignore[arg-type]
        name = wire.get("name") or None
        if name != rec.name:
            await gw.write(gw.store.put_sandbox, replace(rec, name=name))
    elif not tail and request.method == "DELETE":
        gw.metrics.terminated.inc()
        if rec.name is not None:
            # The name is free again; the record stays until the node forgets the sandbox.
            await gw.write(gw.store.put_sandbox, replace(rec, name=None))
    elif tail == "snapshots" and request.method == "POST" and response.body:
        wire = json.loads(bytes(response.body))  # type: ignore[arg-type]
        if isinstance(wire, dict) and isinstance(wire.get("id"), str):
            await gw.write(gw.store.put_snapshot, SnapshotRecord(
                wire["id"], rec.user, rec.tenant, rec.node, rec.id, now_rfc3339()))  # fmt: skip


async def pinned_node(gw: Gateway, principal: auth.Principal, body: dict[str, Any]) -> str | None:
    """The node a create must go to: the one holding its snapshot or volumes (409 when they are on two)."""
    nodes: set[str] = set()
    snapshot_id = body.get("snapshot_id")
    if isinstance(snapshot_id, str):
        nodes.add(await snapshot_node(gw, principal, snapshot_id))
    volumes = body.get("volumes")
    if isinstance(volumes, list):
        for mount in volumes:
            name = mount.get("name") if isinstance(mount, dict) else None
            if not isinstance(name, str):
                continue  # the node answers the malformed mount
            vol = gw.store.volumes.get(name)
            if vol is None or not principal.owns(vol.user, vol.tenant):
                raise NotFound(f"no volume {name!r} among yours")
            nodes.add(vol.node)
    if len(nodes) > 1:
        raise Conflict(f"the volumes and snapshot named are on different nodes ({', '.join(sorted(nodes))}): "
                       "a sandbox can use only what one node holds")  # fmt: skip
    return nodes.pop() if nodes else None

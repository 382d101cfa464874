"""The gateway's core (``Gateway``: state, loops, reconcile, ownership look-ups, quota usage) and its route
tables. The request pipeline is in ``middlewares.py``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import re
import time
from collections import defaultdict
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from sbx.api.errors import (
    BadGateway,
    Conflict,
    InvalidRequest,
    NotFound,
    Refused,
    SandboxError,
    Unavailable,
    Unsupported,
)
from sbx.gateway import auth, bodies, keys, orgs
from sbx.gateway.audit import GatewayAudit
from sbx.gateway.capabilities import intersect_capabilities
from sbx.gateway.http import path_qs, principal_of, shape_of
from sbx.gateway.labels import OWNER_LABEL, TENANT_LABEL, check_client_labels, patch_body
from sbx.gateway.metrics import GatewayMetrics, GatewaySnapshot, NodeGauges
from sbx.gateway.nodes import Node, Registry, connect_node, parse_endpoint
from sbx.gateway.placement import Resources, choose_node
from sbx.gateway.quotas import check_quota
from sbx.gateway.relay import Body, CappedBody, forward, guarded, relay_upgrade
from sbx.gateway.revocation import DEFAULT_RECHECK_SECS, OpenRequest, OpenRequests
from sbx.gateway.state import (
    NodeDef,
    NodeFlags,
    SandboxRecord,
    SnapshotRecord,
    Store,
    VolumeRecord,
    now_rfc3339,
)
from sbx.node.http import (
    FILE_BODY_CAP,
    json_response,
    read_json_body,
)

log = logging.getLogger(__name__)

UPGRADE_PROTOCOLS = {"attach": "sbx-stream/1", "tunnel": "sbx-tunnel/1"}
DEFAULT_MAX_ORGS_PER_USER = 10


class NoSsh(NotFound):
    """The gateway serves no SSH (404 with code ``unsupported``, as the spec's SSH endpoints say)."""

    code = "unsupported"


@dataclass
class GatewayOptions:
    """Behaviour knobs of a serving gateway; defaults are the spec's."""

    cors_origins: frozenset[str] = frozenset()
    node_files_dir: Path | None = None
    max_orgs_per_user: int = DEFAULT_MAX_ORGS_PER_USER
    forget_interval_secs: float = 60.0
    recheck_secs: float = DEFAULT_RECHECK_SECS
    file_nodes: list[NodeDef] = field(default_factory=list)


class Gateway:
    """Everything a serving gateway holds."""

    def __init__(
        self, store: Store, registry: Registry, audit: GatewayAudit | None, options: GatewayOptions
    ) -> None:
        self.store = store
        self.registry = registry
        self.audit = audit
        self.options = options
        self.open = OpenRequests()
        self.metrics = GatewayMetrics(self.snapshot)
        self._user_locks: defaultdict[tuple[str, str], asyncio.Lock] = defaultdict(asyncio.Lock)
        self._tenant_locks: defaultdict[str, asyncio.Lock] = defaultdict(asyncio.Lock)
        #: Volume creates one at a time: their names are one name space across every node.
        self.volume_lock = asyncio.Lock()
        self._tasks: list[asyncio.Task[None]] = []
        registry.wanted_cordon = self.wanted_cordon
        registry.on_answering_again.append(self.reconcile)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        for definition in [*self.options.file_nodes, *self.store.nodes.values()]:
            try:
                self.registry.add(connect_node(definition))
            except (SandboxError, OSError, ValueError) as exc:
                log.error("node not usable", extra={"node": definition.name, "error": str(exc)})
        await self.registry.start()
        self._tasks.append(
            asyncio.create_task(self._every(self.options.forget_interval_secs, self.forget_sweep))
        )
        self._tasks.append(asyncio.create_task(self._every(self.options.recheck_secs, self.recheck)))

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.registry.close()

    async def _every(self, interval_secs: float, fn: Callable[[], Awaitable[None]]) -> None:
        while True:
            await asyncio.sleep(interval_secs)
            try:
                await fn()
            except Exception:
                log.exception("periodic task failed")

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A store write off the event loop (a commit is an fsync)."""
        return await asyncio.to_thread(fn, *args)

    def wanted_cordon(self, name: str) -> bool:
        return self.store.node_flags.get(name, NodeFlags()).cordoned

    def snapshot(self) -> GatewaySnapshot:
        nodes = []
        for node in list(self.registry.nodes.values()):
            status = node.status or {}
            cap = status.get("capacity") or {}
            free = status.get("free") or {}
            nodes.append(NodeGauges(
                node.name, node.healthy, self.wanted_cordon(node.name) or bool(status.get("cordoned")),
                int(status.get("running", 0)),
                (int(cap.get("cpus", 0)), int(cap.get("memory_mb", 0)), int(cap.get("disk_mb", 0))),
                (int(free.get("cpus", 0)), int(free.get("memory_mb", 0)), int(free.get("disk_mb", 0))),
            ))  # fmt: skip
        records = list(self.store.sandboxes.values())
        return GatewaySnapshot(len(records), sum(1 for r in records if self.is_lost_node(r.node)), nodes)

    def is_lost_node(self, name: str) -> bool:
        node = self.registry.get(name)
        return node is not None and node.is_lost(self.registry.lost_after_secs)

    # -- reconcile and forget ------------------------------------------------------------------

    async def node_listing(self, node: Node) -> list[dict[str, Any]]:
        body = await node.call("GET", "/v1/sandboxes", timeout_secs=30.0)
        sandboxes = body.get("sandboxes") if isinstance(body, dict) else None
        if not isinstance(sandboxes, list):
            raise BadGateway(f"node {node.name} answered its listing without a sandboxes array")
        return [s for s in sandboxes if isinstance(s, dict)]

    async def reconcile(self, node: Node) -> None:
        """Bring the records of ``node`` in line with its own listing: forget what it no longer runs, and take
        back a sandbox it runs with our labels but no record (the gateway stopped between the node's answer
        and the record's commit)."""
        started = time.time()
        listing = await self.node_listing(node)
        live = {
            s["id"]: s for s in listing if s.get("state") != "terminated" and isinstance(s.get("id"), str)
        }
        stale = [
            r.id for r in list(self.store.sandboxes.values())
            if r.node == node.name and r.id not in live and _created_before(r.created, started - 2)
        ]  # fmt: skip
        if stale:
            await self.write(self.store.forget_sandboxes, stale)
            log.info(
                "forgot sandboxes the node no longer runs", extra={"node": node.name, "count": len(stale)}
            )
        for sandbox_id, wire in live.items():
            labels = wire.get("labels") or {}
            if (
                sandbox_id in self.store.sandboxes
                or not isinstance(labels, dict)
                or OWNER_LABEL not in labels
            ):
                continue
            await self.write(self.store.put_sandbox, self.record_from(wire, node.name, str(labels[OWNER_LABEL]),
                                                                      str(labels.get(TENANT_LABEL, ""))))  # fmt: skip
        node.reconciled_at = time.monotonic()

    async def forget_sweep(self) -> None:
        """Every minute: reconcile every answering node from its listing."""
        for node in self.registry.healthy():
            try:
                await self.reconcile(node)
            except SandboxError as exc:
                log.warning("forget sweep skipped a node", extra={"node": node.name, "error": exc.message})

    def record_from(self, wire: dict[str, Any], node: str, user: str, tenant: str) -> SandboxRecord:
        name = wire.get("name")
        return SandboxRecord(
            id=str(wire["id"]), user=user, tenant=tenant, node=node,
            name=name if isinstance(name, str) and name else None,
            cpus=int(wire.get("cpus") or 0), memory_mb=int(wire.get("memory_mb") or 0),
            created=str(wire.get("created_at") or now_rfc3339()),
        )  # fmt: skip

    # -- revocation ----------------------------------------------------------------------------

    async def end_for_key(self, key_id: str) -> list[OpenRequest]:
        ended = await self.open.end_where(lambda op: op.key_id == key_id)
        self.audit_closed(ended)
        return ended

    def audit_closed(self, ended: list[OpenRequest]) -> None:
        for op in ended:
            self.record_audit(kind="revocation", type="api.revoked", key_id=op.key_id, user=op.user,
                              tenant=op.tenant or None, target=op.sandbox, node=op.node, route=op.route,
                              result="closed")  # fmt: skip

    async def recheck(self) -> None:
        """Every 30 s: end open requests whose key is gone, revoked, lost its scope, or whose org membership
        ended (a change made to the state while they were open)."""

        def bad(op: OpenRequest) -> bool:
            if not auth.is_key_still_good(self.store, op.key_id, op.scopes):
                return True
            key = self.store.keys.get(op.key_id)
            if key is None:
                return True
            if op.tenant != op.key_tenant and "admin" not in key.scopes:
                member = self.store.members.get((op.tenant, op.user))
                return member is None or member.tenant != op.key_tenant
            return False

        self.audit_closed(await self.open.end_where(bad))

    def record_audit(self, **fields: Any) -> None:
        if self.audit is not None:
            self.audit.record(**fields)

    # -- ownership lookups ---------------------------------------------------------------------

    def resolve(self, principal: auth.Principal, ref: str) -> SandboxRecord:
        """The caller's sandbox named by id or name; 404 for one not theirs or absent either way.

        The node is then asked by id, never by name: one node may hold sandboxes of several users under one
        name. A name matching more than one (an admin's look-up among every user's, or a user's own sandbox
        on a lost node and its namesake made meanwhile) is 409 naming the ids, never one picked silently."""
        rec = self.store.sandboxes.get(ref)
        if rec is not None and principal.owns(rec.user, rec.tenant):
            return rec
        mine = [
            r for r in list(self.store.sandboxes.values())
            if r.name == ref and r.user == principal.user and r.tenant == principal.tenant
        ]  # fmt: skip
        if not mine and principal.admin:
            mine = [r for r in list(self.store.sandboxes.values()) if r.name == ref]
        if len(mine) > 1:
            ids = ", ".join(sorted(r.id for r in mine))
            raise Conflict(f"the name {ref!r} matches {len(mine)} live sandboxes ({ids}); use the id")
        if mine:
            return mine[0]
        raise NotFound(f"no sandbox {ref!r} among yours")

    def node_for(self, name: str, what: str) -> Node:
        node = self.registry.get(name)
        if node is None:
            raise Unavailable(f"the node {name!r} holding {what} is not known to this gateway any more")
        if not node.healthy:
            raise Unavailable(f"the node {name!r} holding {what} is not answering; try again later")
        return node

    def name_taken(self, principal: auth.Principal, name: str, except_id: str | None = None) -> bool:
        return any(
            r.name == name and r.user == principal.user and r.tenant == principal.tenant and r.id != except_id
            and not self.is_lost_node(r.node)
            for r in list(self.store.sandboxes.values())
        )  # fmt: skip

    def tenant_usage(self, tenant: str) -> tuple[int, int, int]:
        """(sandboxes, cpus, memory_mb) counted against ``tenant``'s quota: records not on lost nodes."""
        count = cpus = memory = 0
        for r in list(self.store.sandboxes.values()):
            if r.tenant == tenant and not self.is_lost_node(r.node):
                count += 1
                cpus += r.cpus
                memory += r.memory_mb
        return count, cpus, memory


def _created_before(created: str, epoch_secs: float) -> bool:
    try:
        return datetime.fromisoformat(created).timestamp() < epoch_secs
    except ValueError:
        return True


def _int_field(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


# -- routes -------------------------------------------------------------------------------------


def routes(gw: Gateway) -> list[web.RouteDef]:
    store = gw.store

    async def health(request: web.Request) -> web.Response:
        return json_response({"status": "ok"})

    async def whoami(request: web.Request) -> web.Response:
        return json_response(principal_of(request).whoami())

    async def capabilities(request: web.Request) -> web.Response:
        caps = [n.status["capabilities"] for n in gw.registry.healthy()
                if n.status and isinstance(n.status.get("capabilities"), dict)]  # fmt: skip
        if not caps:
            raise Unavailable("no node is answering: the gateway cannot say what it offers now")
        return json_response(intersect_capabilities(caps))

    async def not_node(request: web.Request) -> web.Response:
        raise NotFound("a gateway does not serve /v1/node: use GET /v1/admin/nodes with an admin key")

    async def no_images(request: web.Request) -> web.Response:
        raise Unsupported("a gateway does not manage images: install them on each node with its images API")

    async def no_ssh(request: web.Request) -> web.Response:
        raise NoSsh("this gateway serves no SSH")

    async def later(request: web.Request) -> web.Response:
        raise Unsupported(f"this gateway does not serve {request.path.split('/')[2]} yet")

    # -- sandboxes -----------------------------------------------------------------------------

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
        user_lock = gw._user_locks[(principal.user, principal.tenant)] if name else None
        tenant_lock = gw._tenant_locks[principal.tenant] if quota is not None else None
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
            async with gw._user_locks[(principal.user, principal.tenant)]:
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

    # -- volumes and snapshots ---------------------------------------------------------------

    async def list_owned(
        request: web.Request, path: str, key: str, owner: Callable[[dict[str, Any], str], bool]
    ) -> web.Response:
        nodes = gw.registry.healthy()
        results = await asyncio.gather(*(n.call("GET", path) for n in nodes), return_exceptions=True)
        merged: list[dict[str, Any]] = []
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, dict):
                merged += [x for x in result.get(key) or [] if isinstance(x, dict) and owner(x, node.name)]
        return json_response({key: merged})

    async def list_volumes(request: web.Request) -> web.Response:
        principal = principal_of(request)

        def mine(v: dict[str, Any], node: str) -> bool:
            rec = store.volumes.get(str(v.get("name")))
            return rec is not None and rec.node == node and principal.owns(rec.user, rec.tenant)

        return await list_owned(request, "/v1/volumes", "volumes", mine)

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

    async def list_snapshots(request: web.Request) -> web.Response:
        principal = principal_of(request)

        def mine(s: dict[str, Any], node: str) -> bool:
            return snapshot_owner(gw, principal, s, node)

        return await list_owned(request, "/v1/snapshots", "snapshots", mine)

    async def snapshot_call(request: web.Request) -> web.StreamResponse:
        principal = principal_of(request)
        snapshot_id = request.match_info["id"]
        node = gw.node_for(await snapshot_node(gw, principal, snapshot_id), f"snapshot {snapshot_id}")
        response = await forward(request, node, request.method, path_qs(request, request.path), None, None)
        if request.method == "DELETE" and response.status == 204:
            await gw.write(store.forget_snapshot, snapshot_id)
        return response

    table = [
        web.get("/v1/health", health),
        web.get("/v1/whoami", whoami),
        web.get("/v1/capabilities", capabilities),
        web.route("*", "/v1/node", not_node),
        web.route("*", "/v1/node/{tail:.*}", not_node),
        web.route("*", "/v1/images", no_images),
        web.route("*", "/v1/images/{tail:.*}", no_images),
        web.route("*", "/v1/ssh", no_ssh),
        web.route("*", "/v1/ssh-keys", no_ssh),
        web.route("*", "/v1/ssh-keys/{tail:.*}", no_ssh),
        web.route("*", "/v1/sandboxes/{ref}/ssh-access", no_ssh),
        web.route("*", "/v1/admin/ssh-keys", no_ssh),
        web.route("*", "/v1/admin/ssh-keys/{tail:.*}", no_ssh),
        web.post("/v1/sandboxes", create),
        web.get("/v1/sandboxes", list_sandboxes),
        web.route("*", "/v1/sandboxes/{ref}", sandbox_call),
        web.route("*", "/v1/sandboxes/{ref}/{tail:.+}", sandbox_call),
        web.get("/v1/volumes", list_volumes),
        web.post("/v1/volumes", create_volume),
        web.route("*", "/v1/volumes/{name}", volume_call),
        web.get("/v1/snapshots", list_snapshots),
        web.route("*", "/v1/snapshots/{id}", snapshot_call),
    ]
    for resource in ("services", "jobs", "agent-runs", "secrets"):
        table += [
            web.route("*", f"/v1/{resource}", later),
            web.route("*", f"/v1/{resource}/{{tail:.*}}", later),
        ]
    return table + admin_routes(gw) + orgs.routes(gw)


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


async def place_create(
    gw: Gateway, request: web.Request, body: bytes, wanted: Resources, pinned: str | None,
    path: str = "/v1/sandboxes",
) -> tuple[int, bytes, str]:  # fmt: skip
    """POST ``body`` to the node placement picks, moving on when one refuses for capacity (503) or fails to
    answer (502); 503 when no node takes it. Any other answer is the create's (a node scopes names by the
    ``gateway.owner`` and ``gateway.tenant`` labels, so its 409 for a name is the caller's own)."""
    excluded: set[str] = set()
    while True:
        candidates = gw.registry.candidates()
        if pinned is not None:
            candidates = [c for c in candidates if c.name == pinned]
        choice = choose_node(candidates, excluded, wanted)
        if choice is None:
            break
        node = gw.registry.nodes[choice.name]
        gw.metrics.scheduled.labels(node.name).inc()
        try:
            async with node.session.post(node.url(path), data=body, headers={
                **node.headers(), "Content-Type": "application/json"}) as resp:  # fmt: skip
                data = await resp.read()
                status = resp.status
        except Exception as exc:  # noqa: BLE001 - any failure to answer: try the next node
            log.warning(
                "node did not answer a create", extra={"node": node.name, "error": type(exc).__name__}
            )
            excluded.add(node.name)
            continue
        if status in (502, 503):
            excluded.add(node.name)
            continue
        if status == 201 and path == "/v1/sandboxes":
            take_from_status(node, data)
        return status, data, node.name
    gw.metrics.refused.labels("capacity").inc()
    where = f"node {pinned}" if pinned else "any node"
    raise Unavailable(f"no node can take this now ({where}: none answering with free capacity and not cordoned); "
                      "try again later or ask for fewer resources")  # fmt: skip


def take_from_status(node: Node, created: bytes) -> None:
    """Count a sandbox just made against the node's last status until the next poll, so creates in quick
    succession spread out instead of all going to the node that looked emptiest a moment ago."""
    try:
        wire = json.loads(created)
    except ValueError:
        return
    status = node.status
    if not isinstance(status, dict) or not isinstance(status.get("free"), dict) or not isinstance(wire, dict):
        return
    free = dict(status["free"])
    for key in ("cpus", "memory_mb", "disk_mb"):
        if isinstance(free.get(key), int) and isinstance(wire.get(key), int):
            free[key] = max(0, free[key] - wire[key])
    node.status = {**status, "free": free, "running": int(status.get("running", 0)) + 1}


# -- admin --------------------------------------------------------------------------------------


def admin_routes(gw: Gateway) -> list[web.RouteDef]:
    store = gw.store
    registry = gw.registry

    async def create_key(request: web.Request) -> web.Response:
        body = bodies.json_object(await read_json_body(request))
        bodies.only_fields(body, ("user", "tenant", "scopes"))
        user = keys.check_user(body.get("user"))
        tenant = keys.check_tenant(body.get("tenant"))
        scopes = keys.check_scopes(body.get("scopes"))
        key, secret = keys.new_key(user, tenant, scopes)
        await gw.write(store.add_key, key)
        request[auth.TARGET_KEY] = key.id
        return json_response(keys.created_wire(key, secret), status=201)

    async def list_keys(request: web.Request) -> web.Response:
        return json_response(
            {"keys": [k.to_wire() for k in sorted(store.keys.values(), key=lambda k: k.created)]}
        )

    async def delete_key(request: web.Request) -> web.Response:
        key_id = request.match_info["id"]
        request[auth.TARGET_KEY] = key_id
        if key_id not in store.keys:
            raise NotFound(f"no API key {key_id!r}")
        await gw.write(store.revoke_key, key_id)
        await gw.end_for_key(key_id)
        return web.Response(status=204)

    def node_wire(node: Node) -> dict[str, Any]:
        return registry.node_wire(node, gw.wanted_cordon(node.name))

    def known(name: str) -> Node:
        node = registry.get(name)
        if node is None:
            raise NotFound(f"no node {name!r}: see GET /v1/admin/nodes")
        return node

    async def list_nodes(request: web.Request) -> web.Response:
        return json_response(
            {"nodes": [node_wire(n) for n in sorted(registry.nodes.values(), key=lambda n: n.name)]}
        )

    async def add_node(request: web.Request) -> web.Response:
        body = bodies.json_object(await read_json_body(request))
        fields = ("name", "endpoint", "token_file", "ca_file", "cert_file", "key_file")
        bodies.only_fields(body, fields)
        definition = node_def_from(body, gw.options.node_files_dir)
        if any(d.name == definition.name for d in gw.options.file_nodes):
            raise Conflict(f"node {definition.name!r} is defined in the node file: edit the file and restart")
        if definition.name in registry.nodes:
            raise Conflict(f"a node named {definition.name!r} exists: remove it first or pick another name")
        try:
            node = connect_node(definition)
        except (OSError, ValueError) as exc:
            raise InvalidRequest(f"node {definition.name!r}: {exc}") from None
        await gw.write(store.add_node, definition)
        registry.add(node)
        await registry.poll(node)
        request[auth.TARGET_KEY] = definition.name
        return json_response(node_wire(node), status=201)

    async def remove_node(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        known(name)
        if any(d.name == name for d in gw.options.file_nodes):
            raise Conflict(
                f"node {name!r} is defined in the node file: edit the file and restart to remove it"
            )
        await gw.write(store.remove_node, name)
        await registry.remove(name)
        return web.Response(status=204)

    async def cordon(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        node = known(name)
        body = bodies.json_object(await read_json_body(request))
        bodies.only_fields(body, ("cordoned",))
        wanted = body.get("cordoned")
        if not isinstance(wanted, bool):
            raise InvalidRequest("cordoned must be true or false")
        status = await node.call("POST", "/v1/node/cordon", {"cordoned": wanted})
        node.status = status if isinstance(status, dict) else node.status
        await gw.write(store.set_node_flags, name, NodeFlags(cordoned=wanted, drained=False))
        return json_response(node_wire(node))

    async def drain(request: web.Request) -> web.Response:
        name = request.match_info["name"]
        node = known(name)
        body = bodies.json_object(await read_json_body(request))
        bodies.only_fields(body, ("terminate",))
        terminate = body.get("terminate", False)
        if not isinstance(terminate, bool):
            raise InvalidRequest("terminate must be true or false")
        if not node.healthy:
            raise Unavailable(f"node {name!r} is not answering: it cannot be drained now")
        await gw.write(store.set_node_flags, name, NodeFlags(cordoned=True, drained=True))
        try:
            status = await node.call("POST", "/v1/node/cordon", {"cordoned": True})
            listing = await gw.node_listing(node)
        except BadGateway as exc:
            raise Unavailable(f"node {name!r} is not answering: {exc.message}") from None
        node.status = status if isinstance(status, dict) else node.status
        live = [s for s in listing if s.get("state") != "terminated"]
        terminated: list[str] = []
        failed: list[dict[str, str]] = []
        if terminate:
            for s in live:
                sandbox_id = str(s.get("id"))
                try:
                    await node.call("DELETE", f"/v1/sandboxes/{sandbox_id}")
                    terminated.append(sandbox_id)
                    gw.metrics.terminated.inc()
                    gw.record_audit(
                        kind="drain",
                        type="drain.terminate",
                        target=sandbox_id,
                        node=name,
                        result="terminated",
                    )
                    rec = store.sandboxes.get(sandbox_id)
                    if rec is not None and rec.name is not None:
                        await gw.write(store.put_sandbox, replace(rec, name=None))
                except SandboxError as exc:
                    failed.append({"id": sandbox_id, "error": exc.message})
        answer: dict[str, Any] = {"node": name, "cordoned": True, "remaining": len(live) - len(terminated),
                                  "terminated": terminated}  # fmt: skip
        if failed:
            answer["failed"] = failed
        return json_response(answer)

    async def lost(request: web.Request) -> web.Response:
        found = []
        for rec in sorted(store.sandboxes.values(), key=lambda r: r.created):
            node = registry.get(rec.node)
            if node is None or not node.is_lost(registry.lost_after_secs):
                continue
            found.append({"id": rec.id, "user": rec.user, "tenant": rec.tenant or None, "node": rec.node,
                          "cpus": rec.cpus, "memory_mb": rec.memory_mb, "node_down_since": node.down_since})  # fmt: skip
        return json_response({"sandboxes": found})

    async def read_audit(request: web.Request) -> web.Response:
        if gw.audit is None:
            raise Unsupported("this gateway keeps no audit log (started with --audit-log none)")
        since = None
        if "since" in request.query:
            try:
                since = datetime.fromisoformat(request.query["since"])
            except ValueError:
                raise InvalidRequest("since must be an RFC 3339 time, e.g. 2024-05-01T12:00:00Z") from None
            if since.tzinfo is None:
                since = since.replace(tzinfo=UTC)
        limit_text = request.query.get("limit", "100")
        if not limit_text.isdigit() or not 1 <= int(limit_text) <= 1000:
            raise InvalidRequest("limit must be a whole number from 1 to 1000")
        entries, truncated = await asyncio.to_thread(gw.audit.read, since, int(limit_text))
        answer: dict[str, Any] = {"entries": entries}
        if truncated:
            answer["truncated"] = True
        return json_response(answer)

    return [
        web.post("/v1/admin/keys", create_key),
        web.get("/v1/admin/keys", list_keys),
        web.delete("/v1/admin/keys/{id}", delete_key),
        web.get("/v1/admin/nodes", list_nodes),
        web.post("/v1/admin/nodes", add_node),
        web.delete("/v1/admin/nodes/{name}", remove_node),
        web.post("/v1/admin/nodes/{name}/cordon", cordon),
        web.post("/v1/admin/nodes/{name}/drain", drain),
        web.get("/v1/admin/lost", lost),
        web.get("/v1/admin/audit", read_audit),
        web.get("/v1/admin/orgs", orgs.admin_list(gw)),
    ]


_NODE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def node_def_from(body: dict[str, Any], files_dir: Path | None) -> NodeDef:
    """A node definition from the admin API: name and endpoint checked (400), files only under
    ``--node-files-dir`` (403)."""
    name = body.get("name")
    if not isinstance(name, str) or not _NODE_NAME.match(name):
        raise InvalidRequest("node name must be 1 to 63 of a-z 0-9 and -, starting with a letter or digit")
    endpoint = body.get("endpoint")
    if not isinstance(endpoint, str):
        raise InvalidRequest("endpoint is required: https://HOST:PORT, unix:///PATH or http://127.0.0.1:PORT")
    parse_endpoint(endpoint)
    files: dict[str, str | None] = {}
    for field_name in ("token_file", "ca_file", "cert_file", "key_file"):
        value = body.get(field_name)
        if value is None:
            files[field_name] = None
            continue
        if not isinstance(value, str) or not value.startswith("/"):
            raise InvalidRequest(f"{field_name} must be an absolute path")
        resolved = Path(value).resolve()
        if files_dir is None or not resolved.is_relative_to(files_dir.resolve()):
            raise Refused(
                f"{field_name} {value!r} is outside the node files directory: nodes added through the API may name "
                "files only under the gateway's --node-files-dir"
            )
        files[field_name] = str(resolved)
    return NodeDef(
        name=name,
        endpoint=endpoint,
        token_file=files["token_file"],
        ca_file=files["ca_file"],
        cert_file=files["cert_file"],
        key_file=files["key_file"],
    )

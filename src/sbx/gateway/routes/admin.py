"""Handlers of the admin routes: API keys, nodes (add, remove, cordon, drain), sandboxes on lost nodes, the
audit log and tenant quotas (an addition: read and set while serving, as ``sandbox-gateway quotas`` does offline)."""

from __future__ import annotations

import asyncio
import re
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING

from aiohttp import web
from msgspec import UNSET

from sbx.api.codec import decode_request
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
from sbx.api.events import AuditEntries
from sbx.api.gateway import (
    DrainFailure,
    DrainRequest,
    DrainResult,
    GatewayNode,
    KeyCreateRequest,
    KeyList,
    LostList,
    LostSandbox,
    NodeAddRequest,
    NodeList,
    QuotaList,
    QuotaRequest,
    QuotaUsage,
    TenantQuota,
)
from sbx.api.node import CordonRequest
from sbx.api.sandboxes import Sandbox
from sbx.gateway import auth, keys
from sbx.gateway.nodeclient import parse_endpoint
from sbx.gateway.nodes import Node, connect_node
from sbx.gateway.persistent import is_asleep
from sbx.gateway.state import NodeDef, NodeFlags, Quota
from sbx.web.http import json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


class AdminRoutes:
    """Everything under ``/v1/admin`` but SSH keys (meta) and the organisations listing (orgs.py)."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw
        self.store = gw.store
        self.registry = gw.registry

    # -- keys ---------------------------------------------------------------------------------------

    async def create_key(self, request: web.Request) -> web.Response:
        req = decode_request(await read_json_body(request), KeyCreateRequest)
        user = keys.check_user(req.user)
        tenant = keys.check_tenant(req.tenant if req.tenant is not UNSET else None)
        scopes = keys.check_scopes(req.scopes)
        key, secret = keys.new_key(user, tenant, scopes)
        await self.gw.write(self.store.add_key, key)
        request[auth.TARGET_KEY] = key.id
        return json_response(keys.created_wire(key, secret), status=201)

    async def list_keys(self, request: web.Request) -> web.Response:
        return json_response(
            KeyList([k.wire() for k in sorted(self.store.keys.values(), key=lambda k: k.created)])
        )

    async def delete_key(self, request: web.Request) -> web.Response:
        key_id = request.match_info["id"]
        request[auth.TARGET_KEY] = key_id
        if key_id not in self.store.keys:
            raise NotFound(f"no API key {key_id!r}")
        await self.gw.write(self.store.revoke_key, key_id)
        await self.gw.access_changed()
        return web.Response(status=204)

    # -- nodes --------------------------------------------------------------------------------------

    def _wire(self, node: Node) -> GatewayNode:
        return self.registry.node_wire(node, self.gw.wanted_cordon(node.name))

    def _known(self, request: web.Request) -> Node:
        name = request.match_info["name"]
        request[auth.TARGET_KEY] = name
        node = self.registry.get(name)
        if node is None:
            raise NotFound(f"no node {name!r}: see GET /v1/admin/nodes")
        return node

    async def list_nodes(self, request: web.Request) -> web.Response:
        return json_response(
            NodeList([self._wire(n) for n in sorted(self.registry.nodes.values(), key=lambda n: n.name)])
        )

    async def add_node(self, request: web.Request) -> web.Response:
        req = decode_request(await read_json_body(request), NodeAddRequest)
        definition = node_def_from(req, self.gw.options.node_files_dir)
        if any(d.name == definition.name for d in self.gw.options.file_nodes):
            raise Conflict(f"node {definition.name!r} is defined in the node file: edit the file and restart")
        async with self.gw.reservation(self.gw.name_lock("node", definition.name)):
            if definition.name in self.registry.nodes or definition.name in self.store.nodes:
                raise Conflict(
                    f"a node named {definition.name!r} exists: remove it first or pick another name"
                )
            try:
                node = connect_node(definition)
            except (OSError, ValueError) as exc:
                raise InvalidRequest(f"node {definition.name!r}: {exc}") from None
            await self.gw.write(self.store.add_node, definition)
        self.registry.add(node)
        await self.registry.poll(node)
        request[auth.TARGET_KEY] = definition.name
        return json_response(self._wire(node), status=201)

    async def remove_node(self, request: web.Request) -> web.Response:
        name = self._known(request).name
        if any(d.name == name for d in self.gw.options.file_nodes):
            raise Conflict(
                f"node {name!r} is defined in the node file: edit the file and restart to remove it"
            )
        await self.gw.write(self.store.remove_node, name)
        await self.registry.remove(name)
        return web.Response(status=204)

    async def cordon(self, request: web.Request) -> web.Response:
        node = self._known(request)
        wanted = decode_request(await read_json_body(request), CordonRequest).cordoned
        await self.registry.set_cordon(
            node,
            wanted,
            lambda: self.gw.write(self.store.set_node_flags, node.name, NodeFlags(wanted, False)),
        )
        return json_response(self._wire(node))

    async def drain(self, request: web.Request) -> web.Response:
        node = self._known(request)
        name = node.name
        terminate = decode_request(
            await read_json_body(request), DrainRequest, empty_is_object=True
        ).terminate
        if not node.healthy:
            raise Unavailable(f"node {name!r} is not answering: it cannot be drained now")
        await self.gw.write(self.store.set_node_flags, name, NodeFlags(cordoned=True, drained=True))
        try:
            node.status = await node.client.cordon(True)
            listing = await node.client.sandboxes()
        except BadGateway as exc:
            raise Unavailable(f"node {name!r} is not answering: {exc.message}") from None
        live = [s for s in listing if s.state != "terminated"]
        terminated: list[str] = []
        failed: list[DrainFailure] = []
        if terminate:
            for s in live:
                try:
                    await node.client.delete_sandbox(s.id)
                except SandboxError as exc:
                    failed.append(DrainFailure(s.id, exc.message))
                    continue
                terminated.append(s.id)
                self.gw.record_audit(
                    kind="drain", type="drain.terminate", target=s.id, node=name, result="terminated"
                )
                rec = self.store.sandboxes.get(s.id)
                if rec is not None:
                    await self.gw.sandboxes.terminated(rec)
                else:
                    self.gw.metrics.terminated.inc()
            remaining = len(live) - len(terminated)
        else:
            suspended, asleep = await self._suspend_persistent(node, live, failed)
            remaining = len(live) - asleep
        return json_response(DrainResult(
            node=name, cordoned=True, remaining=remaining, terminated=terminated, failed=failed or UNSET,
            suspended=[] if terminate else suspended,
        ))  # fmt: skip

    async def _suspend_persistent(
        self, node: Node, live: list[Sandbox], failed: list[DrainFailure]
    ) -> tuple[list[str], int]:
        """A drain without ``terminate``: suspend ``node``'s running persistent sandboxes (audit
        ``drain.suspend`` each), which then wait on its disk instead of holding the drain up; one the node
        refuses (a process running) goes in ``failed``. Returns those suspended, and how many of ``live`` are
        asleep now (those and the ones that were)."""
        suspended: list[str] = []
        asleep = 0
        for s in live:
            if not s.persistent:
                continue
            if is_asleep(s):
                asleep += 1
                continue
            if s.state != "running":
                continue  # still starting: the next drain suspends it
            try:
                answer = await node.client.call("POST", f"/v1/sandboxes/{s.id}/suspend", Sandbox)
            except SandboxError as exc:
                failed.append(DrainFailure(s.id, exc.message))
                continue
            assert answer is not None
            suspended.append(s.id)
            asleep += 1
            self.gw.record_audit(
                kind="drain", type="drain.suspend", target=s.id, node=node.name, result="suspended"
            )
            rec = self.store.sandboxes.get(s.id)
            if rec is not None:
                await self.gw.wakes.learnt(rec, answer)
        return suspended, asleep

    async def lost(self, request: web.Request) -> web.Response:
        found = []
        for rec in sorted(self.store.sandboxes.values(), key=lambda r: r.created):
            node = self.registry.get(rec.node)
            if node is None or not node.is_lost(self.registry.lost_after_secs):
                continue
            found.append(LostSandbox(
                id=rec.id, user=rec.user, tenant=rec.tenant or None, node=rec.node, cpus=rec.cpus,
                memory_mb=rec.memory_mb, node_down_since=node.down_since,
            ))  # fmt: skip
        return json_response(LostList(found))

    async def read_audit(self, request: web.Request) -> web.Response:
        audit = self.gw.audit
        if audit is None:
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
        entries, truncated = await asyncio.to_thread(audit.read, since, int(limit_text))
        return json_response(AuditEntries(entries, True if truncated else UNSET))

    # -- quotas -------------------------------------------------------------------------------------

    def _quota_wire(self, tenant: str) -> TenantQuota:
        quota = self.store.quotas.get(tenant, Quota())
        sandboxes, cpus, memory_mb = self.gw.tenant_usage(tenant)
        return TenantQuota(
            tenant=tenant or "default", cpus=quota.max_cpus, memory_mb=quota.max_memory_mb,
            sandboxes=quota.max_sandboxes, used=QuotaUsage(sandboxes, cpus, memory_mb),
        )  # fmt: skip

    async def list_quotas(self, request: web.Request) -> web.Response:
        tenants = set(self.store.quotas) | {r.tenant for r in list(self.store.sandboxes.values())}
        return json_response(QuotaList([self._quota_wire(t) for t in sorted(tenants)]))

    async def set_quota(self, request: web.Request) -> web.Response:
        tenant = keys.check_tenant(request.match_info["tenant"])
        request[auth.TARGET_KEY] = tenant or "default"
        req = decode_request(await read_json_body(request), QuotaRequest, empty_is_object=True)
        for name in ("cpus", "memory_mb", "sandboxes"):
            value = getattr(req, name)
            if value is not None and not 0 <= value <= MAX_QUOTA_AMOUNT:
                raise InvalidRequest(f"{name} must be 0 to {MAX_QUOTA_AMOUNT} (null: no limit), not {value}")
        await self.gw.write(self.store.set_quota, tenant, Quota(req.cpus, req.memory_mb, req.sandboxes))
        return json_response(self._quota_wire(tenant))


#: Largest amount a quota may name (CPUs, MiB or sandboxes): far past any fleet, well inside SQLite's integers.
MAX_QUOTA_AMOUNT = 1_000_000_000

_NODE_NAME = re.compile(r"^[a-z0-9][a-z0-9-]{0,62}$")


def node_def_from(req: NodeAddRequest, files_dir: Path | None) -> NodeDef:
    """A node definition from the admin API or the node file: name and endpoint checked (400), files only
    under ``files_dir`` (403; None: no file may be named)."""
    name = req.name
    if not _NODE_NAME.match(name):
        raise InvalidRequest("node name must be 1 to 63 of a-z 0-9 and -, starting with a letter or digit")
    endpoint = req.endpoint
    parse_endpoint(endpoint)
    files: dict[str, str | None] = {}
    for field_name in ("token_file", "ca_file", "cert_file", "key_file"):
        value = getattr(req, field_name)
        if value is None or value is UNSET:
            files[field_name] = None
            continue
        if not value.startswith("/"):
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

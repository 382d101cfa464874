"""Admin routes: API keys, nodes (add, remove, cordon, drain), sandboxes on lost nodes, the audit log, and the
organisations listing (from orgs.py)."""

from __future__ import annotations

import asyncio
import re
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

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
from sbx.gateway.nodes import Node, connect_node, parse_endpoint
from sbx.gateway.state import NodeDef, NodeFlags
from sbx.node.http import json_response, read_json_body

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway


def routes(gw: Gateway) -> list[web.RouteDef]:
    """Everything under ``/v1/admin`` but SSH keys (meta) and the orgs listing's handler (orgs.py)."""
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

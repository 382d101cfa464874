"""Calls that span nodes: a listing merged from every answering node, and a create tried on the nodes placement
picks in turn."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from aiohttp import web

from sbx.api.errors import Unavailable
from sbx.gateway.nodes import Node
from sbx.gateway.placement import Resources, choose_node
from sbx.node.http import json_response

if TYPE_CHECKING:
    from sbx.gateway.server import Gateway

log = logging.getLogger(__name__)


async def list_owned(
    gw: Gateway, path: str, key: str, owner: Callable[[dict[str, Any], str], bool]
) -> web.Response:
    """``GET path`` on every answering node, keeping the ``key`` items ``owner(item, node_name)`` accepts; a node
    failing now is left out."""
    nodes = gw.registry.healthy()
    results = await asyncio.gather(*(n.call("GET", path) for n in nodes), return_exceptions=True)
    merged: list[dict[str, Any]] = []
    for node, result in zip(nodes, results, strict=True):
        if isinstance(result, dict):
            merged += [x for x in result.get(key) or [] if isinstance(x, dict) and owner(x, node.name)]
    return json_response({key: merged})


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

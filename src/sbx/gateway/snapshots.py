"""Snapshots through the gateway: who owns one, where it is, listing and deleting.

A snapshot taken through the gateway is recorded as its taker's; a scheduled one (taken by a node on its own)
belongs to whoever owns its sandbox (spec: Schedule rule 5), and is found in the answering nodes' listings.
"""

from __future__ import annotations

import asyncio

from sbx.api.errors import NotFound, SandboxError
from sbx.api.snapshots import Snapshot
from sbx.gateway.auth import Principal
from sbx.gateway.interfaces import NodeLookup, Writes
from sbx.gateway.nodes import Registry
from sbx.gateway.state import SnapshotRecord, now_rfc3339
from sbx.gateway.store.base import Store


class Snapshots:
    """The caller's snapshots on every answering node."""

    def __init__(self, store: Store, writes: Writes, registry: Registry, *, nodes: NodeLookup) -> None:
        """``store``: the snapshot and sandbox records (whose a snapshot is), written through ``writes``;
        ``registry``: the nodes listed; ``nodes``: the 503 naming a recorded snapshot's node when it is down."""
        self.store = store
        self.writes = writes
        self.registry = registry
        self.nodes = nodes

    def owns(self, principal: Principal, snap: Snapshot, node: str) -> bool:
        """A snapshot is the caller's when recorded as theirs, or (scheduled ones) when its sandbox is theirs."""
        rec = self.store.snapshots.get(snap.id)
        if rec is not None:
            return rec.node == node and principal.owns(rec.user, rec.tenant)
        sandbox = self.store.sandboxes.get(snap.sandbox)
        return sandbox is not None and sandbox.node == node and principal.owns(sandbox.user, sandbox.tenant)

    async def list(self, principal: Principal) -> list[Snapshot]:
        """The caller's snapshots on every answering node (a node failing now is left out)."""
        nodes = self.registry.healthy()
        results = await asyncio.gather(*(n.client.snapshots() for n in nodes), return_exceptions=True)
        found: list[Snapshot] = []
        for node, result in zip(nodes, results, strict=True):
            if not isinstance(result, BaseException):
                found += [s for s in result if self.owns(principal, s, node.name)]
        return found

    async def where(self, principal: Principal, snapshot_id: str) -> str:
        """The node holding the caller's snapshot (a recorded one without asking any node); 404 otherwise."""
        rec = self.store.snapshots.get(snapshot_id)
        if rec is not None:
            if principal.owns(rec.user, rec.tenant):
                return rec.node
            raise NotFound(f"no snapshot {snapshot_id!r} among yours")
        return (await self.find(principal, snapshot_id))[0]

    async def find(self, principal: Principal, snapshot_id: str) -> tuple[str, Snapshot]:
        """The node holding the caller's snapshot ``snapshot_id`` and the snapshot; 404 when it is not theirs
        or does not exist."""
        rec = self.store.snapshots.get(snapshot_id)
        if rec is not None and not principal.owns(rec.user, rec.tenant):
            raise NotFound(f"no snapshot {snapshot_id!r} among yours")
        nodes = [self.registry.get(rec.node)] if rec is not None else self.registry.healthy()
        for node in nodes:
            if node is None:
                continue
            try:
                listing = await node.client.snapshots()
            except SandboxError:
                continue
            for snap in listing:
                if snap.id == snapshot_id and self.owns(principal, snap, node.name):
                    return node.name, snap
        if rec is not None:
            self.nodes.node_for(rec.node, f"snapshot {snapshot_id}")  # 503 when its node is down
        raise NotFound(f"no snapshot {snapshot_id!r} among yours")

    async def taken(
        self, principal_user: str, tenant: str, node: str, sandbox_id: str, snap: Snapshot
    ) -> None:
        """Record a snapshot taken through the gateway as its sandbox owner's."""
        await self.writes.write(
            self.store.put_snapshot,
            SnapshotRecord(snap.id, principal_user, tenant, node, sandbox_id, now_rfc3339()),
        )

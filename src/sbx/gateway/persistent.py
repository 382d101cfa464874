"""Persistent sandboxes through the gateway (capability ``persistent``, issue 32): what the records learn of them,
and the quota check before a request wakes one.

A persistent sandbox sleeps (suspended at its idle timeout or by ``POST .../suspend``, stopped by ``POST
.../stop``) and its node wakes it for the next request that needs its guest. Asleep, its node holds only its disk,
so its tenant's quota counts it as a sandbox but not its cpus and memory (``Gateway.tenant_usage``): the record's
``asleep`` says which, as the gateway last learnt it — from an answer of the sandbox's node that passed through
it (create, GET, suspend, resume, stop, a drain) and from every reconcile of the node's listing (each minute).

A record that says awake while the node has put the sandbox to sleep (an idle timeout since the last reconcile)
over-counts, which only refuses early; so a request is checked only when the record says asleep, and a record
is turned asleep only under the tenant's quota lock, after asking the node again (:meth:`Wakes.learnt`). Then, before
the request is passed on, :meth:`Wakes.wake` asks the node for the state (the record may be late the other way:
woken by an SSH login), checks the tenant's quota for the cpus and memory it will take again, and wakes it with
``POST .../resume`` itself, all under the tenant's quota lock, as a create holds it: two wakes, or a wake and a
create, never pass one check together. Over the quota is 403 ``refused`` naming what is short, and the node is
asked nothing that changes it.

What is not closed: a request passed on while the record said awake wakes the sandbox at its node unchecked
(counted all along, so within the quota); if a sleep's record write races it, the record says asleep for a
running sandbox until the next wake through the gateway or the next reconcile (a minute at most).
"""

from __future__ import annotations

import dataclasses
from typing import Final

from sbx.api.errors import Conflict
from sbx.api.sandboxes import Sandbox
from sbx.gateway.interfaces import NodeLookup, Reservations, WakeProblem, Writes
from sbx.gateway.quotas import OverQuota
from sbx.gateway.state import SandboxRecord
from sbx.gateway.store.base import Store

#: States of a persistent sandbox asleep: its node holds its disk, not its cpus and memory.
ASLEEP_STATES: Final = frozenset({"suspended", "stopped"})

#: The relayed routes that need the guest, so wake a persistent sandbox asleep (docs/node-api.md, "Persistent
#: sandboxes"); GET of the sandbox, its processes, events and metrics never do. PATCH wakes it only to change its
#: network (``routes/sandboxes.py``), resume always (its own handler).
WAKING_ROUTES: Final = frozenset({
    ("POST", "/v1/sandboxes/{ref}/run"),
    ("POST", "/v1/sandboxes/{ref}/processes"),
    ("POST", "/v1/sandboxes/{ref}/processes/{pid}/stdin"),
    ("POST", "/v1/sandboxes/{ref}/processes/{pid}/signal"),
    ("GET", "/v1/sandboxes/{ref}/processes/{pid}/attach"),
    ("GET", "/v1/sandboxes/{ref}/processes/{pid}/attach/websocket"),
    ("GET", "/v1/sandboxes/{ref}/tunnel"),
    ("GET", "/v1/sandboxes/{ref}/files"),
    ("PUT", "/v1/sandboxes/{ref}/files"),
    ("DELETE", "/v1/sandboxes/{ref}/files"),
    ("GET", "/v1/sandboxes/{ref}/dirs"),
    ("POST", "/v1/sandboxes/{ref}/snapshots"),
    ("PUT", "/v1/sandboxes/{ref}/snapshot-schedule"),
})  # fmt: skip


def is_asleep(wire: Sandbox) -> bool:
    """Whether the node's answer shows a persistent sandbox asleep (suspended or stopped)."""
    return wire.persistent and wire.state in ASLEEP_STATES


class Wakes:
    """Keeps the records' ``persistent`` and ``asleep`` in step with the nodes, and checks wakes against quotas."""

    def __init__(
        self,
        store: Store,
        writes: Writes,
        *,
        nodes: NodeLookup,
        locks: Reservations,
        wake_problem: WakeProblem,
    ) -> None:
        """``store``: the sandbox records and quotas, written through ``writes``; ``nodes``: a record's node;
        ``locks``: the tenant's quota lock; ``wake_problem``: the quota check of a wake."""
        self.store = store
        self.writes = writes
        self.nodes = nodes
        self.locks = locks
        self.wake_problem = wake_problem

    async def learnt(self, rec: SandboxRecord, wire: Sandbox) -> SandboxRecord:
        """What an answer of ``rec``'s node (``wire``, a listing's entry or a call's answer) teaches its record.

        Awake is taken as it comes (counting a sleeping sandbox's cpus only refuses early). Asleep is asked again
        under the tenant's quota lock before it is written: a wake may have passed since ``wire`` was answered,
        and a record asleep for a running sandbox would let the tenant past its quota."""
        if rec.asleep or not is_asleep(wire):
            return await self.observed(rec, wire)
        quota = self.store.quotas.get(rec.tenant) is not None
        async with self.locks.reservation(*([("tenant", rec.tenant)] if quota else [])):
            current = self.store.sandboxes.get(rec.id)
            if current is None:
                return rec  # forgotten meanwhile
            node = self.nodes.node_for(current.node, f"sandbox {current.id}")
            return await self.observed(current, await node.client.sandbox(current.id))

    async def observed(self, rec: SandboxRecord, wire: Sandbox) -> SandboxRecord:
        """``rec`` as its node's answer ``wire`` shows it now: written when its persistence or sleep changed (the
        common answer changes nothing, and writes nothing). A change to asleep is written only under the tenant's
        quota lock, by the caller (``learnt``, ``wake``)."""
        if wire.id != rec.id or wire.state == "terminated":
            return rec
        now = dataclasses.replace(rec, persistent=wire.persistent, asleep=is_asleep(wire))
        if now != rec:
            await self.writes.write(self.store.put_sandbox, now)
        return now

    async def wake(self, rec: SandboxRecord) -> Sandbox | None:
        """Before a request that needs the guest of ``rec``'s sandbox: when its record says it is asleep, wake it
        here (see the module), or refuse with 403 when its tenant's quota has no room for its cpus and memory.
        Returns the node's answer to the wake (None when there was nothing to wake); a node's refusal (503: no room
        there) is raised as the node sent it, with nothing changed."""
        woken = await self.wake_from(rec)
        return woken[1] if woken is not None else None

    async def wake_from(self, rec: SandboxRecord) -> tuple[str, Sandbox] | None:
        """:meth:`wake`, also saying what it woke the sandbox from (``suspended``: its processes run on;
        ``stopped``: booted from its disk, no process of before runs)."""
        if not rec.asleep:
            return None
        quota = self.store.quotas.get(rec.tenant) is not None
        async with self.locks.reservation(*([("tenant", rec.tenant)] if quota else [])):
            current = self.store.sandboxes.get(rec.id, rec)  # another wake may have come first
            if not current.asleep:
                return None
            node = self.nodes.node_for(current.node, f"sandbox {current.id}")
            state = await node.client.sandbox(current.id)
            current = await self.observed(current, state)
            if not current.asleep:
                return None  # woken meanwhile another way (an SSH login): it is counted again already
            problem = self.wake_problem(current.tenant, current.id, current.cpus, current.memory_mb)
            if problem is not None:
                raise OverQuota(problem)
            try:
                woke = await node.client.call("POST", f"/v1/sandboxes/{current.id}/resume", Sandbox)
            except Conflict:
                # Running already (woken by another replica, or by a request the node took meanwhile).
                woke = await node.client.sandbox(current.id)
            assert woke is not None
            await self.observed(current, woke)
            return state.state, woke

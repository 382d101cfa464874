"""The gateway's sandboxes as a service: create, get, list and delete for a principal, with a typed spec.

The HTTP routes call it, and so will what the gateway runs by itself (services' replicas, jobs' runs, SSH):
every sandbox the gateway makes goes through :meth:`Sandboxes.create`, with the owner's labels, names, quota
and placement.

Create (spec: On create through a gateway):

1. the request is checked as a node would (shape, names, labels, env, mounts) and by the gateway's own rules
   (no ``gateway.*`` label, at most 30 labels), before anything is looked up;
2. a fork goes to the node holding its snapshot, a sandbox with volumes to the node holding them (409 when
   they are on two); their owner must be the caller;
3. under the owner's lock a name must be free among their live sandboxes (409), and under the tenant's lock
   the quota must hold for what the node will really give: the request's resources, else the snapshot's (a
   fork), else the node's own defaults as it reports them (403);
4. placement picks a node, among those offering what the request needs (``secret_env``, ``persistent``: 503
   naming the capability when none answering does); one refusing for capacity (503) or not answering (502) is
   skipped; the node gets the request with the resources made explicit, so what was counted is exactly what it
   gives; any other refusal is the caller's, as the node sent it.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections.abc import Awaitable, Callable, Collection, Iterable, Mapping

from msgspec import UNSET
from msgspec.structs import replace

from sbx.api.errors import Conflict, InvalidRequest, NotFound, Refused, SandboxError, Unavailable
from sbx.api.node import PERSISTENT, SECRET_ENV, Resources
from sbx.api.requests import check_create
from sbx.api.sandboxes import CreateRequest, Sandbox
from sbx.api.snapshots import Snapshot
from sbx.gateway.auth import Principal
from sbx.gateway.interfaces import (
    MONOTONIC,
    Clock,
    Freshness,
    LostNodes,
    NodeLookup,
    Placement,
    QuotaProblem,
    RecordFrom,
    Reservations,
    SandboxMetrics,
    SnapshotFinder,
    Writes,
)
from sbx.gateway.labels import OWNER_LABEL, TENANT_LABEL, check_client_labels
from sbx.gateway.nodes import Node, Registry
from sbx.gateway.placement import Candidate, Requested, choose_node
from sbx.gateway.quotas import OverQuota
from sbx.gateway.state import SandboxRecord
from sbx.gateway.store.base import Store

log = logging.getLogger(__name__)


class Sandboxes:
    """Sandboxes through the gateway, owned by the principal that made them."""

    def __init__(
        self,
        store: Store,
        writes: Writes,
        registry: Registry,
        *,
        nodes: NodeLookup,
        lost: LostNodes,
        fresh: Freshness,
        locks: Reservations,
        snapshots: SnapshotFinder,
        quota_problem: QuotaProblem,
        record_from: RecordFrom,
        metrics: SandboxMetrics,
        placement: Placement = choose_node,
        clock: Clock = MONOTONIC,
    ) -> None:
        """``store``: the records (sandboxes, volumes, quotas), written through ``writes``; ``registry``: the nodes
        placement chooses among and lists from; ``nodes``, ``lost``: a record's node, and whether one is lost;
        ``fresh``: look-ups that catch up with other replicas before a miss; ``locks``: the name and quota locks a
        create holds; ``snapshots``: where a fork's snapshot is; ``quota_problem``: the quota check; ``record_from``:
        a made sandbox's record; ``placement``: which node to try next; ``clock``: the create latency's."""
        self.store = store
        self.writes = writes
        self.registry = registry
        self.nodes = nodes
        self.lost = lost
        self.fresh = fresh
        self.locks = locks
        self.snapshots = snapshots
        self.quota_problem = quota_problem
        self.record_from = record_from
        self.metrics = metrics
        self.placement = placement
        self.clock = clock
        #: Told the id of each sandbox terminated through the gateway (the exposed ports forget its own).
        self.on_terminated: list[Callable[[str], Awaitable[None]]] = []

    # -- lookups -------------------------------------------------------------------------------------

    def resolve(self, principal: Principal, ref: str) -> SandboxRecord:
        """The caller's sandbox named by id or name; 404 for one not theirs or absent either way.

        The node is then asked by id, never by name: one node may hold sandboxes of several users under one
        name. A name matching more than one (an admin's look-up among every user's, or a user's own sandbox
        on a lost node and its namesake made meanwhile) is 409 naming the ids, never one picked silently."""
        store = self.store
        rec = store.sandboxes.get(ref)
        if rec is not None and principal.owns(rec.user, rec.tenant):
            return rec
        mine = [
            r for r in list(store.sandboxes.values())
            if r.name == ref and r.user == principal.user and r.tenant == principal.tenant
        ]  # fmt: skip
        if not mine and principal.admin:
            mine = [r for r in list(store.sandboxes.values()) if r.name == ref]
        if len(mine) > 1:
            ids = ", ".join(sorted(r.id for r in mine))
            raise Conflict(f"the name {ref!r} matches {len(mine)} live sandboxes ({ids}); use the id")
        if mine:
            return mine[0]
        raise NotFound(f"no sandbox {ref!r} among yours")

    async def find(self, principal: Principal, ref: str) -> SandboxRecord:
        """As :meth:`resolve`; a miss on a store shared with other replicas first waits for the changes
        committed before it (a sandbox just created through another replica), then looks again."""
        return await self.fresh.fresh(lambda: self.resolve(principal, ref))

    def name_taken(self, principal: Principal, name: str, except_id: str | None = None) -> bool:
        """Whether ``name`` is held by another live sandbox of the caller (on any node but a lost one)."""
        return any(
            r.name == name and r.user == principal.user and r.tenant == principal.tenant and r.id != except_id
            and not self.lost.is_lost_node(r.node)
            for r in list(self.store.sandboxes.values())
        )  # fmt: skip

    async def get(self, principal: Principal, ref: str) -> Sandbox:
        """The caller's sandbox as its node answers it now."""
        rec = await self.find(principal, ref)
        node = self.nodes.node_for(rec.node, f"sandbox {rec.id}")
        answer = await node.client.call("GET", f"/v1/sandboxes/{rec.id}", Sandbox)
        assert answer is not None
        return answer

    async def list(self, principal: Principal, labels: Iterable[tuple[str, str]] = ()) -> list[Sandbox]:
        """The caller's sandboxes (admin: every one, with those the gateway has no record of) on every
        answering node, newest first; a node failing now is left out, as an unhealthy one is. A malformed label
        filter is 400, as every node would say."""
        nodes = self.registry.healthy()
        wanted = list(labels)
        results = await asyncio.gather(*(n.client.sandboxes(wanted) for n in nodes), return_exceptions=True)
        listed: list[tuple[Node, Sandbox]] = []
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, InvalidRequest):
                raise result
            if isinstance(result, BaseException):
                continue
            listed += [(node, sandbox) for sandbox in result]
        # A sandbox made through another replica a moment ago (our labels, no record here yet): wait for what
        # was committed before the listing, then sort them.
        if any(
            OWNER_LABEL in s.labels and s.state != "terminated" and s.id not in self.store.sandboxes
            for _, s in listed
        ):
            await self.fresh.caught_up()
        merged: list[Sandbox] = []
        for node, sandbox in listed:
            rec = self.store.sandboxes.get(sandbox.id)
            mine = rec is not None and rec.node == node.name and principal.owns(rec.user, rec.tenant)
            if mine or (rec is None and principal.admin):
                merged.append(sandbox)
        merged.sort(key=lambda s: s.created_at, reverse=True)
        return merged

    async def delete(self, principal: Principal, ref: str) -> None:
        """Terminate the caller's sandbox (idempotent); its name is free again at once."""
        rec = await self.find(principal, ref)
        node = self.nodes.node_for(rec.node, f"sandbox {rec.id}")
        await node.client.delete_sandbox(rec.id)
        await self.terminated(rec)

    async def terminated(self, rec: SandboxRecord) -> None:
        """The node terminated ``rec``'s sandbox for us: count it, free its name. The record stays until the
        node forgets the sandbox."""
        self.metrics.terminated.inc()
        if rec.name is not None:
            await self.writes.write(self.store.put_sandbox, dataclasses.replace(rec, name=None))
        for told in list(self.on_terminated):
            try:
                await told(rec.id)
            except Exception:  # the sandbox is gone all the same; the 30 s sweep forgets what this could not
                log.exception("a follow-up of a termination failed", extra={"sandbox": rec.id})

    async def end_orphan(self, node: Node, sandbox_id: str, why: str) -> None:
        """Terminate a sandbox the gateway made for a workload (a service replica, a job run) that nothing owns
        any more; ``why`` goes in the log. Best effort: a node error leaves it to the caller's next sweep."""
        log.info(why, extra={"node": node.name, "sandbox": sandbox_id})
        with contextlib.suppress(SandboxError):
            await node.client.delete_sandbox(sandbox_id)
            record = self.store.sandboxes.get(sandbox_id)
            if record is not None:
                await self.terminated(record)

    # -- create ------------------------------------------------------------------------------------------

    async def create(
        self,
        principal: Principal,
        req: CreateRequest,
        *,
        gateway_labels: Mapping[str, str] | None = None,
        avoid: Collection[str] = (),
    ) -> tuple[Sandbox, str]:
        """Make a sandbox for ``principal`` (see the module's steps); returns it and its node's name.

        For what the gateway makes by itself (a service's replica, a job's run): ``gateway_labels`` are stamped
        besides the owner's (every key begins ``gateway.``; a client can never set one), and placement prefers
        nodes not in ``avoid`` while one of them can take the sandbox (a service's spread)."""
        started = self.clock()
        labels = req.labels if req.labels is not UNSET else {}
        check_client_labels(labels)
        check_create(req)
        ours = dict(gateway_labels or {})
        assert all(k.startswith("gateway.") and k not in (OWNER_LABEL, TENANT_LABEL) for k in ours), ours
        stamped = {**labels, **ours, OWNER_LABEL: principal.user}
        if principal.tenant:
            stamped[TENANT_LABEL] = principal.tenant
        req = replace(req, labels=stamped)
        pinned, snapshot = await self._pinned(principal, req)
        requested = _requested(req, snapshot)
        name = req.name or None
        quota = self.store.quotas.get(principal.tenant) is not None
        # The owner's name check and a tenant's quota check run one at a time with the node call they allow
        # (with replicas, across all of them, then caught up: checked against every record any replica made).
        names = [self.locks.name_lock("sandbox", principal.user, principal.tenant)] if name else []
        names += [("tenant", principal.tenant)] if quota else []
        async with self.locks.reservation(*names):
            if name is not None and self.name_taken(principal, name):
                raise Conflict(
                    f"you already have a live sandbox named {name!r}: pick another name or delete it"
                )
            sandbox, node, given = await self._place(principal, req, requested, pinned, frozenset(avoid))
            await self.writes.write(
                self.store.put_sandbox, self.record_from(sandbox, node.name, principal.user, principal.tenant)
            )
        node.took(given)
        self.metrics.created.inc()
        self.metrics.create_seconds.observe(self.clock() - started)
        return sandbox, node.name

    async def _place(
        self, principal: Principal, req: CreateRequest, requested: Requested, pinned: str | None,
        avoid: frozenset[str] = frozenset(),
    ) -> tuple[Sandbox, Node, Resources]:  # fmt: skip
        needs = _capabilities_needed(req)
        tried: set[str] = set()
        over_quota: Refused | None = None
        lacking: set[str] = set()
        refusals: list[str] = []  # each tried node's own 502/503 message, for the caller's answer
        while True:
            candidates = self.registry.candidates()
            if pinned is not None:
                candidates = [c for c in candidates if c.name == pinned]
            if needs:
                # Only a node offering what the request needs gets it: one keeping secret environment off its
                # disk (an older one would write it into its sandbox record), one that lets a persistent sandbox
                # sleep (an older one would refuse the field, or terminate it at its idle timeout).
                lacking = {
                    c.name
                    for c in candidates
                    if c.taking_new and not all(self.registry.nodes[c.name].offers(n) for n in needs)
                }
                candidates = [c for c in candidates if c.name not in lacking]
            # Nodes to avoid are asked only once every other node has been.
            choice = self.placement(candidates, tried | avoid, requested) or self.placement(
                candidates, tried, requested
            )
            if choice is None:
                break
            tried.add(choice.name)
            given = requested.on(choice)
            problem = self.quota_problem(principal.tenant, 1, given.cpus, given.memory_mb)
            if problem is not None:
                over_quota = OverQuota(problem)
                continue
            node = self.registry.nodes[choice.name]
            self.metrics.scheduled.labels(node.name).inc()
            try:
                sandbox = await node.client.create_sandbox(_explicit(req, requested, given, choice))
            except SandboxError as exc:
                if exc.status in (502, 503):
                    refusals.append(f"{choice.name}: {exc.message}")
                    continue  # no room there, or no answer: the next node
                raise  # the caller's own refusal, as the node sent it

            # What the node really gave (it decides what the gateway could not know) is what counts.
            return sandbox, node, Resources(sandbox.cpus, sandbox.memory_mb, sandbox.disk_mb)
        if over_quota is not None:
            self.metrics.refused.labels("quota").inc()
            raise over_quota
        self.metrics.refused.labels("capacity").inc()
        if lacking and not tried:
            raise Unavailable(_lacking_message(needs, sorted(lacking)))
        where = f"node {pinned}" if pinned else "any node"
        said = f"; {'; '.join(refusals)}" if refusals else ""
        raise Unavailable(f"no node can take this now ({where}: none answering with free capacity and not cordoned"
                          f"{said}); try again later or ask for fewer resources")  # fmt: skip

    async def _pinned(self, principal: Principal, req: CreateRequest) -> tuple[str | None, Snapshot | None]:
        """The node a create must go to (the one holding its snapshot or volumes; 409 when they are on two),
        and the snapshot a fork starts from."""
        nodes: set[str] = set()
        snapshot = None
        if req.snapshot_id is not UNSET:
            node_name, snapshot = await self.snapshots.find(principal, req.snapshot_id)
            nodes.add(node_name)
        for mount in req.volumes or ():
            vol = self.store.volumes.get(mount.name)
            if vol is None or not principal.owns(vol.user, vol.tenant):
                raise NotFound(f"no volume {mount.name!r} among yours")
            nodes.add(vol.node)
        if len(nodes) > 1:
            raise Conflict(f"the volumes and snapshot named are on different nodes ({', '.join(sorted(nodes))}): "
                           "a sandbox can use only what one node holds")  # fmt: skip
        return (nodes.pop() if nodes else None), snapshot


def _capabilities_needed(req: CreateRequest) -> tuple[str, ...]:
    """The capability flags a node must offer to take ``req`` (additions the request uses)."""
    needs = []
    if req.secret_env:
        needs.append(SECRET_ENV)
    if req.persistent is True:
        needs.append(PERSISTENT)
    return tuple(needs)


def _lacking_message(needs: tuple[str, ...], lacking: list[str]) -> str:
    """The 503's message when every node answering lacks a capability in ``needs``."""
    nodes = ", ".join(lacking)
    if needs == (SECRET_ENV,):
        return (f"no node can take secret environment now: {nodes} cannot keep it off their disk (capability "
                f"{SECRET_ENV}); upgrade sandboxd there")  # fmt: skip
    if needs == (PERSISTENT,):
        return (f"no node can take a persistent sandbox now: {nodes} lack the capability {PERSISTENT}; upgrade "
                "sandboxd there, or create it without persistent")  # fmt: skip
    return (f"no node can take this now: {nodes} lack one of the capabilities {', '.join(needs)} it needs; "
            "upgrade sandboxd there")  # fmt: skip


def _requested(req: CreateRequest, snapshot: Snapshot | None) -> Requested:
    """What the create asks for; a fork defaults to the resources of the sandbox its snapshot was taken from."""

    def pick(given: int | object, original: int | object) -> int | None:
        if isinstance(given, int):
            return given
        return original if isinstance(original, int) else None

    return Requested(
        pick(req.cpus, snapshot.cpus if snapshot else UNSET),
        pick(req.memory_mb, snapshot.memory_mb if snapshot else UNSET),
        pick(req.disk_mb, snapshot.disk_mb if snapshot else UNSET),
    )


def _explicit(req: CreateRequest, requested: Requested, given: Resources, node: Candidate) -> CreateRequest:
    """The request as the node gets it: every amount the gateway counted made explicit, so the node gives
    exactly that. An amount it could not know (neither asked for, a snapshot's, nor reported by the node as
    its default) stays the node's to choose."""
    known = node.defaults is not None
    return replace(
        req,
        cpus=given.cpus if requested.cpus is not None or known else UNSET,
        memory_mb=given.memory_mb if requested.memory_mb is not None or known else UNSET,
        disk_mb=given.disk_mb if requested.disk_mb is not None or known else UNSET,
    )

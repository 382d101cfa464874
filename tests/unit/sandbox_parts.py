"""The sandbox, snapshot and wake services built from stand-ins of the interfaces they are given (issue 34,
docs/architecture.md), with no gateway and no aiohttp application: a real SQLite store, a node registry whose nodes
answer from stand-in clients, and stand-ins of the rest that record what they were asked.

``parts(store, [stand_in("a"), ...])`` builds them in ``server.py``'s order (the snapshots first: the sandbox
service finds a fork's snapshot through them)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
import stand_ins
from stand_ins import Writes
from wire_samples import capabilities_body, sandbox

from sbx.api.codec import convert_answer
from sbx.api.errors import NotFound, SandboxError, Unavailable
from sbx.api.node import Capabilities, Defaults, NodeStatus, Resources
from sbx.api.sandboxes import CreateRequest, Sandbox
from sbx.api.snapshots import Snapshot
from sbx.gateway.metrics import GatewayMetrics, GatewaySnapshot
from sbx.gateway.nodes import Node, Registry
from sbx.gateway.persistent import Wakes, is_asleep
from sbx.gateway.placement import Candidate, Requested, choose_node
from sbx.gateway.sandboxes import Sandboxes
from sbx.gateway.snapshots import Snapshots
from sbx.gateway.state import NodeDef, SandboxRecord
from sbx.gateway.store.base import Store

T = TypeVar("T")
T0 = "2026-01-01T00:00:00Z"


@dataclass
class NodeClientStandIn:
    """The node client calls the three services make. ``refusals`` are raised by the next creates in turn (None:
    made); ``held`` and ``snapshots_held`` are what the node holds; ``calls`` what it was asked, in order."""

    name: str
    refusals: list[SandboxError | None] = field(default_factory=list)
    held: dict[str, Sandbox] = field(default_factory=dict)
    snapshots_held: list[Snapshot] = field(default_factory=list)
    calls: list[tuple[str, str]] = field(default_factory=list)
    created: list[CreateRequest] = field(default_factory=list)

    async def create_sandbox(self, request: CreateRequest) -> Sandbox:
        self.calls.append(("POST", "/v1/sandboxes"))
        refusal = self.refusals.pop(0) if self.refusals else None
        if refusal is not None:
            raise refusal
        self.created.append(request)
        sid = f"sbx_{self.name}_{len(self.created)}"
        made = sandbox(
            id=sid, name=request.name or None, cpus=request.cpus or 1, memory_mb=request.memory_mb or 512,
            disk_mb=request.disk_mb or 1024, labels=request.labels or {}, created_at=T0,
            persistent=request.persistent is True,
        )  # fmt: skip
        self.held[sid] = made
        return made

    async def sandboxes(self, labels: Iterable[tuple[str, str]] = ()) -> list[Sandbox]:
        self.calls.append(("GET", "/v1/sandboxes"))
        return list(self.held.values())

    async def sandbox(self, sandbox_id: str) -> Sandbox:
        self.calls.append(("GET", f"/v1/sandboxes/{sandbox_id}"))
        return self.held[sandbox_id]

    async def call(self, method: str, path: str, answer: type[T] | None, body: object = None) -> Any:
        self.calls.append((method, path))
        sandbox_id = path.split("/")[3]
        if method == "POST" and path.endswith("/resume"):
            self.held[sandbox_id] = msgspec.structs.replace(self.held[sandbox_id], state="running")
        return self.held[sandbox_id]

    async def delete_sandbox(self, sandbox_id: str) -> None:
        self.calls.append(("DELETE", f"/v1/sandboxes/{sandbox_id}"))
        self.held.pop(sandbox_id, None)

    async def snapshots(self) -> list[Snapshot]:
        self.calls.append(("GET", "/v1/snapshots"))
        return list(self.snapshots_held)


def stand_in(
    name: str, *, free_cpus: int = 8, free_memory_mb: int = 8192, healthy: bool = True, cordoned: bool = False,
    offers: Collection[str] = (), refusals: Sequence[SandboxError | None] = (),
) -> Node:  # fmt: skip
    """A registry's node of ``name`` answering from a :class:`NodeClientStandIn` (``node.client``), with a status
    as its last poll saw it: 8 cpus and 8 GiB of capacity, defaults of 1 cpu, 512 MiB and 1 GiB of disk."""
    client: Any = NodeClientStandIn(name, refusals=list(refusals))  # as a NodeClient
    flags = {flag: True for flag in offers}
    status = NodeStatus(
        name=name, version="test",
        capabilities=convert_answer(capabilities_body(**flags), Capabilities, "Capabilities"),
        capacity=Resources(8, 8192, 100_000), free=Resources(free_cpus, free_memory_mb, 50_000), running=0,
        pooled={}, images=["default"], labels={}, cordoned=cordoned,
        defaults=Defaults(cpus=1, memory_mb=512, disk_mb=1024),
    )  # fmt: skip
    return Node(
        NodeDef(name, "http://127.0.0.1:1"), client, healthy=healthy, answered_once=True, status=status
    )


def client_of(node: Node) -> NodeClientStandIn:
    client = node.client
    assert isinstance(client, NodeClientStandIn)
    return client


class Locks(stand_ins.Locks):
    """``stand_ins.Locks`` naming a name's lock as the gateway does (``("name", "kind/scope...")``)."""

    def name_lock(self, kind: str, *scope: str) -> tuple[str, str]:
        return ("name", "/".join((kind, *scope)))


@dataclass
class Fleet:
    """``NodeLookup`` and ``LostNodes`` over a registry, as the gateway answers them; ``lost`` names lost nodes."""

    registry: Registry
    lost: set[str] = field(default_factory=set)

    def node_for(self, name: str, what: str) -> Node:
        node = self.registry.get(name)
        if node is None:
            raise Unavailable(f"the node {name!r} holding {what} is not known to this gateway any more")
        if not node.healthy:
            raise Unavailable(f"the node {name!r} holding {what} is not answering; try again later")
        return node

    def is_lost_node(self, name: str) -> bool:
        return name in self.lost


@dataclass
class OneReplica:
    """``Freshness`` of a gateway without other replicas: nothing to catch up with."""

    caught_up_asked: int = 0

    async def fresh(self, lookup: Callable[[], T]) -> T:
        try:
            return lookup()
        except NotFound:
            if not await self.caught_up():
                raise
        return lookup()

    async def caught_up(self) -> bool:
        self.caught_up_asked += 1
        return False


@dataclass
class Quotas:
    """``QuotaProblem`` and ``WakeProblem``: ``short[tenant]`` is the message for a tenant with no room (every other
    fits); each call is recorded with the locks held while it was asked."""

    locks: Locks
    short: dict[str, str] = field(default_factory=dict)
    asked: list[tuple[tuple[Any, ...], list[tuple[str, str]]]] = field(default_factory=list)

    def quota_problem(self, tenant: str, adding: int, cpus: int, memory_mb: int) -> str | None:
        self.asked.append(((tenant, adding, cpus, memory_mb), list(self.locks.holding)))
        return self.short.get(tenant)

    def wake_problem(self, tenant: str, sandbox_id: str, cpus: int, memory_mb: int) -> str | None:
        self.asked.append(((tenant, sandbox_id, cpus, memory_mb), list(self.locks.holding)))
        return self.short.get(tenant)


def record_from(wire: Sandbox, node: str, user: str, tenant: str) -> SandboxRecord:
    return SandboxRecord(
        id=wire.id, user=user, tenant=tenant, node=node, name=wire.name or None, cpus=wire.cpus,
        memory_mb=wire.memory_mb, created=wire.created_at or T0, persistent=wire.persistent, asleep=is_asleep(wire),
    )  # fmt: skip


@dataclass
class Placements:
    """``choose_node`` recording what it was asked (the candidates' names, the excluded) and chose, each time."""

    asked: list[tuple[list[str], set[str]]] = field(default_factory=list)
    chosen: list[str | None] = field(default_factory=list)

    def __call__(
        self, nodes: Sequence[Candidate], excluded: Collection[str], requested: Requested
    ) -> Candidate | None:
        self.asked.append(([n.name for n in nodes], set(excluded)))
        choice = choose_node(nodes, excluded, requested)
        self.chosen.append(choice.name if choice is not None else None)
        return choice

    @property
    def tried(self) -> list[str]:
        """The nodes chosen in turn (a choice of none is the next ask's cue, not a node)."""
        return [name for name in self.chosen if name is not None]


@dataclass
class Parts:
    store: Store
    registry: Registry
    fleet: Fleet
    locks: Locks
    fresh: OneReplica
    quotas: Quotas
    metrics: GatewayMetrics
    placements: Placements
    snapshots: Snapshots
    sandboxes: Sandboxes
    wakes: Wakes

    def node(self, name: str) -> NodeClientStandIn:
        return client_of(self.registry.nodes[name])

    def counted(self, series: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(series, labels)
        return value or 0.0


def parts(store: Store, nodes: Iterable[Node] = (), *, lost: Iterable[str] = ()) -> Parts:
    registry = Registry()
    for node in nodes:
        registry.add(node)
    fleet, locks, fresh, writes = Fleet(registry, set(lost)), Locks(), OneReplica(), Writes()
    quotas, placements = Quotas(locks), Placements()
    metrics = GatewayMetrics(lambda: GatewaySnapshot(0, 0, []))
    snapshots = Snapshots(store, writes, registry, nodes=fleet)
    sandboxes = Sandboxes(
        store, writes, registry, nodes=fleet, lost=fleet, fresh=fresh, locks=locks, snapshots=snapshots,
        quota_problem=quotas.quota_problem, record_from=record_from, metrics=metrics, placement=placements,
        clock=lambda: 0.0,
    )  # fmt: skip
    wakes = Wakes(store, writes, nodes=fleet, locks=locks, wake_problem=quotas.wake_problem)
    return Parts(
        store, registry, fleet, locks, fresh, quotas, metrics, placements, snapshots, sandboxes, wakes
    )

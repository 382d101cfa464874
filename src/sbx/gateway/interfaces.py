"""The narrow interfaces the gateway's parts are given instead of the whole ``Gateway`` (issue 34): each part's
constructor names the few it uses, so reading one controller needs only these and its own module, and a unit test
builds it from stand-ins without a gateway. ``Gateway`` provides every one of them (structurally: mypy holds it to
them at the end of ``server.py``, the assembly); the store
(``store.base.Store``), the node registry (``nodes.Registry``), the sandbox service (``sandboxes.Sandboxes``) and
the secrets (``secrets.Secrets``) are classes of their own and are passed as they are.

Kubernetes' controllers (a client and informers, never the API server) and E2B's orchestrator (placement as an
interface) are the models.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

if TYPE_CHECKING:
    from collections.abc import Collection, Sequence

    from prometheus_client import Counter, Histogram

    from sbx.api.sandboxes import Sandbox
    from sbx.api.snapshots import Snapshot
    from sbx.gateway.auth import Principal
    from sbx.gateway.nodes import Node
    from sbx.gateway.placement import Candidate, Requested
    from sbx.gateway.state import SandboxRecord

#: Seconds on a monotonic clock (``time.monotonic`` unless a test gives another).
Clock = Callable[[], float]
MONOTONIC: Clock = time.monotonic


class Writes(Protocol):
    """Store writes off the event loop (a commit is an fsync)."""

    async def write(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on a worker thread; its result."""


class AuditSink(Protocol):
    """The gateway's audit log (one JSON line per entry; nothing when the gateway keeps none)."""

    def record_audit(self, **fields: Any) -> None:
        """Record one entry (``kind``, ``type``, ``key_id``, ``user``, ``tenant`` ... as the log's format has)."""


class Leadership(Protocol):
    """Whether this replica runs the work done once (always with SQLite; the leader lock's holder on
    PostgreSQL)."""

    @property
    def leading(self) -> bool: ...


class Reservations(Protocol):
    """The locks a check and the change it allows are held under (a tenant's quota, a name unique in its scope),
    in this process and, with replicas, across all of them."""

    def reservation(self, *names: tuple[str, str]) -> AbstractAsyncContextManager[None]:
        """Hold the locks ``names`` (``("tenant", t)``, :meth:`name_lock`'s) around a check and its change."""

    def name_lock(self, kind: str, *scope: str) -> tuple[str, str]:
        """The lock of a name unique in its scope (``sandbox``, ``service``, ``volume``, ``org`` ...)."""


class NodeLookup(Protocol):
    """The node holding a record, answering (503 ``unavailable`` naming it when it is unknown or silent)."""

    def node_for(self, name: str, what: str) -> Node:
        """The node ``name``, healthy; ``what`` names the record in the error (``sandbox sbx_...``)."""


# -- the sandbox, snapshot and wake services (issue 34) ------------------------------------------------------------
# ``sandboxes.Sandboxes``, ``snapshots.Snapshots`` and ``persistent.Wakes`` are given these besides the store, the
# registry and the protocols above.

T = TypeVar("T")

#: Placement (E2B's orchestrator's interface): ``(candidates, excluded, requested)`` to the node to try next, or None
#: when none is left; ``placement.choose_node`` (least loaded first) is the one strategy.
Placement = Callable[["Sequence[Candidate]", "Collection[str]", "Requested"], "Candidate | None"]
#: Why a create of ``adding`` sandboxes with ``cpus`` and ``memory_mb`` would take ``tenant`` past its quota (the
#: 403's message), or None: ``quotas.quota_problem`` on the gateway's usage. ``(tenant, adding, cpus, memory_mb)``.
QuotaProblem = Callable[[str, int, int, int], "str | None"]
#: Why waking the persistent sandbox ``sandbox_id`` would: ``quotas.wake_problem``. ``(tenant, sandbox_id, cpus,
#: memory_mb)``.
WakeProblem = Callable[[str, str, int, int], "str | None"]
#: The ownership record of a sandbox a node answered: ``(wire, node, user, tenant)``.
RecordFrom = Callable[["Sandbox", str, str, str], "SandboxRecord"]


class Freshness(Protocol):
    """Catching up with other replicas' writes before a miss is answered (nothing to wait for on SQLite)."""

    async def fresh(self, lookup: Callable[[], T]) -> T:
        """``lookup()``; after a ``NotFound`` from it, once more when other replicas' changes were waited for."""

    async def caught_up(self) -> bool:
        """Whether changes committed by other replicas before now have arrived (False at once without any)."""


class LostNodes(Protocol):
    """Whether a node is lost (down past ``lost_after_secs``): its sandboxes neither hold names nor count."""

    def is_lost_node(self, name: str) -> bool: ...


class SnapshotFinder(Protocol):
    """Where the caller's snapshot is (``snapshots.Snapshots``): a fork goes to that node."""

    async def find(self, principal: Principal, snapshot_id: str) -> tuple[str, Snapshot]:
        """The node holding the caller's snapshot and the snapshot; 404 when not theirs or absent."""


class SandboxMetrics(Protocol):
    """The series the sandbox service counts (``metrics.GatewayMetrics``)."""

    @property
    def created(self) -> Counter: ...
    @property
    def create_seconds(self) -> Histogram: ...
    @property
    def refused(self) -> Counter: ...
    @property
    def scheduled(self) -> Counter: ...
    @property
    def terminated(self) -> Counter: ...

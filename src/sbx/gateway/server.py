"""The core of a serving gateway: its state (store, node registry, audit log, metrics, open requests), the loops
(node poller, ownership forget sweep, revocation recheck), reconcile of records with the nodes' listings (their
owners, and whether a persistent sandbox is asleep), and the ownership look-ups and quota usage every route uses.

The request pipeline is in ``middlewares.py``; the one route table is ``routes.table`` (handlers in ``routes/``
and ``orgs.py``); sandboxes and snapshots are services (``sandboxes.py``, ``snapshots.py``) the routes and the
gateway's own controllers call alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from sbx.api.errors import NotFound, SandboxError, Unavailable
from sbx.api.node import Resources
from sbx.api.sandboxes import Sandbox
from sbx.gateway import auth
from sbx.gateway.audit import AuditLog
from sbx.gateway.catchup import CatchUp
from sbx.gateway.jobs.controller import CANCEL_SIGNAL, JobController, JobOptions
from sbx.gateway.labels import OWNER_LABEL, TENANT_LABEL
from sbx.gateway.metrics import GatewayMetrics, GatewaySnapshot, NodeGauges
from sbx.gateway.nodes import Node, Registry, connect_node
from sbx.gateway.persistent import Wakes, is_asleep
from sbx.gateway.ports.front import DEFAULT_MAX_PER_SANDBOX, PortFront
from sbx.gateway.ports.store import PortStore
from sbx.gateway.quotas import quota_problem, wake_problem
from sbx.gateway.revocation import DEFAULT_RECHECK_SECS, OpenRequest, OpenRequests
from sbx.gateway.sandboxes import Sandboxes
from sbx.gateway.secrets import SecretBox, Secrets
from sbx.gateway.services.controller import DEFAULT_ROLLOUT_TIMEOUT_SECS, ServiceController
from sbx.gateway.services.proxy import ServiceFront
from sbx.gateway.services.public import DEFAULT_MAX_PER_SERVICE, DEFAULT_MAX_TOTAL, PublicConnections
from sbx.gateway.snapshots import Snapshots
from sbx.gateway.state import NodeDef, NodeFlags, SandboxRecord, now_rfc3339
from sbx.gateway.store import Store
from sbx.gateway.store.base import Change

if TYPE_CHECKING:
    from sbx.gateway.ssh.server import SshServer

log = logging.getLogger(__name__)
T = TypeVar("T")

DEFAULT_MAX_ORGS_PER_USER = 10
#: A read, or a miss (an unknown key, a sandbox not found), on a store shared with other replicas waits at most this
#: long for the changes committed before it to arrive (a read is then refused with a 503, a miss answered as one).
CATCH_UP_SECS = 2.0
#: What a read is told when this replica cannot make sure it has every write acknowledged before it.
NOT_CAUGHT_UP = (
    "this gateway replica cannot make sure it has the other replicas' latest writes now (its database or the "
    "database's change notifications are out of reach); try again shortly"
)
#: Tables whose change by another replica may take access away (its follow-up: ``access_changed``).
ACCESS_TABLES = frozenset({"keys", "members", "orgs", "ssh_keys"})
#: Threads that may wait at once for the replicas' shared locks (beyond them, waiters queue).
LOCK_THREADS = 32


@dataclass
class GatewayOptions:
    """Behaviour knobs of a serving gateway; defaults are the spec's."""

    cors_origins: frozenset[str] = frozenset()
    node_files_dir: Path | None = None
    max_orgs_per_user: int = DEFAULT_MAX_ORGS_PER_USER
    forget_interval_secs: float = 60.0
    recheck_secs: float = DEFAULT_RECHECK_SECS
    file_nodes: list[NodeDef] = field(default_factory=list)
    #: Services, jobs and secrets: ``--secrets-key-file`` (None: no secrets), the jobs' options (``--jobs-dir``,
    #: required), ``--rollout-timeout``, ``--services-domain``.
    secrets_key: bytes | None = None
    jobs: JobOptions | None = None
    rollout_timeout_secs: float = DEFAULT_ROLLOUT_TIMEOUT_SECS
    services_domain: str | None = None
    #: Connections without a key to public services: per service and all together (``services/public.py``).
    max_public_connections_per_service: int = DEFAULT_MAX_PER_SERVICE
    max_public_connections: int = DEFAULT_MAX_TOTAL
    #: Exposed ports (docs/ports.md): ``--ports-domain`` (None: not served, the endpoints 501) and the cap on
    #: connections without a key to one sandbox's public ports.
    ports_domain: str | None = None
    max_public_connections_per_sandbox: int = DEFAULT_MAX_PER_SANDBOX


class AccessWatcher(Protocol):
    """Something the gateway runs for an owner (an SSH connection, a job, a service's traffic and replicas)."""

    async def access_changed(self) -> None:
        """End what may no longer run (see ``auth.has_access``), before returning."""


class Gateway:
    """Everything a serving gateway holds."""

    def __init__(
        self, store: Store, registry: Registry, audit: AuditLog | None, options: GatewayOptions
    ) -> None:
        self.store = store
        self.registry = registry
        self.audit = audit
        self.options = options
        self.open = OpenRequests()
        self.metrics = GatewayMetrics(self.snapshot)
        #: Threads waiting for the store's shared locks (seconds, while another replica holds one), apart from
        #: asyncio's default executor, which the store's writes need meanwhile (6 threads on 2 cores).
        self._lock_threads = ThreadPoolExecutor(max_workers=LOCK_THREADS, thread_name_prefix="store-lock")
        #: ``reservation``'s in-process locks, by name, with how many hold or wait for each.
        self._reserving: dict[tuple[str, str], tuple[asyncio.Lock, list[int]]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        #: Whether this replica runs the work done once (sweeps, services' and jobs' controllers, notifications):
        #: always with SQLite; with PostgreSQL the one holding the leader lock (``lead``).
        self.leading = not store.elects
        #: Set at SIGTERM with ``--drain``: ``GET /v1/ready`` answers 503 while requests are still served.
        self.draining = False
        #: Called when this process must stop (it lost the leader lock: another replica may lead by then).
        self.stop_process: Callable[[str], None] | None = None
        #: Follow-ups of other replicas' changes still running (kept referenced until they end).
        self._follow_ups: set[asyncio.Task[None]] = set()
        #: Waits for every change committed before it (``caught_up``, ``up_to_date``), shared by concurrent callers.
        self.catch_up = CatchUp(lambda: store.caught_up_on_loop(CATCH_UP_SECS), CATCH_UP_SECS)
        #: Before the sandbox service, which finds a fork's snapshot through it.
        self.snapshots = Snapshots(store, self, registry, nodes=self)
        #: The services routes and the gateway's own controllers call alike.
        self.sandboxes = Sandboxes(
            store, self, registry, nodes=self, lost=self, fresh=self, locks=self, snapshots=self.snapshots,
            quota_problem=functools.partial(quota_problem, self), record_from=self.record_from, metrics=self.metrics,
        )  # fmt: skip
        #: Persistent sandboxes' sleep as the records know it, and the quota check before one is woken.
        self.wakes = Wakes(
            store, self, nodes=self, locks=self, wake_problem=functools.partial(wake_problem, self)
        )
        #: What else holds an owner to their access (SSH connections, jobs, services): told by access_changed.
        self.watchers: list[AccessWatcher] = []
        #: The SSH server, while one is served (``--ssh-listen``).
        self.ssh: SshServer | None = None
        #: Tenant secrets, services (controller and traffic front) and jobs; their controllers are started by the
        #: serving application (``main.build_app``), after the gateway's own loops.
        self.secrets = Secrets(self, store, SecretBox(options.secrets_key) if options.secrets_key else None)
        self.services = ServiceController(
            store, self, registry, self.sandboxes, self.secrets, locks=self, leadership=self, audit=self,
            metrics=self.metrics.registry, rollout_timeout_secs=options.rollout_timeout_secs,
        )  # fmt: skip
        public = PublicConnections(options.max_public_connections_per_service, options.max_public_connections)
        self.service_front = ServiceFront(
            store, registry, self.services, options.services_domain, public, fresh=self
        )
        #: The exposed ports' traffic front, with ``--ports-domain`` (it shares the public caps with services).
        self.ports: PortFront | None = None
        if options.ports_domain:
            ports = PortStore(store, self.write)
            self.ports = PortFront(store, ports, options.ports_domain, public,
                                   options.max_public_connections_per_sandbox, fresh=self, nodes=self,
                                   wakes=self.wakes, audit=self, leadership=self)  # fmt: skip
            self.sandboxes.on_terminated.append(self.ports.ended)
        if options.jobs is None:
            # The store may be a database with no directory beside it: where jobs' output goes is always said.
            raise ValueError(
                "GatewayOptions.jobs is required (it names the directory of the jobs' kept output)"
            )
        self.jobs = JobController(
            options.jobs, store=store, writes=self, registry=registry, sandboxes=self.sandboxes,
            secrets=self.secrets, leadership=self, audit=self, metrics=self.metrics.registry,
        )  # fmt: skip
        registry.wanted_cordon = self.wanted_cordon
        registry.cordon_guard = lambda name: self.shared_lock(("node", name))
        registry.still_wanted = self._cordon_still_wanted
        registry.on_answering_again.append(self._answering_again)

    # -- lifecycle -----------------------------------------------------------------------------

    async def start(self) -> None:
        loop = asyncio.get_running_loop()

        def on_changes(changes: list[Change]) -> None:  # from the store's listening thread
            try:
                loop.call_soon_threadsafe(self.changed, changes)
            except RuntimeError:  # the loop is closed: the gateway is stopping
                pass

        self.store.listen(on_changes)
        for definition in [*self.options.file_nodes, *self.store.nodes.values()]:
            try:
                self.registry.add(connect_node(definition))
            except (SandboxError, OSError, ValueError) as exc:
                log.error("node not usable", extra={"node": definition.name, "error": str(exc)})
        await self.registry.start()
        self._tasks.append(asyncio.create_task(self._every(self.options.recheck_secs, self.access_changed)))

    async def lead(self) -> None:
        """Run for leader (see ``Store.lead``); once elected, run the work done once. A SQLite gateway leads at
        once, before this returns (as it always started its workloads before serving)."""
        if not self.store.elects:
            await self._take_lead()
            return
        loop = asyncio.get_running_loop()

        def on_change(leading: bool) -> None:  # from the store's leader thread
            try:
                if leading:
                    loop.call_soon_threadsafe(lambda: self._follow_up(self._take_lead()))
                else:
                    loop.call_soon_threadsafe(self._lost_lead)
            except RuntimeError:  # the loop is closed: the gateway is stopping
                pass

        self.store.lead(on_change)

    async def _take_lead(self) -> None:
        self.leading = True
        if self.store.elects:
            log.info("this replica leads: it runs the sweeps, the services' and jobs' controllers and the "
                     "notifications")  # fmt: skip
        self._tasks.append(
            asyncio.create_task(self._every(self.options.forget_interval_secs, self.forget_sweep))
        )
        await self.services.start()
        await self.jobs.start()

    def _lost_lead(self) -> None:
        log.critical("lost the leader lock; stopping")
        self.leading = False
        if self.stop_process is not None:
            self.stop_process("the leader lock's connection was lost")

    async def _answering_again(self, node: Node) -> None:
        if self.leading:  # the records follow the node's listing: one replica decides
            await self.reconcile(node)

    async def close(self) -> None:
        for task in [*self._tasks, *self._follow_ups]:
            task.cancel()
        for task in self._tasks:
            try:
                await task
            except asyncio.CancelledError:
                pass
        await self.registry.close()
        self._lock_threads.shutdown(wait=False, cancel_futures=True)

    # -- other replicas' writes -----------------------------------------------------------------

    def changed(self, changes: list[Change]) -> None:
        """Rows committed by any replica (this one's own marked ``local``): into memory, then the follow-up a
        local write runs for the same change — a revocation, a member or an SSH key removed, an org deleted end
        what may no longer run here (``access_changed``); a node added or removed through another replica is
        polled or let go here too."""
        self.store.refresh(changes)
        remote = {c.table for c in changes if not c.local}
        if remote & ACCESS_TABLES:
            self._follow_up(self.access_changed())
        if "nodes" in remote:
            self.sync_nodes()
        if self.leading and remote & {"services", "service_revisions"}:
            self._follow_up(self.services.taken_up())
        if self.leading and remote & {"jobs", "job_runs"}:
            self._follow_up(self.jobs.taken_up())
        if self.leading:
            for change in changes:
                if change.table == f"signal:{CANCEL_SIGNAL}" and change.key is not None:
                    self._follow_up(self.jobs.cancel_asked(str(change.key[0]), str(change.key[1])))
        if self.leading and "notifications" in remote:  # written by a follower (a job cancelled there)
            self.jobs.notifier.wake()

    def _follow_up(self, work: Awaitable[None]) -> None:
        async def run() -> None:
            try:
                await work
            except Exception:
                log.exception("a follow-up of another replica's change failed")

        task = asyncio.create_task(run())
        self._follow_ups.add(task)
        task.add_done_callback(self._follow_ups.discard)

    def sync_nodes(self) -> None:
        """The registry holds the node file's nodes and the store's: those added or removed elsewhere follow at
        once, with memory (the next listing shows them); a new one's first poll and a removed one's connections
        closing follow up."""
        from_file = {d.name for d in self.options.file_nodes}
        for name, definition in list(self.store.nodes.items()):
            if name in self.registry.nodes:
                continue
            try:
                node = connect_node(definition)
            except (SandboxError, OSError, ValueError) as exc:
                log.error("node not usable", extra={"node": name, "error": str(exc)})
                continue
            self.registry.add(node)
            self._follow_up(self.registry.poll(node))
        for name in list(self.registry.nodes):
            if name not in from_file and name not in self.store.nodes:
                gone = self.registry.detach(name)
                if gone is not None:
                    self._follow_up(gone.client.close())

    @contextlib.asynccontextmanager
    async def shared_lock(self, *names: tuple[str, str]) -> AsyncIterator[None]:
        """The store's locks shared by the replicas (``Store.lock``: ``(kind, name)`` pairs) held for the block;
        nothing with one process."""
        if not self.store.shared or not names:
            yield
            return
        loop = asyncio.get_running_loop()
        taking = asyncio.ensure_future(loop.run_in_executor(self._lock_threads, self.store.lock, names))
        try:
            handle = await asyncio.shield(taking)
        except asyncio.CancelledError:
            # The thread takes the locks all the same: let go of them once it has.
            taking.add_done_callback(
                lambda t: None if t.cancelled() or t.exception() else self.store.unlock(t.result())
            )
            raise
        try:
            yield
        finally:
            # Shielded: a holder cancelled while it lets go (a service's control loop ended by a delete) must not
            # cancel the unlock still queued for a thread, which would leave the locks held on a lock connection
            # never given back (seen: a service's DELETE waiting the 60 s of LOCK_WAIT_SECS, then 503).
            await asyncio.shield(loop.run_in_executor(self._lock_threads, self.store.unlock, handle))

    async def _cordon_still_wanted(self, name: str) -> bool:
        await self.caught_up()  # another replica's lifting of it, committed before we held the node's lock
        return self.wanted_cordon(name)

    @contextlib.asynccontextmanager
    async def reservation(self, *names: tuple[str, str]) -> AsyncIterator[None]:
        """Held around a check and the create it allows — a tenant's quota (``("tenant", tenant)``), a name
        unique in its scope (``("name", "KIND...")``) — so two creates never pass one check together.

        This process's locks of those names first (all there is with one gateway on SQLite); with replicas,
        then the same locks shared by all of them and every record committed before them caught up with, so
        the check sees what any replica made (docs/ha.md). Local first: one process's own creates wait here,
        not for a lock connection."""
        async with contextlib.AsyncExitStack() as held:
            for name in sorted(set(names)):  # one order everywhere: two reservations never wait on each other
                await held.enter_async_context(self._local_lock(name))
            await held.enter_async_context(self.shared_lock(*names))
            if self.store.shared and names:
                await self.caught_up()
            yield

    @contextlib.asynccontextmanager
    async def _local_lock(self, name: tuple[str, str]) -> AsyncIterator[None]:
        """This process's lock of ``name``, kept only while someone holds or waits for it."""
        entry = self._reserving.get(name)
        if entry is None:
            entry = self._reserving[name] = (asyncio.Lock(), [0])
        lock, users = entry
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if users[0] == 0:
                del self._reserving[name]

    @staticmethod
    def name_lock(kind: str, *scope: str) -> tuple[str, str]:
        """The lock (for :meth:`reservation`) of a name unique in its scope: ``kind`` (``sandbox``, ``service``,
        ``volume``, ``org``, ``node``, ``ssh-key``) and what makes it unique there (a user's sandbox names: user
        and tenant; a service: tenant and name; a volume: its name); also of a record changed by several
        (``service-record``: a service's, by its id)."""
        return ("name", "\x1f".join((kind, *scope)))  # a byte no name holds

    async def fresh(self, lookup: Callable[[], T]) -> T:
        """``lookup()``; a ``NotFound`` from it on a store shared with other replicas first waits for the changes
        committed before now (a record just made through another replica), then looks again."""
        try:
            return lookup()
        except NotFound:
            if not await self.caught_up():
                raise
        return lookup()

    async def caught_up(self) -> bool:
        """Before a miss is answered (an unknown key, a sandbox not found): whether changes committed by other
        replicas before now have arrived (so looking again is worth it). False at once without other replicas."""
        if not self.store.shared:
            return False
        return await self.catch_up()

    async def up_to_date(self) -> None:
        """Before a read is answered from memory: memory holds every write committed (so every write any replica
        acknowledged) before now — 503 ``unavailable`` when that cannot be made sure of within ``CATCH_UP_SECS``
        (the database, or its change notifications, out of reach). Nothing to wait for on SQLite (one process)."""
        if self.store.shared and not await self.catch_up():
            raise Unavailable(NOT_CAUGHT_UP)

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
            status = node.status
            nodes.append(NodeGauges(
                node.name, node.healthy, self.wanted_cordon(node.name) or bool(status and status.cordoned),
                status.running if status else 0,
                status.capacity if status else Resources(0, 0, 0), status.free if status else Resources(0, 0, 0),
            ))  # fmt: skip
        records = list(self.store.sandboxes.values())
        lost = sum(1 for r in records if self.is_lost_node(r.node))
        return GatewaySnapshot(len(records), lost, nodes, self.leading)

    def is_lost_node(self, name: str) -> bool:
        node = self.registry.get(name)
        return node is not None and node.is_lost(self.registry.lost_after_secs)

    # -- reconcile and forget ------------------------------------------------------------------

    async def reconcile(self, node: Node) -> None:
        """Bring the records of ``node`` in line with its own listing: forget what it no longer runs, and take
        back a sandbox it runs with our labels but no record (the gateway stopped between the node's answer
        and the record's commit)."""
        started = time.time()
        listing = await node.client.sandboxes()
        live = {s.id: s for s in listing if s.state != "terminated"}
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
            labels = wire.labels
            known = self.store.sandboxes.get(sandbox_id)
            if known is not None and known.node == node.name:
                # Asleep or awake since (an idle timeout, a wake); a call failing now leaves it to the next one.
                with contextlib.suppress(SandboxError):
                    await self.wakes.learnt(known, wire)
            if known is not None or OWNER_LABEL not in labels:
                continue
            await self.write(self.store.put_sandbox, self.record_from(wire, node.name, labels[OWNER_LABEL],
                                                                      labels.get(TENANT_LABEL, "")))  # fmt: skip
        node.reconciled_at = time.monotonic()

    async def forget_sweep(self) -> None:
        """Every minute: reconcile every answering node from its listing."""
        for node in self.registry.healthy():
            try:
                await self.reconcile(node)
            except SandboxError as exc:
                log.warning("forget sweep skipped a node", extra={"node": node.name, "error": exc.message})

    def record_from(self, wire: Sandbox, node: str, user: str, tenant: str) -> SandboxRecord:
        return SandboxRecord(
            id=wire.id, user=user, tenant=tenant, node=node, name=wire.name or None, cpus=wire.cpus,
            memory_mb=wire.memory_mb, created=wire.created_at or now_rfc3339(), persistent=wire.persistent,
            asleep=is_asleep(wire),
        )  # fmt: skip

    # -- revocation ----------------------------------------------------------------------------

    async def access_changed(self) -> None:
        """Keys, scopes or memberships changed (a revocation, a member removed, an SSH key deleted), or the 30 s
        recheck came: end every open request, and let every watcher end whatever of its own, that may no longer
        run. Done before the call that changed access returns (spec: Revocation)."""
        await self.recheck()
        for watcher in list(self.watchers):
            try:
                await watcher.access_changed()
            except Exception:
                log.exception("an access watcher failed", extra={"watcher": type(watcher).__name__})

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

    def node_for(self, name: str, what: str) -> Node:
        node = self.registry.get(name)
        if node is None:
            raise Unavailable(f"the node {name!r} holding {what} is not known to this gateway any more")
        if not node.healthy:
            raise Unavailable(f"the node {name!r} holding {what} is not answering; try again later")
        return node

    def tenant_usage(self, tenant: str) -> tuple[int, int, int]:
        """(sandboxes, cpus, memory_mb) counted against ``tenant``'s quota: records not on lost nodes. A persistent
        sandbox asleep (suspended or stopped) counts as a sandbox but not its cpus and memory: its node holds only
        its disk, and waking it is checked against the quota first (``sbx.gateway.persistent``)."""
        count = cpus = memory = 0
        for r in list(self.store.sandboxes.values()):
            if r.tenant == tenant and not self.is_lost_node(r.node):
                count += 1
                if not r.asleep:
                    cpus += r.cpus
                    memory += r.memory_mb
        return count, cpus, memory


def _created_before(created: str, epoch_secs: float) -> bool:
    try:
        return datetime.fromisoformat(created).timestamp() < epoch_secs
    except ValueError:
        return True


if TYPE_CHECKING:
    from sbx.gateway.interfaces import (
        AuditSink,
        Freshness,
        Leadership,
        LostNodes,
        NodeLookup,
        Placement,
        RecordFrom,
        Reservations,
        SandboxMetrics,
        SnapshotFinder,
        Writes,
    )
    from sbx.gateway.placement import choose_node

    def _gateway_provides_them(
        gw: Gateway,
    ) -> tuple[
        Writes,
        AuditSink,
        Leadership,
        Reservations,
        NodeLookup,
        Freshness,
        LostNodes,
        SandboxMetrics,
        RecordFrom,
    ]:
        """Never run: mypy holds ``Gateway`` (and its metrics, its ``record_from``) to the interfaces of
        ``sbx.gateway.interfaces`` it is passed as, here where the parts are built from it."""
        return gw, gw, gw, gw, gw, gw, gw, gw.metrics, gw.record_from

    def _the_services_provide_them(snapshots: Snapshots) -> tuple[SnapshotFinder, Placement]:
        """Never run: likewise ``Snapshots`` as the sandbox service's ``SnapshotFinder``, and ``choose_node`` as its
        ``Placement``."""
        return snapshots, choose_node

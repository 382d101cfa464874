"""The services controller: keeps every service's healthy replicas equal to what it asks for (spec: Services,
Service states, Revocation 4; docs/services.md).

One task per service wakes every second (or at once when a replica's health changes) and takes one step:

1. replicas on a node that stopped answering (``--failures-unhealthy`` polls in a row) are ``lost``; a lost one
   whose node answers again is ended; one whose node was removed is forgotten;
2. a rollout that has run longer than ``--rollout-timeout`` fails;
3. :func:`rollout.plan` says what to make and what to end; unhealthy and lost replicas are replaced (each counted
   as a restart of the service and of the replica's slot); a new-revision replica replaced before it was ever
   healthy counts against the rollout, which fails at the second;
4. replicas are made only while the owner holds an active key in the tenant (``auth.has_access``); a create the
   nodes cannot take now (no room, over quota) is retried with a backoff (1 s doubling to 30 s), and its reason
   is the service's ``error`` meanwhile.

Every replica is a sandbox made through the sandbox service's ``create`` for ``Principal.owner(user, tenant)`` (quotas,
placement, owner labels), stamped ``gateway.service`` (the name), ``gateway.service.rev`` and
``gateway.service.id``, then its command is started as a background process. A task per replica checks its
health (``health.py``): every ``every_secs``, and every 0.25 s while it is starting; a starting replica is
healthy at its first passing check and unhealthy when none passed within ``every_secs`` × ``failures`` of its
start; a healthy one is unhealthy after ``failures`` failed checks in a row; one whose command exited or whose
sandbox is gone is unhealthy at once.

After a restart the controller takes up the state file's services where they were: recorded replicas are
checked again (not remade), a sandbox made but not recorded is found on its node by its labels and adopted, and a
recorded replica whose command had not been started gets it started (or the process that was started adopted).
Sandboxes labelled for no current replica (a service deleted meanwhile, a create cut half way) are ended when their
node is seen again and by a sweep every minute.

What it is given (issue 34; docs/architecture.md): the store and its writes, the node registry, the sandbox service
and the secrets (``services.interfaces``), the locks, whether this replica leads (asked each time: it changes), the
audit log, the metrics registry and a monotonic clock; never the gateway.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import secrets as random_source
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, TypeVar

from msgspec import UNSET
from msgspec.structs import replace
from prometheus_client import CollectorRegistry

from sbx.api.errors import Conflict, InvalidRequest, NotFound, SandboxError, Unavailable
from sbx.api.processes import ProcessRequest
from sbx.api.sandboxes import Sandbox
from sbx.api.services import Replica as ReplicaWire
from sbx.api.services import ReplicaState, Rollout, Service, ServiceSpec
from sbx.gateway import auth
from sbx.gateway.auth import Principal
from sbx.gateway.interfaces import MONOTONIC, AuditSink, Clock, Leadership, Reservations, Writes
from sbx.gateway.nodes import Node, Registry
from sbx.gateway.quotas import OverQuota
from sbx.gateway.services import health
from sbx.gateway.services.interfaces import ReplicaSandboxes, SecretValues
from sbx.gateway.services.metrics import ServiceMetrics
from sbx.gateway.services.rollout import ReplicaView, plan
from sbx.gateway.services.spec import DEFAULT_EVERY_SECS, DEFAULT_FAILURES, answer_timeout_secs, rollout_part
from sbx.gateway.services.store import ReplicaRecord, RolloutRecord, ServiceRecord, ServiceStore
from sbx.gateway.specs import create_request
from sbx.gateway.state import now_rfc3339, older_than
from sbx.gateway.store.base import Store

log = logging.getLogger(__name__)
T = TypeVar("T")

SERVICE_LABEL = "gateway.service"
REVISION_LABEL = "gateway.service.rev"
SERVICE_ID_LABEL = "gateway.service.id"
DEFAULT_ROLLOUT_TIMEOUT_SECS = 300.0
#: New-revision replicas replaced before ever being healthy that fail a rollout.
ROLLOUT_FAILURES = 2
#: Seconds between steps of a service when nothing wakes it.
STEP_SECS = 1.0
#: Seconds between checks of a starting replica (or ``every_secs`` when shorter).
STARTING_CHECK_SECS = 0.25
BACKOFF_FIRST_SECS = 1.0
BACKOFF_MAX_SECS = 30.0
#: A labelled sandbox no record knows is ended only when older than this (a create may be recording it now).
ORPHAN_AGE_SECS = 60.0
SWEEP_SECS = 60.0
#: Seconds a replica that a request could not reach is tried last by this gateway's traffic front.
DOWN_SECS = 30.0


@dataclass(eq=False)
class ReplicaRuntime:
    """A replica and what its health checks found (kept in memory; a restart checks again)."""

    rec: ReplicaRecord
    state: ReplicaState = "starting"
    failures: int = 0
    last_check: str | None = None
    last_error: str | None = None
    started: float = field(default_factory=time.monotonic)
    checker: asyncio.Task[None] | None = None

    def view(self) -> ReplicaView:
        return ReplicaView(self.rec.sandbox, self.rec.revision, self.state, self.rec.created)

    def wire(self) -> ReplicaWire:
        return ReplicaWire(
            sandbox=self.rec.sandbox, node=self.rec.node, revision=self.rec.revision, state=self.state,
            healthy=self.state == "healthy", restarts=self.rec.restarts, created_at=self.rec.created,
            last_check=self.last_check if self.last_check is not None else UNSET,
            last_error=self.last_error if self.last_error is not None else UNSET,
        )  # fmt: skip


@dataclass(eq=False)
class ServiceRuntime:
    """A service's controller state: its replicas, its task, why creates fail now, its traffic."""

    id: str
    replicas: dict[str, ReplicaRuntime] = field(default_factory=dict)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task[None] | None = None
    error: str | None = None
    next_create: float = 0.0
    backoff: float = BACKOFF_FIRST_SECS
    #: Restart counts the next replicas of a revision take over from the ones they replace.
    pending_restarts: dict[int, list[int]] = field(default_factory=dict)

    def healthy(self) -> list[ReplicaRuntime]:
        return [r for r in self.replicas.values() if r.state == "healthy"]


class ServiceController:
    """Every service of the gateway: the calls of the routes, the controller tasks, the traffic's view."""

    def __init__(
        self,
        store: Store,
        writes: Writes,
        registry: Registry,
        sandboxes: ReplicaSandboxes,
        secrets: SecretValues,
        *,
        locks: Reservations,
        leadership: Leadership,
        audit: AuditSink,
        metrics: CollectorRegistry,
        rollout_timeout_secs: float = DEFAULT_ROLLOUT_TIMEOUT_SECS,
        clock: Clock = MONOTONIC,
    ) -> None:
        self.store = store
        self.registry = registry
        self.sandboxes = sandboxes
        self.secrets = secrets
        self.locks = locks
        self.leadership = leadership
        self.audit = audit
        self.clock = clock
        self.db = ServiceStore(store, writes.write)
        self.rollout_timeout_secs = rollout_timeout_secs
        self.runtimes: dict[str, ServiceRuntime] = {}
        #: Told when a service's owner loses access (the traffic front ends its open requests).
        self.on_access_lost: list[Callable[[str], object]] = []
        self._started = False
        self._sweeper: asyncio.Task[None] | None = None
        self.metrics = ServiceMetrics(metrics, self.replicas_total, lambda: len(self.db.services))
        #: Per service: whether its owner held access at the last look (a change is acted on once).
        self._access: dict[str, bool] = {}
        #: Per service: the traffic front's round-robin position.
        self._turns: dict[str, int] = {}
        #: Replicas this gateway failed to reach with a request, and until when (monotonic seconds) they are
        #: tried last: a dead replica is left at once, before the leader's checks find it.
        self._unreachable: dict[str, float] = {}

    # -- lifecycle ------------------------------------------------------------------------------------

    async def start(self) -> None:
        """Take up every service of the state file (see the module docstring) and start their tasks."""
        for svc in list(self.db.services.values()):
            rt = self.runtimes[svc.id] = ServiceRuntime(svc.id)
            for rec in self.db.replicas_of(svc.id):
                # A replica recorded healthy (by this gateway before a restart, or by the leader before a
                # takeover) stays healthy until its own checks say otherwise, so its traffic has no gap; any
                # other is checked again from the start.
                state: ReplicaState = "healthy" if rec.state == "healthy" else "starting"
                rt.replicas[rec.sandbox] = ReplicaRuntime(
                    rec,
                    state=state,
                    last_check=rec.checked,
                    last_error=rec.last_error,
                    started=self.clock(),
                )
        for node in self.registry.healthy():
            await self._sweep_node(node, adopt=True)
        for rt in self.runtimes.values():
            for rep in rt.replicas.values():
                self._watch(rt, rep)
            rt.task = asyncio.create_task(self._run(rt), name=f"service-{rt.id}")
        self.registry.on_answering_again.append(self._node_back)
        self._sweeper = asyncio.create_task(self._sweep_loop(), name="service-sweeper")
        self._started = True

    async def _sweep_loop(self) -> None:
        """Every minute: end sandboxes labelled for no current replica (a create cut half way by a delete)."""
        while True:
            await asyncio.sleep(SWEEP_SECS)
            for node in self.registry.healthy():
                try:
                    await self._sweep_node(node, adopt=False)
                except Exception:
                    log.exception("service sweep failed", extra={"node": node.name})

    async def close(self) -> None:
        tasks = [self._sweeper] if self._sweeper is not None else []
        for rt in self.runtimes.values():
            for rep in rt.replicas.values():
                if rep.checker is not None:
                    tasks.append(rep.checker)
            if rt.task is not None:
                tasks.append(rt.task)
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def tenants(self) -> set[str]:
        return {svc.tenant for svc in list(self.db.services.values())}

    # -- the routes' calls ----------------------------------------------------------------------------

    def find(self, principal: Principal, name: str, tenant: str | None) -> ServiceRecord:
        """The caller's service ``name`` in the tenant acted in (an admin may name another with ``tenant``);
        404 for another user's or an absent one alike."""
        where = principal.tenant
        if tenant is not None:
            asked = "" if tenant == "default" else tenant
            if asked != principal.tenant and not principal.admin:
                raise NotFound(f"no service {name!r} among yours")
            where = asked
        svc = self.db.by_name(where, name)
        if svc is None or not principal.owns(svc.user, svc.tenant):
            raise NotFound(f"no service {name!r} among yours")
        return svc

    def listing(self, principal: Principal) -> list[ServiceRecord]:
        return sorted(
            (s for s in list(self.db.services.values()) if principal.owns(s.user, s.tenant)),
            key=lambda s: (s.tenant, s.name),
        )

    async def create(self, principal: Principal, spec: ServiceSpec) -> ServiceRecord:
        """A new service of ``principal`` (``spec`` checked and completed); 409 for a name its tenant has (checked
        under the name's lock shared by the replicas, against every service any of them made)."""
        async with self.locks.reservation(self.locks.name_lock("service", principal.tenant, spec.name)):
            return await self._create(principal, spec)

    async def _create(self, principal: Principal, spec: ServiceSpec) -> ServiceRecord:
        if self.db.by_name(principal.tenant, spec.name) is not None:
            raise Conflict(
                f"this tenant already has a service named {spec.name!r}: pick another name or PUT it"
            )
        now = now_rfc3339()
        assert spec.replicas is not UNSET
        svc = ServiceRecord(
            id="svc_" + random_source.token_hex(8), tenant=principal.tenant, name=spec.name, user=principal.user,
            spec=spec, revision=1, serving=1, desired=spec.replicas, restarts=0, rollout=None, created=now,
            updated=now,
        )  # fmt: skip
        await self.db.put_service(svc, spec)
        if self.leadership.leading:  # else the leader takes it up from the database (taken_up)
            rt = self.runtimes[svc.id] = ServiceRuntime(svc.id)
            rt.task = asyncio.create_task(self._run(rt), name=f"service-{svc.id}")
        log.info("service created", extra={"service": svc.id, "replicas": svc.desired})
        return svc

    async def update(self, svc: ServiceRecord, spec: ServiceSpec) -> ServiceRecord:
        """PUT: a changed image, command, resources, port, health, env, network or secrets starts a rollout to a
        new revision; ``replicas`` scales; ``public``, ``placement`` and ``answer_timeout_secs`` apply at once."""
        if spec.name != svc.name:
            raise InvalidRequest(f"name: the body names {spec.name!r} but the path {svc.name!r}; a service is "
                                 "not renamed: create another")  # fmt: skip
        assert spec.replicas is not UNSET
        replicas = spec.replicas

        async def put() -> ServiceRecord:
            found = self.db.services.get(svc.id)
            if found is None:
                raise NotFound(f"no service {svc.name!r} among yours")  # deleted meanwhile
            current = self.db.revisions.get((found.id, found.revision), found.spec)
            new_revision = None
            rollout = found.rollout
            revision = found.revision
            if rollout_part(spec) != rollout_part(current):
                revision += 1
                new_revision = spec
                rollout = RolloutRecord("in_progress", found.serving, revision, time.time())
                log.info("rollout started", extra={"service": svc.id, "from": found.serving, "to": revision})
            changed = dataclasses.replace(found, spec=spec, revision=revision, desired=replicas, rollout=rollout,
                                          updated=now_rfc3339())  # fmt: skip
            await self.db.put_service(changed, new_revision)
            return changed

        changed = await self._under_lock(svc.id, put)
        self._wake(changed.id)
        return changed

    async def scale(self, svc: ServiceRecord, replicas: int) -> ServiceRecord:
        changed = await self._change(svc.id, lambda s: dataclasses.replace(
            s, desired=replicas, spec=replace(s.spec, replicas=replicas), updated=now_rfc3339()))  # fmt: skip
        self._wake(svc.id)
        return changed or svc

    async def _under_lock(self, service_id: str, work: Callable[[], Awaitable[T]]) -> T:
        """``work()`` — a look at a service's record and the write it decides (the routes and the control loop
        write the same records) — under the record's lock: one at a time on this replica, and with replicas
        across all of them, memory caught up first, so a record deleted through another replica is seen gone and
        never written back.

        Run to its end even when the caller is cancelled meanwhile (the control loop ended by a delete, a client
        gone): the lock is let go only once the write has committed, so a change cancelled on its way can never
        land after the next holder's (seen: the loop's last upsert committed after the delete that cancelled
        it, and the service was back on every replica)."""

        async def locked() -> T:
            async with self.locks.reservation(self.locks.name_lock("service-record", service_id)):
                return await work()

        running = asyncio.ensure_future(locked())
        try:
            return await asyncio.shield(running)
        except asyncio.CancelledError:
            # Its end is nobody's to see now: an error of it is logged, not left "never retrieved".
            running.add_done_callback(_log_failure)
            raise

    async def _change(
        self, service_id: str, change: Callable[[ServiceRecord], ServiceRecord | None]
    ) -> ServiceRecord | None:
        """Apply ``change`` to the service as it is now and write it (None from ``change``: nothing to write), one
        change of a service at a time: the routes and the control loop change the same records."""

        async def apply() -> ServiceRecord | None:
            current = self.db.services.get(service_id)
            if current is None:
                return None
            changed = change(current)
            if changed is None:
                return current
            await self.db.put_service(changed)
            return changed

        return await self._under_lock(service_id, apply)

    async def delete(self, svc: ServiceRecord) -> None:
        """End the service's task and every replica it can reach (one on a node not answering is ended when
        the node is seen again), then forget it."""
        for fn in self.on_access_lost:  # its open requests here (on a follower too)
            fn(svc.id)
        rt = self.runtimes.pop(svc.id, None)
        if rt is not None:
            if rt.task is not None:
                rt.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await rt.task
            await asyncio.gather(*(self._end(svc, rep) for rep in list(rt.replicas.values())))
        await self._under_lock(svc.id, lambda: self.db.delete_service(svc.id))
        log.info("service deleted", extra={"service": svc.id})

    async def taken_up(self) -> None:
        """On the leader, after another replica changed services: a new one gets its task, a changed one is
        woken, a deleted one has its task and replicas ended (as :meth:`delete` does for one deleted here)."""
        if not self._started:
            return
        for svc in list(self.db.services.values()):
            if svc.id not in self.runtimes:
                rt = self.runtimes[svc.id] = ServiceRuntime(svc.id)
                rt.task = asyncio.create_task(self._run(rt), name=f"service-{svc.id}")
                log.info("service taken up from another replica", extra={"service": svc.id})
            else:
                self._wake(svc.id)
        for service_id in [i for i in self.runtimes if i not in self.db.services]:
            rt = self.runtimes.pop(service_id)
            if rt.task is not None:
                rt.task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await rt.task
            for fn in self.on_access_lost:
                fn(service_id)
            await asyncio.gather(*(self._end(service_id, rep) for rep in list(rt.replicas.values())))
            for rep in list(rt.replicas.values()):
                await self.db.forget_replica(rep.rec.sandbox)
            log.info("service deleted through another replica: replicas ended", extra={"service": service_id})

    def wire(self, svc: ServiceRecord, url: str | None) -> Service:
        rt = self.runtimes.get(svc.id) or ServiceRuntime(svc.id)
        replicas = sorted(self.view(svc.id), key=lambda r: (r.rec.revision, r.rec.created))
        rollout = svc.rollout
        return Service(
            spec=replace(svc.spec, env=UNSET, replicas=svc.desired,
                         answer_timeout_secs=answer_timeout_secs(svc.spec)), env_names=sorted(svc.spec.env or {}),
            owner=svc.user, tenant=svc.tenant or None, revision=svc.revision, serving=svc.serving,
            desired=svc.desired, ready=sum(r.state == "healthy" for r in replicas), restarts=svc.restarts,
            rollout=Rollout(state=rollout.state, from_=rollout.from_, to=rollout.to,
                            reason=rollout.reason if rollout.reason else UNSET) if rollout else UNSET,
            error=rt.error if rt.error else UNSET, url=url if url is not None else UNSET,
            replicas=[r.wire() for r in replicas], created_at=svc.created, updated_at=svc.updated,
        )  # fmt: skip

    # -- what the traffic front asks --------------------------------------------------------------------

    def view(self, service_id: str) -> list[ReplicaRuntime]:
        """The service's replicas and their health: the controller's own on the leader (its checks), else the
        records as the leader last wrote them (``ReplicaRecord.state``, kept in step across replicas)."""
        if self._started:
            rt = self.runtimes.get(service_id)
            return list(rt.replicas.values()) if rt is not None else []
        return [
            ReplicaRuntime(
                rec, state=rec.state, last_check=rec.checked, last_error=rec.last_error, started=0.0
            )
            for rec in self.db.replicas_of(service_id)
        ]

    def pick(self, service_id: str) -> list[ReplicaRuntime]:
        """The service's healthy replicas, rotated so that successive requests start at the next one; those this
        gateway failed to reach lately (:meth:`mark_down`) come last, tried only when the others fail."""
        ready = [r for r in self.view(service_id) if r.state == "healthy"]
        if not ready:
            return []
        turn = self._turns[service_id] = (self._turns.get(service_id, 0) + 1) % len(ready)
        ordered = ready[turn:] + ready[:turn]
        if self._unreachable:
            now = self.clock()
            for sandbox, until in list(self._unreachable.items()):
                if until <= now:
                    del self._unreachable[sandbox]
            ordered.sort(key=lambda r: r.rec.sandbox in self._unreachable)  # stable: the rotation is kept
        return ordered

    def mark_down(self, sandbox: str) -> None:
        """A request could not reach replica ``sandbox``: try it last for :data:`DOWN_SECS` (or until a request
        reaches it again), whatever the health checks (the leader's, maybe on another gateway) say yet."""
        self._unreachable[sandbox] = self.clock() + DOWN_SECS

    def mark_up(self, sandbox: str) -> None:
        """A request reached replica ``sandbox``: it is no longer tried last."""
        if self._unreachable:
            self._unreachable.pop(sandbox, None)

    def owner_has_access(self, svc: ServiceRecord) -> bool:
        return auth.has_access(self.store, svc.user, svc.tenant)

    # -- revocation ------------------------------------------------------------------------------------

    async def access_changed(self) -> None:
        """Keys or memberships changed: a service whose owner holds no active key in its tenant any more stops
        taking traffic at once (its open requests are ended) and gets no new replica; its replicas stay."""
        services = list(self.db.services.values())
        for svc in services:
            allowed = self.owner_has_access(svc)
            was = self._access.get(svc.id, True)
            if was and not allowed:
                # Every replica ends the open requests it relays; the one running the controller audits it.
                log.warning("service owner lost access: traffic stopped", extra={"service": svc.id})
                if self._started:
                    self.audit.record_audit(kind="revocation", type="service.revoked", user=svc.user,
                                            tenant=svc.tenant or None, target=svc.name, result="stopped")  # fmt: skip
                for fn in self.on_access_lost:
                    fn(svc.id)
            elif allowed and not was:
                self._wake(svc.id)
            self._access[svc.id] = allowed
        known = {svc.id for svc in services}
        for gone in [i for i in self._access if i not in known]:
            del self._access[gone]

    # -- the control loop -------------------------------------------------------------------------------

    def _wake(self, service_id: str) -> None:
        rt = self.runtimes.get(service_id)
        if rt is not None:
            rt.wake.set()

    async def _run(self, rt: ServiceRuntime) -> None:
        while True:
            try:
                await self._step(rt)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("service step failed", extra={"service": rt.id})
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(STEP_SECS):
                    await rt.wake.wait()
            rt.wake.clear()

    def _down(self, node: Node) -> bool:
        """Whether ``node`` stopped answering (as the registry declares it: failed polls in a row)."""
        return not node.healthy and node.failures >= self.registry.failures_unhealthy

    async def _step(self, rt: ServiceRuntime) -> None:
        svc = self.db.services.get(rt.id)
        if svc is None:
            return
        for rep in list(rt.replicas.values()):
            node = self.registry.get(rep.rec.node)
            if node is None:
                await self._forget(rt, rep)
            elif rep.state == "lost" and node.healthy:
                await self._end(svc, rep)
                await self._forget(rt, rep)
            elif rep.state != "lost" and self._down(node):
                log.warning("replica lost with its node", extra={"service": svc.id, "node": node.name})
                self._stop_watch(rep)
                await self._set_state(rt.id, rep, "lost", now_rfc3339())
                svc = await self._restarted(svc, rt, rep)
        rollout = svc.rollout
        rolling = rollout is not None and rollout.state == "in_progress"
        if rollout is not None and rolling and time.time() - rollout.started > self.rollout_timeout_secs:
            svc = await self._fail_rollout(
                svc, f"the rollout did not finish within {self.rollout_timeout_secs:g} s"
            )
            rolling = False
        step = plan(svc.desired, svc.revision, svc.serving, rolling, [r.view() for r in rt.replicas.values()])
        for sandbox in step.terminate:
            rep = rt.replicas[sandbox]
            replaced = rep.state == "unhealthy"
            if replaced:
                svc = await self._restarted(svc, rt, rep)
                if rolling and rep.rec.revision == svc.revision and not rep.rec.ever_healthy:
                    svc = await self._rollout_setback(svc, rep.last_error or "it never became healthy")
            self._stop_watch(rep)
            await self._end(svc, rep)
            await self._forget(rt, rep)
        if rolling != (svc.rollout is not None and svc.rollout.state == "in_progress"):
            rt.wake.set()  # the rollout failed on the way: plan again from what is left
            return
        if step.done and rolling:
            await self._finish_rollout(svc)
        elif step.create:
            await self._create_replicas(svc, rt, step.create)

    async def _create_replicas(self, svc: ServiceRecord, rt: ServiceRuntime, wanted: dict[int, int]) -> None:
        if self.clock() < rt.next_create:
            return
        if not self.owner_has_access(svc):
            rt.error = "the service's owner holds no active key in its tenant: no new replicas are made"
            return
        revisions = [revision for revision, count in wanted.items() for _ in range(count)]
        results: list[BaseException | None] = []
        if svc.spec.placement is UNSET:
            made = [self._create_one(svc, rt, revision) for revision in revisions]
            results = list(await asyncio.gather(*made, return_exceptions=True))
        else:  # one at a time, so that each is placed knowing where the others went
            for revision in revisions:
                try:
                    await self._create_one(svc, rt, revision)
                    results.append(None)
                except Exception as exc:  # noqa: BLE001 - reported below, as gather would
                    results.append(exc)
        problems = [r for r in results if isinstance(r, BaseException)]
        if not problems:
            rt.error = None
            rt.backoff = BACKOFF_FIRST_SECS
            return
        first = problems[0]
        message = first.message if isinstance(first, SandboxError) else f"{type(first).__name__}: {first}"
        if not isinstance(first, SandboxError):
            log.error("replica create failed", extra={"service": svc.id, "error": message})
        rt.error = f"cannot make a replica now: {message}"
        rt.next_create = self.clock() + rt.backoff
        rt.backoff = min(rt.backoff * 2, BACKOFF_MAX_SECS)
        counted = [p for p in problems if not isinstance(p, (Unavailable, OverQuota))]
        current = self.db.services.get(svc.id)
        rolling = (
            current is not None and current.rollout is not None and current.rollout.state == "in_progress"
        )
        if counted and rolling and current is not None and current.revision in wanted:
            await self._rollout_setback(current, message)

    async def _create_one(self, svc: ServiceRecord, rt: ServiceRuntime, revision: int) -> None:
        spec = self.db.revisions[(svc.id, revision)]
        secret_env = self.secrets.values(svc.tenant, spec.secrets or ())
        avoid: set[str] = set()
        if svc.spec.placement is not UNSET:
            avoid = {r.rec.node for r in rt.replicas.values() if r.state in ("starting", "healthy")}
        labels = {SERVICE_LABEL: svc.name, REVISION_LABEL: str(revision), SERVICE_ID_LABEL: svc.id}
        sandbox, node_name = await self.sandboxes.create(
            Principal.owner(svc.user, svc.tenant),
            create_request(spec.image, spec.resources, spec.env or {}, spec.network, secret_env=secret_env),
            gateway_labels=labels, avoid=avoid,
        )  # fmt: skip
        inherited = rt.pending_restarts.get(revision) or []
        rec = ReplicaRecord(
            sandbox=sandbox.id, service=svc.id, node=node_name, revision=revision, pid=None,
            restarts=inherited.pop(0) if inherited else 0, ever_healthy=False, created=sandbox.created_at,
        )  # fmt: skip
        await self.db.put_replica(rec)
        rep = ReplicaRuntime(rec, started=self.clock())
        if self.runtimes.get(svc.id) is not rt:  # deleted meanwhile
            await self._end(svc, rep)
            return
        rt.replicas[rec.sandbox] = rep
        self.metrics.created.inc()
        await self._ensure_started(svc, rep)
        self._watch(rt, rep)

    async def _ensure_started(self, svc: ServiceRecord, rep: ReplicaRuntime) -> None:
        """Start the replica's command, or adopt the process a gateway stopped before recording it started."""
        if rep.rec.pid is not None:
            return
        spec = self.db.revisions.get((svc.id, rep.rec.revision))
        node = self.registry.get(rep.rec.node)
        if spec is None or spec.command is UNSET or node is None or not node.healthy:
            return
        try:
            running = [p for p in await node.client.processes(rep.rec.sandbox) if p.argv == spec.command]
            if running:
                pid = running[-1].pid
            else:
                # The secrets go with the command too: the node holds the replica's secret environment in memory
                # only, and one restarted since the create would start the command without it.
                secret_env = self.secrets.values(svc.tenant, spec.secrets or ())
                request = ProcessRequest(argv=spec.command, env=secret_env or UNSET)
                pid = (await node.client.start_process(rep.rec.sandbox, request)).pid
        except SandboxError as exc:
            rep.last_error = f"the command could not start: {exc.message}"
            await self._set_state(svc.id, rep, "unhealthy", now_rfc3339())
            self._wake(svc.id)
            return
        rep.rec = dataclasses.replace(rep.rec, pid=pid)
        rep.started = self.clock()
        await self.db.put_replica(rep.rec)

    async def _restarted(self, svc: ServiceRecord, rt: ServiceRuntime, rep: ReplicaRuntime) -> ServiceRecord:
        """``rep`` is being replaced: one more restart for the service and for the replica's slot."""
        rt.pending_restarts.setdefault(rep.rec.revision, []).append(rep.rec.restarts + 1)
        self.metrics.restarts.inc()
        changed = await self._change(svc.id, lambda s: dataclasses.replace(s, restarts=s.restarts + 1,
                                                                          updated=now_rfc3339()))  # fmt: skip
        return changed or svc

    @staticmethod
    def _rolling_to(svc: ServiceRecord, revision: int) -> RolloutRecord | None:
        """The rollout in progress to ``revision``, if that is still the one (a PUT may have started another)."""
        rollout = svc.rollout
        if rollout is None or rollout.state != "in_progress" or rollout.to != revision:
            return None
        return rollout

    async def _rollout_setback(self, svc: ServiceRecord, why: str) -> ServiceRecord:
        """A new-revision replica failed before it was ever healthy: the second fails the rollout."""

        def change(s: ServiceRecord) -> ServiceRecord | None:
            rollout = self._rolling_to(s, svc.revision)
            if rollout is None:
                return None
            failures = rollout.failures + 1
            if failures < ROLLOUT_FAILURES:
                return dataclasses.replace(s, rollout=dataclasses.replace(rollout, failures=failures))
            return self._failed(s, rollout, f"revision {rollout.to} never became healthy ({failures} replicas "
                                            f"failed; last: {why})")  # fmt: skip

        return await self._change(svc.id, change) or svc

    async def _fail_rollout(self, svc: ServiceRecord, reason: str) -> ServiceRecord:
        def change(s: ServiceRecord) -> ServiceRecord | None:
            rollout = self._rolling_to(s, svc.revision)
            return self._failed(s, rollout, reason) if rollout is not None else None

        return await self._change(svc.id, change) or svc

    def _failed(self, svc: ServiceRecord, rollout: RolloutRecord, reason: str) -> ServiceRecord:
        log.warning("rollout failed", extra={"service": svc.id, "to": rollout.to, "reason": reason})
        self.metrics.rollouts.labels("failed").inc()
        return dataclasses.replace(svc, rollout=dataclasses.replace(rollout, state="failed", reason=reason),
                                   updated=now_rfc3339())  # fmt: skip

    async def _finish_rollout(self, svc: ServiceRecord) -> None:
        def change(s: ServiceRecord) -> ServiceRecord | None:
            rollout = self._rolling_to(s, svc.revision)
            if rollout is None or s.revision != svc.revision:
                return None  # another PUT came meanwhile: the next step plans for it
            log.info("rollout done", extra={"service": s.id, "to": s.revision})
            self.metrics.rollouts.labels("done").inc()
            return dataclasses.replace(s, serving=s.revision, rollout=dataclasses.replace(rollout, state="done"),
                                       updated=now_rfc3339())  # fmt: skip

        done = await self._change(svc.id, change)
        if done is not None and done.serving == svc.revision:
            await self.db.forget_revisions_before(svc.id, svc.revision)

    async def _end(self, svc: ServiceRecord | str, rep: ReplicaRuntime) -> None:
        """Terminate ``rep``'s sandbox when its node answers (else it is ended when the node is seen again)."""
        self._stop_watch(rep)
        node = self.registry.get(rep.rec.node)
        if node is None or not node.healthy:
            return
        try:
            await node.client.delete_sandbox(rep.rec.sandbox)
        except NotFound:
            pass
        except SandboxError as exc:
            service_id = svc if isinstance(svc, str) else svc.id
            log.warning("replica not ended", extra={"service": service_id, "sandbox": rep.rec.sandbox,
                                                    "error": exc.message})  # fmt: skip
            return
        record = self.store.sandboxes.get(rep.rec.sandbox)
        if record is not None:
            await self.sandboxes.terminated(record)

    async def _forget(self, rt: ServiceRuntime, rep: ReplicaRuntime) -> None:
        self._stop_watch(rep)
        rt.replicas.pop(rep.rec.sandbox, None)
        await self.db.forget_replica(rep.rec.sandbox)

    # -- health ----------------------------------------------------------------------------------------

    async def _set_state(
        self, service_id: str, rep: ReplicaRuntime, state: ReplicaState, checked: str | None
    ) -> None:
        """``rep`` is now ``state`` (from the check run at ``checked``): memory at once, then the record, which
        every other replica routes by. A record that cannot be written now (the database away) leaves the others
        on the last state written; the replica's next change writes again."""
        rep.state = state
        try:
            await self.db.put_health(
                rep.rec.sandbox, state, rep.last_error if state != "healthy" else None, checked
            )
        except SandboxError as exc:
            log.warning("replica health not recorded", extra={"service": service_id, "sandbox": rep.rec.sandbox,
                                                              "state": state, "error": exc.message})  # fmt: skip

    def _watch(self, rt: ServiceRuntime, rep: ReplicaRuntime) -> None:
        if rep.checker is None and rep.state in ("starting", "healthy"):
            rep.checker = asyncio.create_task(self._checks(rt, rep), name=f"health-{rep.rec.sandbox}")

    @staticmethod
    def _stop_watch(rep: ReplicaRuntime) -> None:
        task, rep.checker = rep.checker, None
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    async def _checks(self, rt: ServiceRuntime, rep: ReplicaRuntime) -> None:
        while rep.state in ("starting", "healthy"):
            svc = self.db.services.get(rt.id)
            spec = self.db.revisions.get((rt.id, rep.rec.revision))
            if svc is None or spec is None:
                return
            check = spec.health if spec.health is not UNSET else None
            every = (
                float(check.every_secs)
                if check is not None and check.every_secs is not UNSET
                else DEFAULT_EVERY_SECS
            )
            allowed = (
                check.failures if check is not None and check.failures is not UNSET else DEFAULT_FAILURES
            )
            await asyncio.sleep(min(every, STARTING_CHECK_SECS) if rep.state == "starting" else every)
            node = self.registry.get(rep.rec.node)
            if node is None or not node.healthy:
                continue  # a node not answering is the step's business (lost), not a failed check
            if rep.rec.pid is None:
                await self._ensure_started(svc, rep)
                continue
            port = spec.port if spec.port is not UNSET else None
            outcome = await health.check(node.client, rep.rec.sandbox, rep.rec.pid, port, check)
            rep.last_check = now_rfc3339()
            if outcome.problem is None:
                rep.failures = 0
                rep.last_error = None
                if rep.state != "healthy":
                    if not rep.rec.ever_healthy:
                        rep.rec = dataclasses.replace(rep.rec, ever_healthy=True)
                        await self.db.put_replica(rep.rec)
                    await self._set_state(rt.id, rep, "healthy", rep.last_check)
                    self._wake(rt.id)
                continue
            rep.failures += 1
            rep.last_error = outcome.problem
            grace_over = self.clock() - rep.started >= every * allowed
            if (
                outcome.final
                or (rep.state == "healthy" and rep.failures >= allowed)
                or (rep.state == "starting" and grace_over)
            ):
                log.info("replica unhealthy", extra={"service": rt.id, "sandbox": rep.rec.sandbox,
                                                     "error": outcome.problem})  # fmt: skip
                rep.checker = None
                await self._set_state(rt.id, rep, "unhealthy", rep.last_check)
                self._wake(rt.id)
                return

    # -- sandboxes the records do not know ----------------------------------------------------------

    async def _node_back(self, node: Node) -> None:
        """A node answers (again): end the sandboxes of services that no longer exist, or that were never
        recorded long enough ago."""
        if self._started:
            await self._sweep_node(node, adopt=False)
            for rt in self.runtimes.values():
                if any(r.rec.node == node.name for r in rt.replicas.values()):
                    rt.wake.set()

    async def _sweep_node(self, node: Node, adopt: bool) -> None:
        try:
            listing = await node.client.sandboxes()
        except SandboxError as exc:
            log.warning("service sweep skipped a node", extra={"node": node.name, "error": exc.message})
            return
        for sandbox in listing:
            service_id = sandbox.labels.get(SERVICE_ID_LABEL)
            if service_id is None or sandbox.state == "terminated" or sandbox.id in self.db.replicas:
                continue
            svc = self.db.services.get(service_id)
            rt = self.runtimes.get(service_id)
            revision = _revision_of(sandbox)
            if adopt and svc is not None and rt is not None and revision is not None \
                    and (svc.id, revision) in self.db.revisions:  # fmt: skip
                rec = ReplicaRecord(
                    sandbox.id, svc.id, node.name, revision, None, 0, False, sandbox.created_at
                )
                await self.db.put_replica(rec)
                rt.replicas[rec.sandbox] = ReplicaRuntime(rec, started=self.clock())
                log.info("replica adopted from its labels", extra={"service": svc.id, "sandbox": sandbox.id})
                continue
            if not adopt and not older_than(sandbox.created_at, ORPHAN_AGE_SECS):
                continue
            await self.sandboxes.end_orphan(node, sandbox.id, "ending a sandbox of no current replica")

    def replicas_total(self) -> Iterable[ReplicaRuntime]:
        for rt in list(self.runtimes.values()):
            yield from list(rt.replicas.values())


def _revision_of(sandbox: Sandbox) -> int | None:
    text = sandbox.labels.get(REVISION_LABEL, "")
    return int(text) if text.isdigit() else None


def _log_failure(task: asyncio.Future[Any]) -> None:
    """A record's change that ran on after its caller was cancelled: an error of it goes to the log."""
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("a service record's change failed after its caller went", exc_info=exc)

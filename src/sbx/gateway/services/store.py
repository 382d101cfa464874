"""Services in the state file: the service rows, each revision's spec, the replicas (tables ``services``,
``service_revisions``, ``service_replicas``; see ``sbx.gateway.state``).

Everything is also held in memory (the controller and the traffic front read memory only); a write commits
first and changes memory after, through the gateway's writer thread. A replica is recorded as soon as its
sandbox exists, before its command starts, so a gateway stopped in between finds it again (and a sandbox made
but never recorded is found by its labels; see ``controller``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec

from sbx.api.services import ReplicaState, RolloutState, ServiceSpec
from sbx.gateway.store import TABLES, Delete, Store, Update, Upsert

Writer = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class RolloutRecord:
    """The latest rollout: ``started`` (Unix time) bounds it by ``--rollout-timeout``; ``failures`` counts
    new-revision replicas replaced before they were ever healthy."""

    state: RolloutState
    from_: int
    to: int
    started: float
    failures: int = 0
    reason: str | None = None


@dataclass(frozen=True)
class ServiceRecord:
    """A service as kept: ``spec`` the latest one asked for (env included, defaults filled in)."""

    id: str
    tenant: str
    name: str
    user: str
    spec: ServiceSpec
    revision: int
    serving: int
    desired: int
    restarts: int
    rollout: RolloutRecord | None
    created: str
    updated: str


@dataclass(frozen=True)
class ReplicaRecord:
    """One replica: its sandbox, node and revision; ``pid`` of its command once started; ``restarts`` of its
    slot; ``ever_healthy`` once a health check passed (a rollout counts replicas replaced before that).

    ``state``, ``last_error`` and ``checked`` are its health as the leader's checks last found it: written by
    :meth:`ServiceStore.put_health` when the state changes (not at every check), read by every replica to route
    the service's traffic and show its replicas (a follower runs no checks; docs/ha.md)."""

    sandbox: str
    service: str
    node: str
    revision: int
    pid: int | None
    restarts: int
    ever_healthy: bool
    created: str
    state: ReplicaState = "starting"
    last_error: str | None = None
    #: When the check that set ``state`` ran (RFC 3339).
    checked: str | None = None


_ROLLOUT = msgspec.json.Decoder(dict[str, Any])


def _rollout_json(rollout: RolloutRecord | None) -> str | None:
    return None if rollout is None else msgspec.json.encode(dataclasses.asdict(rollout)).decode()


def _rollout_of(text: str | None) -> RolloutRecord | None:
    return None if text is None else RolloutRecord(**_ROLLOUT.decode(text))


class ServiceStore:
    """The three tables and their in-memory copies."""

    def __init__(self, store: Store, write: Writer) -> None:
        self.store = store
        self._write = write
        self.services: dict[str, ServiceRecord] = {}
        self.revisions: dict[tuple[str, int], ServiceSpec] = {}
        self.replicas: dict[str, ReplicaRecord] = {}
        # Memory is a copy of the tables, kept in step with other replicas' writes (``Store.mirror``).
        store.mirror("services", self._put_service, lambda k: self.services.pop(k[0], None),
                     self.services.clear)  # fmt: skip
        store.mirror("service_revisions", self._put_revision,
                     lambda k: self.revisions.pop((k[0], k[1]), None), self.revisions.clear)  # fmt: skip
        store.mirror("service_replicas", self._put_replica, lambda k: self.replicas.pop(k[0], None),
                     self.replicas.clear)  # fmt: skip
        for table in ("services", "service_revisions", "service_replicas"):
            for row in store.query(table, TABLES[table].columns):
                store.mirrors[table].put(row)

    def _put_service(self, row: tuple[Any, ...]) -> None:
        self.services[row[0]] = ServiceRecord(
            id=row[0], tenant=row[1], name=row[2], user=row[3], spec=msgspec.json.decode(row[4], type=ServiceSpec),
            revision=row[5], serving=row[6], desired=row[7], restarts=row[8], rollout=_rollout_of(row[9]),
            created=row[10], updated=row[11],
        )  # fmt: skip

    def _put_revision(self, row: tuple[Any, ...]) -> None:
        self.revisions[(row[0], row[1])] = msgspec.json.decode(row[2], type=ServiceSpec)

    def _put_replica(self, row: tuple[Any, ...]) -> None:
        self.replicas[row[0]] = ReplicaRecord(
            sandbox=row[0], service=row[1], node=row[2], revision=row[3], pid=row[4], restarts=row[5],
            ever_healthy=bool(row[6]), created=row[7], state=row[8], last_error=row[9], checked=row[10],
        )  # fmt: skip

    def by_name(self, tenant: str, name: str) -> ServiceRecord | None:
        for svc in list(self.services.values()):
            if svc.tenant == tenant and svc.name == name:
                return svc
        return None

    def replicas_of(self, service_id: str) -> list[ReplicaRecord]:
        return [r for r in list(self.replicas.values()) if r.service == service_id]

    @staticmethod
    def _service_row(svc: ServiceRecord) -> Upsert:
        return Upsert("services", {
            "id": svc.id, "tenant": svc.tenant, "name": svc.name, "user": svc.user,
            "spec": msgspec.json.encode(svc.spec).decode(), "revision": svc.revision, "serving": svc.serving,
            "desired": svc.desired, "restarts": svc.restarts, "rollout": _rollout_json(svc.rollout),
            "created": svc.created, "updated": svc.updated,
        })  # fmt: skip

    async def put_service(self, svc: ServiceRecord, new_revision: ServiceSpec | None = None) -> None:
        """Write ``svc`` (and the spec of its new revision ``svc.revision``)."""
        statements = [self._service_row(svc)]
        if new_revision is not None:
            statements.append(Upsert("service_revisions", {
                "service": svc.id, "revision": svc.revision, "spec": msgspec.json.encode(new_revision).decode(),
            }))  # fmt: skip
        await self._write(self.store.execute, statements)
        self.services[svc.id] = svc
        if new_revision is not None:
            self.revisions[(svc.id, svc.revision)] = new_revision

    async def forget_revisions_before(self, service_id: str, revision: int) -> None:
        """Drop the specs of revisions older than ``revision`` (no replica runs them any more)."""
        await self._write(
            self.store.execute,
            [Delete("service_revisions", {"service": service_id}, below={"revision": revision})],
        )
        for key in [k for k in list(self.revisions) if k[0] == service_id and k[1] < revision]:
            self.revisions.pop(key, None)

    async def delete_service(self, service_id: str) -> None:
        await self._write(self.store.execute, [
            Delete("services", {"id": service_id}),
            Delete("service_revisions", {"service": service_id}),
            Delete("service_replicas", {"service": service_id}),
        ])  # fmt: skip
        self.services.pop(service_id, None)
        for key in [k for k in list(self.revisions) if k[0] == service_id]:
            self.revisions.pop(key, None)
        for sandbox in [r.sandbox for r in self.replicas_of(service_id)]:
            self.replicas.pop(sandbox, None)

    async def put_replica(self, rep: ReplicaRecord) -> None:
        """Write the replica's record; its health (``state``, ``last_error``, ``checked``) is left as it is
        (``put_health`` writes it), a new one starting as ``starting``."""
        await self._write(self.store.execute, [Upsert("service_replicas", {
            "sandbox": rep.sandbox, "service": rep.service, "node": rep.node, "revision": rep.revision,
            "pid": rep.pid, "restarts": rep.restarts, "ever_healthy": int(rep.ever_healthy), "created": rep.created,
        })], False)  # fmt: skip
        old = self.replicas.get(rep.sandbox)
        if old is not None:
            rep = dataclasses.replace(rep, state=old.state, last_error=old.last_error, checked=old.checked)
        else:
            rep = dataclasses.replace(rep, state="starting", last_error=None, checked=None)
        self.replicas[rep.sandbox] = rep

    async def put_health(
        self, sandbox: str, state: ReplicaState, last_error: str | None, checked: str | None
    ) -> None:
        """Record the replica's health as the leader's checks found it (a change of state only: a few writes in
        a replica's life, whatever its check interval). Not durable at once (``full=False``): a health state lost
        to a database crash is found again by the next leader's checks."""
        await self._write(self.store.execute, [Update(
            "service_replicas", {"state": state, "last_error": last_error, "checked": checked}, {"sandbox": sandbox}
        )], False)  # fmt: skip
        old = self.replicas.get(sandbox)
        if old is not None:
            self.replicas[sandbox] = dataclasses.replace(
                old, state=state, last_error=last_error, checked=checked
            )

    async def forget_replica(self, sandbox: str) -> None:
        await self._write(self.store.execute, [Delete("service_replicas", {"sandbox": sandbox})], False)
        self.replicas.pop(sandbox, None)

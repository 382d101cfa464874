"""The services' controller and traffic front and the ports' front built from stand-ins of the interfaces they are
given (issue 34, docs/architecture.md), with no gateway: leadership asked at each call, the locks a create holds,
what a replica's create sends to the sandbox service, the backoff on the given clock, and the port front's
look-ups, credentials, audit and sweep."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import msgspec
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request
from prometheus_client import CollectorRegistry
from stand_ins import Audit, Clock, Leader, Locks, Writes
from wire_samples import sandbox_body

from sbx.api.errors import Conflict, InvalidRequest, NotFound, SandboxError, Unauthorized, Unavailable
from sbx.api.sandboxes import CreateRequest, Sandbox
from sbx.api.services import ServiceSpec
from sbx.gateway import keys
from sbx.gateway.auth import Principal
from sbx.gateway.keys import hash_secret
from sbx.gateway.nodes import Node, Registry
from sbx.gateway.ports.front import PortFront
from sbx.gateway.ports.labels import label_for
from sbx.gateway.ports.store import PortStore, PortTokenRecord
from sbx.gateway.quotas import OverQuota
from sbx.gateway.services import controller as controller_module
from sbx.gateway.services.controller import ServiceController, ServiceRuntime
from sbx.gateway.services.proxy import ServiceFront
from sbx.gateway.services.public import PublicConnections
from sbx.gateway.services.store import ReplicaRecord
from sbx.gateway.state import SandboxRecord
from sbx.gateway.store.sqlite import SqliteStore

T = TypeVar("T")
T0 = "2026-01-01T00:00:00Z"
SANDBOX = "sbx_0123456789abcdef"
DOMAIN = "ports.test"


@dataclass
class Sandboxes:
    """The sandbox service: each create answers the next of ``answers`` (an error raised, else a sandbox)."""

    answers: list[SandboxError | None] = field(default_factory=list)
    made: list[tuple[Principal, CreateRequest, dict[str, str], set[str]]] = field(default_factory=list)

    async def create(
        self, principal: Principal, req: CreateRequest, *, gateway_labels: Mapping[str, str] | None = None,
        avoid: Collection[str] = (),
    ) -> tuple[Sandbox, str]:  # fmt: skip
        answer = self.answers.pop(0) if self.answers else None
        if answer is not None:
            raise answer
        self.made.append((principal, req, dict(gateway_labels or {}), set(avoid)))
        body = sandbox_body(id=f"sbx_{len(self.made):016x}", created_at=T0)
        return msgspec.convert(body, Sandbox), "gone-node"

    async def terminated(self, rec: SandboxRecord) -> None:
        raise AssertionError("no replica is ended in these tests")

    async def end_orphan(self, node: Node, sandbox_id: str, why: str) -> None:
        raise AssertionError("no orphan is ended in these tests")


class Secrets:
    def check_names(self, tenant: str, names: Iterable[str], field: str = "secrets") -> list[str]:
        return list(names)

    def values(self, tenant: str, names: Iterable[str]) -> dict[str, str]:
        return {name: f"{tenant}:{name}" for name in names}


@dataclass
class Parts:
    store: SqliteStore
    locks: Locks
    leader: Leader
    audit: Audit
    clock: Clock
    sandboxes: Sandboxes
    ctl: ServiceController


@pytest.fixture
async def parts(tmp_path: Path) -> AsyncIterator[Parts]:
    store = SqliteStore.open(tmp_path / "gw.db")
    locks, leader, audit, clock, sandboxes = Locks(), Leader(), Audit(), Clock(), Sandboxes()
    ctl = ServiceController(
        store, Writes(), Registry(poll_interval_secs=60, failures_unhealthy=3, lost_after_secs=60), sandboxes,
        Secrets(), locks=locks, leadership=leader, audit=audit, metrics=CollectorRegistry(), clock=clock,
    )  # fmt: skip
    try:
        yield Parts(store, locks, leader, audit, clock, sandboxes, ctl)
    finally:
        await ctl.close()
        store.close()


def spec(name: str = "web", **more: Any) -> ServiceSpec:
    body = {"name": name, "image": "debian", "command": ["serve"], "replicas": 1, **more}
    return msgspec.convert(body, ServiceSpec)


async def test_a_create_holds_its_names_lock_and_starts_a_task_only_while_leading(parts: Parts) -> None:
    alice = Principal.owner("alice", "acme")
    first = await parts.ctl.create(alice, spec("one"))
    parts.leader.leading = False  # lost since the controller was built: asked again, not remembered
    second = await parts.ctl.create(alice, spec("two"))
    assert parts.locks.held == [(("service", "acme/one"),), (("service", "acme/two"),)]
    assert first.id in parts.ctl.runtimes and second.id not in parts.ctl.runtimes
    with pytest.raises(Conflict):
        await parts.ctl.create(alice, spec("two"))
    assert [s.name for s in parts.ctl.listing(alice)] == ["one", "two"]


async def test_a_replica_is_made_through_the_sandbox_service_for_its_owner(parts: Parts) -> None:
    alice = Principal.owner("alice", "acme")
    parts.store.add_key(keys.new_key("alice", "acme", {"sandbox:write"})[0])
    parts.leader.leading = False  # no task of its own: the test takes the step
    svc = await parts.ctl.create(alice, spec(secrets=["TOKEN"], env={"A": "1"}))
    rt = parts.ctl.runtimes[svc.id] = ServiceRuntime(svc.id)
    await parts.ctl._step(rt)
    ((principal, req, labels, avoid),) = parts.sandboxes.made
    assert (principal.user, principal.tenant) == ("alice", "acme")
    assert labels == {"gateway.service": "web", "gateway.service.rev": "1", "gateway.service.id": svc.id}
    assert avoid == set()
    assert req.env == {"A": "1"} and req.secret_env == {"TOKEN": "acme:TOKEN"}
    assert [r.rec.node for r in rt.replicas.values()] == ["gone-node"]
    assert rt.error is None


@pytest.mark.parametrize(("answers", "waits"), [
    ([Unavailable("no node has room")], [1.0]),
    ([OverQuota("over quota"), OverQuota("over quota")], [1.0, 2.0]),
    ([InvalidRequest("bad image")] * 6, [1.0, 2.0, 4.0, 8.0, 16.0, 30.0]),  # doubling, up to 30 s
])  # fmt: skip
async def test_a_create_the_nodes_refuse_is_retried_later_on_the_given_clock(
    parts: Parts, answers: list[SandboxError], waits: list[float]
) -> None:
    alice = Principal.owner("alice", "")
    parts.store.add_key(keys.new_key("alice", "", {"sandbox:write"})[0])
    parts.leader.leading = False
    svc = await parts.ctl.create(alice, spec())
    rt = parts.ctl.runtimes[svc.id] = ServiceRuntime(svc.id)
    parts.sandboxes.answers = list(answers)
    for wait, problem in zip(waits, answers, strict=True):
        await parts.ctl._step(rt)
        assert rt.error == f"cannot make a replica now: {problem.message}"
        assert rt.next_create == parts.clock.now + wait
        parts.clock.now += wait - 0.001
        await parts.ctl._step(rt)  # too early: nothing asked
        parts.clock.now += 0.001
    assert parts.sandboxes.answers == [] and parts.sandboxes.made == []
    await parts.ctl._step(rt)
    assert len(parts.sandboxes.made) == 1 and rt.error is None


async def test_no_replica_is_made_while_the_owner_holds_no_key(parts: Parts) -> None:
    parts.leader.leading = False
    svc = await parts.ctl.create(Principal.owner("alice", ""), spec())
    rt = parts.ctl.runtimes[svc.id] = ServiceRuntime(svc.id)
    await parts.ctl._step(rt)
    assert parts.sandboxes.made == [] and rt.error is not None and "no active key" in rt.error


async def test_a_replica_not_reached_is_tried_last_until_the_clock_passes(
    parts: Parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(controller_module, "DOWN_SECS", 10.0)
    parts.leader.leading = False
    svc = await parts.ctl.create(Principal.owner("alice", ""), spec())
    for sandbox in ("r1", "r2"):
        await parts.ctl.db.put_replica(ReplicaRecord(sandbox, svc.id, "n1", 1, 7, 0, True, T0))
        await parts.ctl.db.put_health(sandbox, "healthy", None, T0)
    parts.ctl.mark_down("r1")
    firsts = []
    for step in (0.0, 5.0, 4.5, 0.5, 0.0):
        parts.clock.now += step
        firsts.append([r.rec.sandbox for r in parts.ctl.pick(svc.id)])
    # Last whatever the turn while its 10 s last, then in turn again (the rotation alternates).
    assert firsts == [["r2", "r1"], ["r2", "r1"], ["r2", "r1"], ["r1", "r2"], ["r2", "r1"]]


# -- the services' traffic front ----------------------------------------------------------------------------


async def test_the_service_front_is_told_when_an_owner_loses_access(parts: Parts) -> None:
    front = ServiceFront(
        parts.store, parts.ctl.registry, parts.ctl, "svc.test", PublicConnections(), fresh=Fresh()
    )
    key = keys.new_key("alice", "", {"sandbox:read"})[0]
    parts.store.add_key(key)
    svc = await parts.ctl.create(Principal.owner("alice", ""), spec(port=8080))
    told: list[str] = []
    parts.ctl.on_access_lost.insert(0, told.append)
    parts.ctl.on_access_lost.append(told.append)
    assert front.end_service in parts.ctl.on_access_lost
    request = make_mocked_request("GET", "/", headers={"Host": "gw.test"})
    assert front.url(svc, request) == "http://web.svc.test/"
    parts.store.revoke_key(key.id)
    await parts.ctl.access_changed()
    assert told == [svc.id, svc.id]  # the test's, then the front's own (which ends its open requests)
    # Only a started controller (the leader's) audits the revocation.
    assert parts.audit.entries == []


async def test_the_service_front_catches_up_before_it_looks_at_a_request(parts: Parts) -> None:
    """A service made through another replica a moment ago is found by the very next request here (docs/ha.md):
    the front catches up before it looks the service up and decides who may call."""
    fresh = Fresh()
    front = ServiceFront(
        parts.store, parts.ctl.registry, parts.ctl, "svc.test", PublicConnections(), fresh=fresh
    )

    async def handler(request: web.Request) -> web.StreamResponse:
        raise AssertionError("service traffic is not the API's")

    async def made_elsewhere() -> None:
        await parts.ctl.create(Principal.owner("alice", ""), spec(port=8080))

    request = make_mocked_request("GET", "/", headers={"Host": "web.svc.test"})
    with pytest.raises(NotFound, match="no service 'web' here"):
        await front.middleware(request, handler)
    assert fresh.catch_ups == 1
    fresh.next_catch_up = made_elsewhere
    with pytest.raises(Unauthorized):  # found now: private, and no key
        await front.middleware(make_mocked_request("GET", "/", headers={"Host": "web.svc.test"}), handler)
    assert fresh.catch_ups == 2


# -- the ports' traffic front -------------------------------------------------------------------------------


@dataclass
class Fresh:
    """Look-ups that, after a miss, find what ``arrives`` puts in the store (another replica's write)."""

    arrives: Callable[[], None] | None = None
    misses: int = 0
    #: What the next catch-up brings (another replica's write acknowledged before the request), then nothing.
    next_catch_up: Callable[[], Awaitable[None]] | None = None
    catch_ups: int = 0

    async def fresh(self, lookup: Callable[[], T]) -> T:
        try:
            return lookup()
        except NotFound:
            self.misses += 1
            if self.arrives is None:
                raise
            self.arrives()
        return lookup()

    async def caught_up(self) -> bool:
        self.catch_ups += 1
        arriving, self.next_catch_up = self.next_catch_up, None
        if arriving is not None:
            await arriving()
        return True


class NoNodes:
    def node_for(self, name: str, what: str) -> Node:
        raise Unavailable(f"{what} is on node {name!r}, which is not answering")


class NoWakes:
    async def wake_from(self, rec: SandboxRecord) -> tuple[str, Sandbox] | None:
        raise AssertionError("no sandbox here is asleep")


@dataclass
class Ports:
    store: SqliteStore
    db: PortStore
    fresh: Fresh
    audit: Audit
    leader: Leader
    front: PortFront


@pytest.fixture
async def ports(tmp_path: Path) -> AsyncIterator[Ports]:
    store = SqliteStore.open(tmp_path / "gw.db")
    db = PortStore(store, Writes().write)
    fresh, audit, leader = Fresh(), Audit(), Leader()
    front = PortFront(store, db, DOMAIN, PublicConnections(), fresh=fresh, nodes=NoNodes(), wakes=NoWakes(),
                      audit=audit, leadership=leader)  # fmt: skip
    try:
        yield Ports(store, db, fresh, audit, leader, front)
    finally:
        await front.close()
        store.close()


def sandbox_record(sandbox: str = SANDBOX, user: str = "alice") -> SandboxRecord:
    return SandboxRecord(sandbox, user, "", "n1", None, 1, 256, T0)


async def through(front: PortFront, host: str, path: str = "/", **headers: str) -> web.StreamResponse | str:
    """The front's answer, or the name of the error it raised; ``passed`` when it was not port traffic."""

    async def handler(request: web.Request) -> web.StreamResponse:
        return web.Response(text="passed")

    request = make_mocked_request("GET", path, headers={"Host": host, **headers})
    try:
        return await front.middleware(request, handler)
    except SandboxError as exc:
        return type(exc).__name__


async def test_a_sandbox_another_replica_just_made_is_found_through_the_look_up(ports: Ports) -> None:
    host = f"{label_for(SANDBOX, 8000)}.{DOMAIN}"
    assert await through(ports.front, host) == "NotFound" and ports.fresh.misses == 1
    ports.fresh.arrives = lambda: ports.store.put_sandbox(sandbox_record())
    assert await through(ports.front, host) == "Unauthorized"  # found now: private, and no credential
    assert ports.fresh.misses == 2


async def test_access_is_decided_after_catching_up_with_the_other_replicas(ports: Ports) -> None:
    """A port made public, or private again, through another replica a moment ago counts for the very next
    request here: the front catches up before it looks at the flag (docs/ha.md)."""
    ports.store.put_sandbox(sandbox_record())
    host = f"{label_for(SANDBOX, 8000)}.{DOMAIN}"
    ports.fresh.next_catch_up = lambda: ports.db.set_public(SANDBOX, 8000, True, T0)
    assert await through(ports.front, host) == "Unavailable"  # public: on to its node, silent here
    ports.fresh.next_catch_up = lambda: ports.db.set_public(SANDBOX, 8000, False, T0)
    assert await through(ports.front, host) == "Unauthorized"  # private again: refused at once
    assert ports.fresh.catch_ups == 2
    passed = await through(ports.front, "gw.test")  # not port traffic: no catch-up here
    assert getattr(passed, "text", None) == "passed" and ports.fresh.catch_ups == 2


@pytest.mark.parametrize(("host", "who", "answer"), [
    ("gw.test", None, "passed"),
    (f"nonsense.{DOMAIN}", None, "NotFound"),
    (f"{label_for(SANDBOX, 8000)}.{DOMAIN}", None, "Unauthorized"),
    (f"{label_for(SANDBOX, 8000)}.{DOMAIN}", "bob", "NotFound"),  # another user's key: as for no sandbox
    (f"{label_for(SANDBOX, 8000)}.{DOMAIN}", "alice", "Unavailable"),  # the owner's: on to its node, silent
])  # fmt: skip
async def test_who_opens_a_private_port(ports: Ports, host: str, who: str | None, answer: str) -> None:
    ports.store.put_sandbox(sandbox_record())
    headers = {}
    if who is not None:
        key, secret = keys.new_key(who, "", {"sandbox:read"})
        ports.store.add_key(key)
        headers["Authorization"] = f"Bearer {secret}"
    got = await through(ports.front, host, **headers)
    assert (got if isinstance(got, str) else getattr(got, "text", None)) == answer


async def test_a_token_url_is_traded_for_a_cookie_and_audited(ports: Ports) -> None:
    ports.store.put_sandbox(sandbox_record())
    key = keys.new_key("alice", "", {"sandbox:read"})[0]
    ports.store.add_key(key)
    secret = "sgp_" + "a" * 40
    assert key.id is not None
    await ports.db.add_token(
        PortTokenRecord(hash_secret(secret), SANDBOX, 8000, key.id, "alice", "", 4e9, T0)
    )
    host = f"{label_for(SANDBOX, 8000)}.{DOMAIN}"
    answer = await through(ports.front, host, f"/app?x=1&sbx_port_token={secret}")
    assert not isinstance(answer, str)
    assert (answer.status, answer.headers["Location"]) == (303, "/app?x=1")
    assert secret in answer.headers["Set-Cookie"]
    assert [(a["type"], a["key_id"], a["target"], a["port"]) for a in ports.audit.entries] == [
        ("port.token_traded", key.id, SANDBOX, 8000)
    ]
    ports.store.revoke_key(key.id)
    assert await through(ports.front, host, f"/app?sbx_port_token={secret}") == "Unauthorized"


@pytest.mark.parametrize("leading", [False, True])
async def test_only_the_leader_forgets_the_ports_of_ended_sandboxes(ports: Ports, leading: bool) -> None:
    await ports.db.set_public(SANDBOX, 8000, True, T0)  # its sandbox is unknown: ended
    ports.leader.leading = leading  # after the front was built: asked at the sweep
    await ports.front.access_changed()
    assert ports.db.is_public(SANDBOX, 8000) is not leading

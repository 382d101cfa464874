"""The sandbox service, the snapshots and the wakes built from stand-ins of what they are given (issue 34,
docs/architecture.md; ``sandbox_parts``), with no gateway and no aiohttp application: which node a create goes to,
refusals that write nothing, the quota asked under the tenant's lock, a lost node's names, a snapshot's look-up and
a fork pinned to it, and what a wake and a learnt sleep ask under the tenant's lock.

The HTTP flows of persistent sandboxes (a wake's 403 as the client sees it, the node's calls per route) are
``test_gateway_persistent.py``'s; placement's own strategy is ``test_gateway_placement.py``'s."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from sandbox_parts import T0, client_of, parts, stand_in
from wire_samples import sandbox, snapshot_body

from sbx.api.codec import convert_answer
from sbx.api.errors import BadGateway, Conflict, NotFound, Unavailable
from sbx.api.node import PERSISTENT, SECRET_ENV
from sbx.api.sandboxes import CreateRequest
from sbx.api.snapshots import Snapshot
from sbx.gateway.auth import Principal
from sbx.gateway.nodes import Node
from sbx.gateway.quotas import OverQuota
from sbx.gateway.state import Quota, SandboxRecord, SnapshotRecord
from sbx.gateway.store.sqlite import SqliteStore

pytestmark = pytest.mark.timeout(30)

ALICE = Principal.owner("alice", "acme")
BOB = Principal.owner("bob", "acme")
NAME_LOCK = ("name", "sandbox/alice/acme")
NO_NODE = (
    "no node can take this now (any node: none answering with free capacity and not cordoned); try again later or "
    "ask for fewer resources"
)


@pytest.fixture
def store(tmp_path: Path) -> Iterator[SqliteStore]:
    s = SqliteStore.open(tmp_path / "gw.db")
    yield s
    s.close()


# -- placement -------------------------------------------------------------------------------------------------


def node(name: str, **spec: Any) -> Callable[[], Node]:
    """A stand-in node (``sandbox_parts.stand_in``) made afresh for each test: it records what it is asked."""
    return lambda: stand_in(name, **spec)


NO_ROOM = Unavailable("no room for 1 cpus")
SILENT = BadGateway("node b did not answer: connection refused")

PLACEMENTS: list[tuple[str, list[Callable[[], Node]], CreateRequest, set[str], str, list[str]]] = [
    # (description, stand-in nodes, request, avoid, node it is made on, nodes tried in turn)
    ("the least loaded", [node("a", free_cpus=2), node("b", free_cpus=6)], CreateRequest(), set(), "b", ["b"]),
    ("one refusing for capacity is skipped",
     [node("a", free_cpus=2), node("b", free_cpus=6, refusals=[NO_ROOM])], CreateRequest(), set(), "a",
     ["b", "a"]),
    ("one not answering is skipped", [node("a", free_cpus=2), node("b", free_cpus=6, refusals=[SILENT])],
     CreateRequest(), set(), "a", ["b", "a"]),
    ("an unhealthy one is never tried", [node("a", free_cpus=2), node("b", healthy=False)],
     CreateRequest(), set(), "a", ["a"]),
    ("a cordoned one is never tried", [node("a", free_cpus=2), node("b", cordoned=True)],
     CreateRequest(), set(), "a", ["a"]),
    ("an avoided one waits while another can take it", [node("a", free_cpus=2), node("b", free_cpus=6)],
     CreateRequest(), {"b"}, "a", ["a"]),
    ("an avoided one once the others refused", [node("a", refusals=[NO_ROOM]), node("b")],
     CreateRequest(), {"b"}, "b", ["a", "b"]),
    ("secret environment only where it is kept off the disk",
     [node("a", free_cpus=8), node("b", free_cpus=2, offers=[SECRET_ENV])],
     CreateRequest(secret_env={"TOKEN": "s"}), set(), "b", ["b"]),
    ("a persistent sandbox only where it can sleep",
     [node("a", free_cpus=8), node("b", free_cpus=2, offers=[PERSISTENT])],
     CreateRequest(name="keep", persistent=True), set(), "b", ["b"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("nodes", "req", "avoid", "made_on", "tried"), [c[1:] for c in PLACEMENTS], ids=[c[0] for c in PLACEMENTS]
)
async def test_placement(
    store: SqliteStore, nodes: list[Callable[[], Node]], req: CreateRequest, avoid: set[str], made_on: str,
    tried: list[str],
) -> None:  # fmt: skip
    p = parts(store, [make() for make in nodes])
    made, on = await p.sandboxes.create(ALICE, req, avoid=avoid)
    assert on == made_on and made.id == f"sbx_{made_on}_1"
    assert p.placements.tried == tried
    # Only the nodes tried were asked to make it; the one that did got the resources counted, made explicit (its
    # defaults, as its status reports them).
    for name in p.registry.nodes:
        asked = ("POST", "/v1/sandboxes") in p.node(name).calls
        assert asked is (name in tried), name
    sent = p.node(made_on).created[-1]
    assert (sent.cpus, sent.memory_mb, sent.disk_mb) == (1, 512, 1024)
    assert sent.labels == {"gateway.owner": "alice", "gateway.tenant": "acme"}
    assert store.sandboxes[made.id] == SandboxRecord(
        made.id, "alice", "acme", made_on, req.name or None, 1, 512, T0, persistent=req.persistent is True
    )
    assert p.counted("sandbox_gateway_sandboxes_created_total") == 1
    assert p.counted("sandbox_gateway_scheduled_total", node=made_on) == 1
    # No quota, so no tenant's lock; a name is held under its owner's.
    assert p.locks.held == ([(NAME_LOCK,)] if req.name else [()])


@pytest.mark.parametrize(
    "nodes",
    [[], [node("a", healthy=False), node("b", cordoned=True)]],
    ids=["no node", "none answering and taking"],
)
async def test_no_node_to_take_it_is_503_and_writes_nothing(
    store: SqliteStore, nodes: list[Callable[[], Node]]
) -> None:
    p = parts(store, [make() for make in nodes])
    with pytest.raises(Unavailable) as caught:
        await p.sandboxes.create(ALICE, CreateRequest(name="box"))
    assert (caught.value.status, caught.value.code, caught.value.message) == (503, "unavailable", NO_NODE)
    assert dict(store.sandboxes) == {}
    assert all(p.node(name).calls == [] for name in p.registry.nodes)
    assert p.counted("sandbox_gateway_creates_refused_total", reason="capacity") == 1


async def test_every_node_refusing_is_503_with_what_each_said(store: SqliteStore) -> None:
    p = parts(store, [stand_in("a", refusals=[NO_ROOM]), stand_in("b", refusals=[SILENT])])
    with pytest.raises(Unavailable) as caught:
        await p.sandboxes.create(ALICE, CreateRequest())
    assert caught.value.message == (
        "no node can take this now (any node: none answering with free capacity and not cordoned; a: no room for 1 "
        "cpus; b: node b did not answer: connection refused); try again later or ask for fewer resources"
    )
    assert p.placements.tried == ["a", "b"] and dict(store.sandboxes) == {}


# -- quotas and names ---------------------------------------------------------------------------------------------


async def test_over_the_quota_is_403_asked_under_the_tenants_lock_and_writes_nothing(
    store: SqliteStore,
) -> None:
    store.set_quota("acme", Quota(max_cpus=1))
    p = parts(store, [stand_in("a"), stand_in("b")])
    short = "over the quota of tenant acme: 2 cpus of 1; delete sandboxes or ask an admin for a larger quota"
    p.quotas.short["acme"] = short
    with pytest.raises(OverQuota) as caught:
        await p.sandboxes.create(ALICE, CreateRequest(name="box", cpus=2))
    assert (caught.value.status, caught.value.code, caught.value.message) == (403, "refused", short)
    # Asked for each node placement offered, for what it would give there, under the name's and the tenant's locks.
    held = [NAME_LOCK, ("tenant", "acme")]
    assert p.quotas.asked == [(("acme", 1, 2, 512), held)] * 2
    assert p.locks.held == [tuple(held)]
    assert p.placements.tried == ["a", "b"]
    assert p.node("a").calls == [] and p.node("b").calls == []
    assert dict(store.sandboxes) == {}
    assert p.counted("sandbox_gateway_creates_refused_total", reason="quota") == 1
    assert p.counted("sandbox_gateway_creates_refused_total", reason="capacity") == 0


@pytest.mark.parametrize(("lost", "taken"), [(set(), True), ({"b"}, False)], ids=["held", "on a lost node"])
async def test_a_name_is_held_by_a_live_sandbox_unless_its_node_is_lost(
    store: SqliteStore, lost: set[str], taken: bool
) -> None:
    store.put_sandbox(SandboxRecord("sbx_b_0", "alice", "acme", "b", "box", 1, 512, T0))
    p = parts(store, [stand_in("a"), stand_in("b", healthy=False)], lost=lost)
    if taken:
        with pytest.raises(Conflict):
            await p.sandboxes.create(ALICE, CreateRequest(name="box"))
        assert p.node("a").calls == [] and p.quotas.asked == []
    else:
        assert (await p.sandboxes.create(ALICE, CreateRequest(name="box")))[1] == "a"
    # Bob's names are his own either way.
    assert (await p.sandboxes.create(BOB, CreateRequest(name="box")))[1] == "a"


# -- snapshots ----------------------------------------------------------------------------------------------------


async def test_a_scheduled_snapshot_is_its_sandbox_owners_and_a_fork_goes_to_its_node(
    store: SqliteStore,
) -> None:
    body = snapshot_body(id="snap_1", sandbox="sbx_b_0", scheduled=True, cpus=2, memory_mb=1024, disk_mb=4096)
    snap = convert_answer(body, Snapshot, "Snapshot")
    b = stand_in("b", free_cpus=2)
    client_of(b).snapshots_held.append(snap)
    store.put_sandbox(SandboxRecord("sbx_b_0", "alice", "acme", "b", None, 2, 1024, T0))
    p = parts(store, [stand_in("a", free_cpus=8), b])
    assert await p.snapshots.find(ALICE, "snap_1") == ("b", snap)
    with pytest.raises(NotFound) as caught:
        await p.snapshots.find(BOB, "snap_1")
    assert caught.value.message == "no snapshot 'snap_1' among yours"
    # A fork goes to the node holding its snapshot (though another is emptier), with the snapshot's resources.
    _, on = await p.sandboxes.create(ALICE, CreateRequest(snapshot_id="snap_1"))
    assert on == "b" and p.placements.asked[0][0] == ["b"]
    sent = p.node("b").created[-1]
    assert (sent.snapshot_id, sent.cpus, sent.memory_mb, sent.disk_mb) == ("snap_1", 2, 1024, 4096)
    assert ("POST", "/v1/sandboxes") not in p.node("a").calls


async def test_a_recorded_snapshot_is_where_its_record_says_and_503_while_that_node_is_down(
    store: SqliteStore,
) -> None:
    store.put_snapshot(SnapshotRecord("snap_2", "alice", "acme", "b", "sbx_b_0", T0))
    p = parts(store, [stand_in("a"), stand_in("b", healthy=False)])
    assert await p.snapshots.where(ALICE, "snap_2") == "b"
    assert p.node("a").calls == [] and p.node("b").calls == []  # a record needs no node's listing
    with pytest.raises(Unavailable) as caught:
        await p.snapshots.find(ALICE, "snap_2")
    assert caught.value.message == "the node 'b' holding snapshot snap_2 is not answering; try again later"
    with pytest.raises(NotFound):
        await p.snapshots.where(BOB, "snap_2")
    assert p.node("a").calls == []  # only the recorded node is asked


# -- wakes --------------------------------------------------------------------------------------------------------


def recorded(store: SqliteStore, *, asleep: bool) -> SandboxRecord:
    """The record of alice's persistent sandbox ``sbx_k`` on ``a`` (2 cpus, 1 GiB), saying ``asleep``."""
    rec = SandboxRecord("sbx_k", "alice", "acme", "a", "keep", 2, 1024, T0, persistent=True, asleep=asleep)
    store.put_sandbox(rec)
    return rec


async def test_a_wake_over_the_quota_is_checked_under_the_tenants_lock_and_forwards_nothing(
    store: SqliteStore,
) -> None:
    store.set_quota("acme", Quota(max_cpus=1))
    a = stand_in("a")
    client_of(a).held["sbx_k"] = sandbox(id="sbx_k", state="stopped", persistent=True, cpus=2, memory_mb=1024)
    rec = recorded(store, asleep=True)
    p = parts(store, [a])
    p.quotas.short["acme"] = "no room for it"
    with pytest.raises(OverQuota) as caught:
        await p.wakes.wake(rec)
    assert (caught.value.status, caught.value.message) == (403, "no room for it")
    # The check: what it takes again once awake, under the tenant's lock; the node asked its state, nothing else.
    assert p.quotas.asked == [(("acme", "sbx_k", 2, 1024), [("tenant", "acme")])]
    assert p.node("a").calls == [("GET", "/v1/sandboxes/sbx_k")]
    assert store.sandboxes["sbx_k"] == rec


@pytest.mark.parametrize(
    ("quota", "locks"), [(True, [(("tenant", "acme"),)]), (False, [()])], ids=["quota", "none"]
)
async def test_an_asleep_answer_is_asked_again_under_the_lock_before_it_is_written(
    store: SqliteStore, quota: bool, locks: list[tuple[tuple[str, str], ...]]
) -> None:
    if quota:
        store.set_quota("acme", Quota(max_cpus=4))
    a = stand_in("a")
    client_of(a).held["sbx_k"] = sandbox(id="sbx_k", state="running", persistent=True, cpus=2, memory_mb=1024)
    rec = recorded(store, asleep=False)
    p = parts(store, [a])
    # A listing answered before a wake: it says suspended, the node runs the sandbox again by now.
    stale = sandbox(id="sbx_k", state="suspended", persistent=True, cpus=2, memory_mb=1024)
    assert await p.wakes.learnt(rec, stale) == rec
    assert store.sandboxes["sbx_k"] == rec and not rec.asleep
    assert p.locks.held == locks
    assert p.node("a").calls == [("GET", "/v1/sandboxes/sbx_k")]
    assert p.quotas.asked == []

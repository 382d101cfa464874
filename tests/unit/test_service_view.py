"""A service's replicas as every gateway replica routes and shows them (docs/ha.md, "Services on every replica"):
a follower from the health the leader recorded, the leader from its own checks, a replica a request could not reach
tried last, and a new leader taking the recorded health up without a gap."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from sbx.api.services import ReplicaState, ServiceSpec
from sbx.gateway import keys
from sbx.gateway.audit import GatewayAudit
from sbx.gateway.jobs.controller import JobOptions
from sbx.gateway.nodes import Registry
from sbx.gateway.server import Gateway, GatewayOptions
from sbx.gateway.services import controller as controller_module
from sbx.gateway.services.controller import ServiceController
from sbx.gateway.services.store import ReplicaRecord, ServiceRecord
from sbx.gateway.store.sqlite import SqliteStore

T0 = "2026-01-01T00:00:00Z"
T1 = "2026-01-01T00:00:05Z"
#: The replicas recorded, and their health as the leader wrote it.
RECORDED: dict[str, ReplicaState] = {"r1": "healthy", "r2": "starting", "r3": "unhealthy", "r4": "healthy",
                                     "r5": "lost"}  # fmt: skip


@pytest.fixture
async def ctl(tmp_path: Path) -> AsyncIterator[ServiceController]:
    store = SqliteStore.open(tmp_path / "gw.db")
    gateway = Gateway(store, Registry(poll_interval_secs=60, failures_unhealthy=3, lost_after_secs=60),
                      GatewayAudit(tmp_path / "audit.jsonl"), GatewayOptions(jobs=JobOptions(tmp_path / "jobs")))  # fmt: skip
    ctl = gateway.services
    spec = msgspec.convert(
        {"name": "web", "image": "debian", "command": ["serve"], "port": 8080}, ServiceSpec
    )
    svc = ServiceRecord("svc_1", "", "web", "alice", spec, 1, 1, 4, 0, None, T0, T0)
    await ctl.db.put_service(svc, new_revision=spec)
    for sandbox, state in RECORDED.items():
        await ctl.db.put_replica(ReplicaRecord(sandbox, "svc_1", "n1", 1, 7, 0, True, T0))
        await ctl.db.put_health(sandbox, state, None if state == "healthy" else "it failed", T1)
    try:
        yield ctl
    finally:
        await ctl.close()
        store.close()


def picks(ctl: ServiceController, n: int) -> list[list[str]]:
    return [[r.rec.sandbox for r in ctl.pick("svc_1")] for _ in range(n)]


async def test_a_follower_routes_and_shows_the_recorded_health(ctl: ServiceController) -> None:
    assert {r.rec.sandbox: r.state for r in ctl.view("svc_1")} == RECORDED
    # Only the healthy ones, in turn.
    assert picks(ctl, 4) == [["r4", "r1"], ["r1", "r4"], ["r4", "r1"], ["r1", "r4"]]
    shown = ctl.wire(ctl.db.services["svc_1"], None)
    assert shown.ready == 2
    assert [(r.sandbox, r.state, r.healthy, r.last_check) for r in shown.replicas] == [
        (s, state, state == "healthy", T1) for s, state in RECORDED.items()
    ]
    assert [r.last_error for r in shown.replicas if r.state == "unhealthy"] == ["it failed"]
    # The leader turns one unhealthy: the follower stops choosing it (its memory is the record).
    await ctl.db.put_health("r4", "unhealthy", "GET / answered HTTP 500", T1)
    assert picks(ctl, 2) == [["r1"], ["r1"]]
    await ctl.db.put_health("r1", "lost", None, T1)
    assert ctl.pick("svc_1") == [] and ctl.wire(ctl.db.services["svc_1"], None).ready == 0
    assert ctl.pick("svc_unknown") == []


@pytest.mark.parametrize(
    ("marked", "reached", "down_secs", "expected"),
    [
        ("r1", None, 30.0, [["r4", "r1"], ["r4", "r1"], ["r4", "r1"]]),  # tried last, whatever the turn
        ("r4", None, 30.0, [["r1", "r4"], ["r1", "r4"], ["r1", "r4"]]),
        ("r1", "r1", 30.0, [["r4", "r1"], ["r1", "r4"], ["r4", "r1"]]),  # reached again: in turn again
        ("r1", None, 0.0, [["r4", "r1"], ["r1", "r4"], ["r4", "r1"]]),  # its time is over
    ],
)
async def test_a_replica_a_request_could_not_reach_is_tried_last(
    ctl: ServiceController, monkeypatch: pytest.MonkeyPatch, marked: str, reached: str | None, down_secs: float,
    expected: list[list[str]],
) -> None:  # fmt: skip
    monkeypatch.setattr(controller_module, "DOWN_SECS", down_secs)
    ctl.mark_down(marked)
    if reached is not None:
        ctl.mark_up(reached)
    assert picks(ctl, 3) == expected


async def test_a_new_leader_keeps_the_recorded_healthy_replicas_serving(ctl: ServiceController) -> None:
    await ctl.start()  # what a follower does once it leads (or one gateway after a restart)
    # Inspected before any step or check ran: a recorded healthy replica serves at once, the others start over.
    runtime = ctl.runtimes["svc_1"].replicas
    assert {s: r.state for s, r in runtime.items()} == {
        "r1": "healthy",
        "r2": "starting",
        "r3": "starting",
        "r4": "healthy",
        "r5": "starting",
    }
    assert {r.rec.sandbox for r in ctl.pick("svc_1")} == {"r1", "r4"}
    assert runtime["r3"].last_check == T1 and runtime["r3"].last_error == "it failed"


@pytest.mark.parametrize("leading", [False, True])
async def test_every_replica_ends_a_services_traffic_when_its_owner_loses_access(
    ctl: ServiceController, leading: bool
) -> None:
    """The owner's last key revoked: each replica ends the requests it relays (a follower has no runtime of the
    service, which is where this was looked up before), once; the leader alone audits it."""
    key, _ = keys.new_key("alice", "", {"sandbox:read"})
    ctl.store.add_key(key)
    if leading:
        await ctl.start()
    ended: list[str] = []
    ctl.on_access_lost.append(ended.append)
    audited: list[dict[str, object]] = []
    ctl.audit.record_audit = lambda **fields: audited.append(fields)  # type: ignore[method-assign]
    await ctl.access_changed()
    assert ended == []
    ctl.store.revoke_key(key.id)
    await ctl.access_changed()
    await ctl.access_changed()  # told once
    assert ended == ["svc_1"]
    assert [a["type"] for a in audited] == (["service.revoked"] if leading else [])

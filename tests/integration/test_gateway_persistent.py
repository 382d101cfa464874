"""Persistent sandboxes through a real gateway in front of two real sandboxd nodes (issue 32): the capability,
create's rules, stop and resume relayed, the tenant quota counting a sleeping sandbox as a sandbox but not its cpus
and memory, a wake over the quota refused with nothing changed, a drain suspending them, and another user's wake
404. The rules against stand-in nodes (every waking route, a node without the capability) are in
tests/unit/test_gateway_persistent.py."""

from __future__ import annotations

import base64
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from sandboxd_harness import Response, Sandboxd

pytestmark = pytest.mark.timeout(600)

CAPACITY = "[capacity]\ncpus = 8\nmemory_mb = 4096\ndisk_mb = 100000\n"


class World:
    """The gateway, its nodes by name, and the keys: ``admin``, ``alice`` and ``bob`` (both of tenant acme)."""

    def __init__(self, gw: GatewayProcess, nodes: dict[str, Sandboxd], keys: dict[str, str]) -> None:
        self.gw = gw
        self.nodes = nodes
        self.keys = keys

    def call(self, method: str, path: str, body: Any = None, who: str = "alice", **kw: Any) -> Response:
        return self.gw.request(method, path, body, key=self.keys[who], **kw)

    def ok(self, method: str, path: str, body: Any = None, who: str = "alice", status: int = 200) -> Any:
        resp = self.call(method, path, body, who)
        assert resp.status == status, (resp.status, resp.body)
        return resp.json() if resp.body else None

    def persistent(self, name: str, cpus: int = 1, memory_mb: int = 512) -> dict[str, Any]:
        made = self.ok("POST", "/v1/sandboxes", {"name": name, "persistent": True, "cpus": cpus,
                                                 "memory_mb": memory_mb}, status=201)  # fmt: skip
        assert made["persistent"] is True and made["state"] == "running"
        return dict(made)

    def node_of(self, sandbox: dict[str, Any]) -> Sandboxd:
        return self.nodes[sandbox["id"].split("_")[1]]

    def on_node(self, sandbox: dict[str, Any]) -> dict[str, Any]:
        """The sandbox as its node lists it (a listing names no sandbox: it neither wakes one nor counts as
        activity)."""
        listed = self.node_of(sandbox).request("GET", "/v1/sandboxes").json()["sandboxes"]
        return dict(next(s for s in listed if s["id"] == sandbox["id"]))

    def lifecycle(self, sandbox: dict[str, Any]) -> list[str]:
        """The sandbox's sleep and wake events at its node, oldest first."""
        wanted = ("sandbox.suspended", "sandbox.resumed", "sandbox.stopped", "sandbox.started")
        events = (
            self.node_of(sandbox).request("GET", f"/v1/sandboxes/{sandbox['id']}/events").json()["events"]
        )
        return [e["type"] for e in events if e["type"] in wanted]

    def used(self) -> dict[str, int]:
        """Tenant acme's usage as its quota counts it."""
        quotas = self.ok("GET", "/v1/admin/quotas", who="admin")["quotas"]
        return dict(next(q for q in quotas if q["tenant"] == "acme")["used"])

    def quota(self, **amounts: int) -> None:
        self.ok("PUT", "/v1/admin/quotas/acme", amounts, who="admin")

    def cleanup(self) -> None:
        """Terminate every sandbox, lift every cordon and the quota (tests share the world)."""
        for name, node in self.nodes.items():
            for s in node.request("GET", "/v1/sandboxes").json()["sandboxes"]:
                if s["state"] != "terminated":
                    node.request("DELETE", f"/v1/sandboxes/{s['id']}")
            self.ok("POST", f"/v1/admin/nodes/{name}/cordon", {"cordoned": False}, who="admin")
        self.ok("PUT", "/v1/admin/quotas/acme", {}, who="admin")
        # The gateway forgets what the nodes no longer run at a reconcile (every second here; a record younger
        # than 2 s is kept), so the next test counts from nothing.
        wait_for(lambda: not self.ok("GET", "/v1/admin/quotas", who="admin")["quotas"], timeout_secs=30)


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgwp-", dir="/var/tmp"))
    nodes: dict[str, Sandboxd] = {}
    for name in ("a", "b"):
        (workdir / name).mkdir()
        nodes[name] = Sandboxd(workdir / name, CAPACITY, args=["--node-id", name]).start()
    (workdir / "gw").mkdir()
    gw = GatewayProcess(workdir / "gw", list(nodes.items()), FAST_ARGS)
    crud = ("sandbox:read", "sandbox:create", "sandbox:delete")
    keys = {
        "admin": gw.create_key("root", "admin"),
        "alice": gw.create_key("alice", *crud, tenant="acme"),
        "bob": gw.create_key("bob", *crud, tenant="acme"),
    }
    gw.start()
    try:
        yield World(gw, nodes, keys)
    finally:
        gw.stop()
        for node in nodes.values():
            node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def w(world: World) -> Iterator[World]:
    yield world
    world.cleanup()


def test_the_gateway_offers_persistent_when_every_node_does(w: World) -> None:
    for node in w.nodes.values():
        assert node.request("GET", "/v1/capabilities").json()["capabilities"]["persistent"] is True
    assert w.ok("GET", "/v1/capabilities")["capabilities"]["persistent"] is True


def test_a_persistent_create_without_a_name_is_400_and_makes_nothing(w: World) -> None:
    resp = w.call("POST", "/v1/sandboxes", {"persistent": True, "cpus": 1})
    assert (resp.status, resp.error) == (400, ("invalid_request", (
        "persistent: a persistent sandbox needs a name (it is found again by it after every sleep); add name")))  # fmt: skip
    for node in w.nodes.values():
        assert [s for s in node.request("GET", "/v1/sandboxes").json()["sandboxes"]] == []
    assert w.ok("GET", "/v1/sandboxes")["sandboxes"] == []


def test_stop_of_a_plain_sandbox_is_409_and_it_runs_on(w: World) -> None:
    plain = w.ok("POST", "/v1/sandboxes", {"name": "plain", "cpus": 1}, status=201)
    assert plain["persistent"] is False
    resp = w.call("POST", "/v1/sandboxes/plain/stop")
    assert resp.status == 409 and resp.error[0] == "conflict"
    assert resp.error[1].startswith(f"sandbox {plain['id']} is not persistent; only a persistent sandbox")
    assert w.on_node(plain)["state"] == "running"


def test_stop_then_resume_through_the_gateway_keeps_the_disk(w: World) -> None:
    ws = w.persistent("ws")
    put = w.gw.request("PUT", "/v1/sandboxes/ws/files?path=/sandbox/home/kept", key=w.keys["alice"],
                       body=b"kept\n", headers={"Content-Type": "application/octet-stream"})  # fmt: skip
    assert put.status == 204, put.body
    stopped = w.ok("POST", "/v1/sandboxes/ws/stop")
    assert (stopped["state"], stopped["stopped_reason"]) == ("stopped", "request")
    assert w.ok("POST", "/v1/sandboxes/ws/stop")["state"] == "stopped"  # idempotent
    assert w.ok("GET", "/v1/sandboxes/ws")["state"] == "stopped"  # a GET does not wake it
    resumed = w.ok("POST", "/v1/sandboxes/ws/resume")
    assert resumed["state"] == "running" and "stopped_reason" not in resumed
    file = w.call("GET", "/v1/sandboxes/ws/files?path=/sandbox/home/kept")
    assert (file.status, file.body) == (200, b"kept\n")
    assert w.lifecycle(ws) == ["sandbox.stopped", "sandbox.started"]


def test_the_quota_counts_a_stopped_sandbox_but_not_its_cpus_and_memory(w: World) -> None:
    w.quota(cpus=8)
    w.persistent("ws", cpus=2, memory_mb=1024)
    assert w.used() == {"sandboxes": 1, "cpus": 2, "memory_mb": 1024}
    w.ok("POST", "/v1/sandboxes/ws/stop")
    assert w.used() == {"sandboxes": 1, "cpus": 0, "memory_mb": 0}
    # The sandbox count still holds it: with room for one sandbox, another is refused.
    w.quota(sandboxes=1, cpus=8)
    resp = w.call("POST", "/v1/sandboxes", {"cpus": 1})
    assert resp.status == 403 and resp.error[0] == "refused"
    assert resp.error[1].startswith("over the quota of tenant acme: 2 sandboxes of 1")


def test_an_idle_suspension_is_learnt_and_then_not_counted(w: World) -> None:
    w.quota(cpus=8)
    made = w.ok("POST", "/v1/sandboxes", {"name": "idle", "persistent": True, "cpus": 2,
                                          "idle_timeout_secs": 2}, status=201)  # fmt: skip
    wait_for(lambda: w.on_node(made)["state"] == "suspended", timeout_secs=60)
    # The gateway's reconcile (every second here) learns it from the node's listing.
    wait_for(lambda: w.used()["cpus"] == 0, timeout_secs=30)
    assert w.used()["sandboxes"] == 1


def test_a_wake_over_the_quota_is_403_and_changes_nothing(w: World) -> None:
    ws = w.persistent("ws", cpus=2, memory_mb=512)
    w.ok("POST", "/v1/sandboxes/ws/stop")
    w.quota(cpus=2)
    other = w.ok("POST", "/v1/sandboxes", {"cpus": 1, "memory_mb": 256}, status=201)  # its cpus went here
    before = w.used()
    for method, path, body in [
        ("POST", "/v1/sandboxes/ws/run", {"argv": ["true"]}),
        ("POST", "/v1/sandboxes/ws/resume", None),
        ("GET", "/v1/sandboxes/ws/dirs?path=/sandbox", None),
    ]:
        resp = w.call(method, path, body)
        assert (resp.status, resp.error) == (403, ("refused", (
            f"waking sandbox {ws['id']} (2 cpus, 512 memory_mb) would take tenant acme over its quota: 3 cpus of "
            "2; stop other persistent sandboxes of the tenant, delete some, or ask an admin for a larger quota")))  # fmt: skip
    # Nothing changed: still stopped at its node, never started, counted as before.
    assert w.on_node(ws)["state"] == "stopped"
    assert w.lifecycle(ws) == ["sandbox.stopped"]
    assert w.used() == before
    # With room again (once the gateway forgets the deleted one: at its next reconcile), the same request wakes
    # it and is answered.
    w.ok("DELETE", f"/v1/sandboxes/{other['id']}", status=204)
    wait_for(lambda: w.used()["cpus"] == 0, timeout_secs=30)
    ran = w.ok("POST", "/v1/sandboxes/ws/run", {"argv": ["echo", "awake"]})
    assert base64.b64decode(ran["stdout"]) == b"awake\n"
    assert w.on_node(ws)["state"] == "running" and w.lifecycle(ws) == ["sandbox.stopped", "sandbox.started"]
    assert w.used()["cpus"] == 2


def test_a_drain_suspends_persistent_sandboxes_and_they_do_not_hold_it_up(w: World) -> None:
    # Everything on node a: b cordoned while they are made.
    w.ok("POST", "/v1/admin/nodes/b/cordon", {"cordoned": True}, who="admin")
    ws = w.persistent("ws")
    plain = w.ok("POST", "/v1/sandboxes", {"cpus": 1}, status=201)
    assert {w.node_of(ws), w.node_of(plain)} == {w.nodes["a"]}
    drained = w.ok("POST", "/v1/admin/nodes/a/drain", {}, who="admin")
    assert drained == {
        "node": "a",
        "cordoned": True,
        "remaining": 1,
        "terminated": [],
        "suspended": [ws["id"]],
    }
    assert (w.on_node(ws)["state"], w.on_node(plain)["state"]) == ("suspended", "running")
    assert w.lifecycle(ws) == ["sandbox.suspended"]
    audit = w.ok("GET", "/v1/admin/audit?limit=1000", who="admin")["entries"]
    assert any(e["type"] == "drain.suspend" and e["target"] == ws["id"] for e in audit)
    # Once the plain one is gone, nothing remains; the suspended one waits on its disk.
    w.ok("DELETE", f"/v1/sandboxes/{plain['id']}", status=204)
    again = w.ok("POST", "/v1/admin/nodes/a/drain", {}, who="admin")
    assert (again["remaining"], again["suspended"]) == (0, [])
    # A request wakes it on its node, cordoned as it is (a cordon refuses creates only): then it remains.
    assert w.ok("POST", "/v1/sandboxes/ws/run", {"argv": ["true"]})["exit_code"] == 0
    assert w.on_node(ws)["state"] == "running"
    drained = w.ok("POST", "/v1/admin/nodes/a/drain", {"terminate": False}, who="admin")
    assert drained["suspended"] == [ws["id"]]
    # With terminate it goes too.
    ended = w.ok("POST", "/v1/admin/nodes/a/drain", {"terminate": True}, who="admin")
    assert (ended["terminated"], ended["remaining"], ended["suspended"]) == ([ws["id"]], 0, [])
    assert w.on_node(ws)["state"] == "terminated"


def test_another_users_wake_is_404_and_changes_nothing(w: World) -> None:
    ws = w.persistent("ws")
    w.ok("POST", "/v1/sandboxes/ws/stop")
    for ref in (ws["id"], "ws"):
        for method, path, body in [
            ("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]}),
            ("POST", f"/v1/sandboxes/{ref}/resume", None),
            ("POST", f"/v1/sandboxes/{ref}/stop", None),
        ]:
            resp = w.call(method, path, body, who="bob")
            assert (resp.status, resp.error) == (404, ("not_found", f"no sandbox {ref!r} among yours"))
    assert w.on_node(ws)["state"] == "stopped" and w.lifecycle(ws) == ["sandbox.stopped"]
    # bob's own sandbox of the same name is his alone.
    bobs = w.ok("POST", "/v1/sandboxes", {"name": "ws", "persistent": True, "cpus": 1}, who="bob", status=201)
    assert bobs["id"] != ws["id"]

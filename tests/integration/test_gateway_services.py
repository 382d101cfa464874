"""Services through a real gateway in front of two real sandboxd nodes: spec checks, spread placement, health,
traffic (HTTP and an upgrade), scale, rollouts (done and failed), replacement of unhealthy and lost replicas,
revocation of the owner, and a gateway restart that takes everything up without duplicating it."""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from gateway_harness import wait_for
from services_world import SERVE, World, raw_upgrade, world

HEALTH = {"http": "/", "every_secs": 1, "failures": 2}


@pytest.fixture(scope="module")
def w() -> Iterator[World]:
    with world() as started:
        started.ok("PUT", "/v1/secrets/TOKEN", {"value": "s3cret"}, status=204)
        yield started


def web(**fields: Any) -> dict[str, Any]:
    return {"name": "web", "command": SERVE, "port": 8080, "health": HEALTH, **fields}


def gone(w: World, name: str, key: str = "alice") -> None:
    """Delete the service and check every replica left its node."""
    svc = w.service(name, key)
    assert w.call("DELETE", f"/v1/services/{name}", key=key).status == 204
    assert w.call("GET", f"/v1/services/{name}", key=key).status == 404
    for replica in svc["replicas"]:
        node = w.nodes[replica["node"]]
        state = node.request("GET", f"/v1/sandboxes/{replica['sandbox']}").json().get("state")
        assert state in (None, "terminated"), replica


BAD_SPECS = [
    ({"name": "Web", "command": ["x"]}, 400, "is not a service name"),
    ({"name": "a--b", "command": ["x"]}, 400, "without --"),
    ({"name": "x" * 31, "command": ["x"]}, 400, "is not a service name"),
    ({"name": "web"}, 400, "command is required"),
    ({"name": "web", "command": []}, 400, "command: missing command"),
    ({"name": "web", "command": ["x"], "replicas": 101}, 400, "replicas = 101: give 0 to 100"),
    ({"name": "web", "command": ["x"], "port": 0}, 400, "port = 0"),
    ({"name": "web", "command": ["x"], "health": {"http": "/"}}, 400, "health.http needs port"),
    ({"name": "web", "command": ["x"], "port": 1, "health": {"http": "/", "command": ["true"]}}, 400,
     "exactly one of"),
    ({"name": "web", "command": ["x"], "port": 1, "health": {"http": "x"}}, 400, "is not a path"),
    ({"name": "web", "command": ["x"], "health": {"command": ["true"], "every_secs": 0}}, 400, "every_secs = 0"),
    ({"name": "web", "command": ["x"], "bogus": 1}, 400, "bogus"),
    ({"name": "web", "command": ["x"], "resources": {"cpus": 99}}, 400, "limits.max_cpus"),
    ({"name": "web", "command": ["x"], "secrets": ["NOPE"]}, 400, "this tenant has no secret 'NOPE'"),
    ({"name": "web", "command": ["x"], "secrets": ["TOKEN"], "env": {"TOKEN": "x"}}, 400, "both in env and in"),
    ({"name": "web", "command": ["x"], "env": {"LD_PRELOAD": "/x"}}, 403, "LD_PRELOAD is reserved"),
    ({"name": "web", "command": ["x"], "network": {"mode": "open"}}, 403, "network"),
]  # fmt: skip


@pytest.mark.parametrize(("spec", "status", "words"), BAD_SPECS)
def test_a_bad_spec_is_refused_and_makes_nothing(
    w: World, spec: dict[str, Any], status: int, words: str
) -> None:
    resp = w.call("POST", "/v1/services", spec)
    assert resp.status == status, resp.body
    assert words in resp.error[1], resp.error
    assert w.ok("GET", "/v1/services")["services"] == []


def test_a_service_spreads_serves_scales_rolls_out_and_is_deleted(w: World) -> None:
    created = w.ok("POST", "/v1/services", web(replicas=2, env={"GREETING": "hi"}, secrets=["TOKEN"],
                                               placement={"spread": "node"}), status=201)  # fmt: skip
    assert created["spec"]["health"] == {"http": "/", "every_secs": 1, "timeout_secs": 5, "failures": 2}
    assert (created["revision"], created["serving"], created["desired"], created["env_names"]) == (
        1,
        1,
        2,
        ["GREETING"],
    )
    assert "env" not in created["spec"] and created["url"] == "http://web--acme.svc.test/"
    # Its name is the tenant's: the same name again is 409, even from another user of the tenant.
    assert w.call("POST", "/v1/services", web(), key="carol").error[0] == "conflict"
    svc = w.wait_ready("web", 2)
    assert sorted(r["node"] for r in svc["replicas"]) == ["a", "b"]  # spread
    labelled = w.live_on_nodes("gateway.service=web")
    assert sorted(s["id"] for s in labelled) == sorted(r["sandbox"] for r in svc["replicas"])
    assert all(s["labels"]["gateway.service.rev"] == "1" and s["labels"]["gateway.owner"] == "alice"
               and s["env_names"] == ["GREETING"] and s["secret_env_names"] == ["TOKEN"]
               for s in labelled)  # fmt: skip
    # Replicas are the owner's sandboxes, and a PATCH of their labels keeps the gateway's.
    one = svc["replicas"][0]["sandbox"]
    patched = w.ok("PATCH", f"/v1/sandboxes/{one}", {"labels": {"team": "x"}})
    assert patched["labels"]["gateway.service"] == "web" and patched["labels"]["team"] == "x"
    # Traffic: each request to the next healthy replica; the key and the prefix handled; the secret there.
    seen = set()
    for _ in range(4):
        resp = w.traffic("/svc/web--acme/hello?x=1")
        assert resp.status == 200, resp.body
        ident, greeting, token_len, path, prefix, authorization = resp.body.decode().split()
        assert (greeting, token_len, path, prefix, authorization) == (
            "hi",
            "6",
            "/hello?x=1",
            "/svc/web--acme",
            "-",
        )
        seen.add(ident)
    assert len(seen) == 2
    assert w.traffic("/svc/web--acme/", method="POST", body=b"x" * 200_000).body == b"x" * 200_000
    # On its own host name (--services-domain) the path reaches the replica as sent; other hosts are the API's.
    by_host = w.traffic("/v1/whoami?y=2", headers={"Host": "web--acme.svc.test"}).body.decode().split()
    assert by_host[3:5] == ["/v1/whoami?y=2", "-"]
    assert (
        w.traffic("/v1/whoami", headers={"Host": "a.b.svc.test"}).status == 200
    )  # not a service label: the API
    # Who may call: a key of the tenant with sandbox:read; nobody else learns the service exists.
    assert w.traffic("/svc/web--acme/", key="reader").status == 200
    assert w.traffic("/svc/web--acme/", key=None).status == 401
    assert (w.traffic("/svc/web--acme/", key="bob").status, w.traffic("/svc/nope--acme/").status) == (
        404,
        404,
    )
    assert w.call("GET", "/v1/services/web", key="bob").status == 404
    assert w.ok("GET", "/v1/services/web?tenant=acme", key="admin")["owner"] == "alice"
    # An upgrade switches both sides (as a WebSocket would).
    sock = raw_upgrade(w.gw.port, "/svc/web--acme/ws", w.keys["alice"])
    sock.sendall(b"ping over the tunnel")
    assert sock.recv(100) == b"ping over the tunnel"
    sock.close()
    # public: true needs no key; no rollout for it.
    made_public = w.ok("PUT", "/v1/services/web", web(replicas=2, env={"GREETING": "hi"}, secrets=["TOKEN"],
                                                      placement={"spread": "node"}, public=True))  # fmt: skip
    assert (made_public["revision"], "rollout" in made_public) == (1, False)
    assert w.traffic("/svc/web--acme/", key=None).status == 200
    # Scale: no rollout; down ends the extra one.
    w.ok("POST", "/v1/services/web/scale", {"replicas": 3})
    assert w.wait_ready("web", 3)["revision"] == 1
    w.ok("POST", "/v1/services/web/scale", {"replicas": 2})
    w.wait_ready("web", 2)
    # A rollout: new replicas healthy before old ones go, one at a time; traffic never stops.
    before = {r["sandbox"] for r in w.service("web")["replicas"]}
    failures: list[int] = []
    ready_seen: list[int] = []
    stop = threading.Event()

    def hammer() -> None:
        while not stop.is_set():
            status = w.traffic("/svc/web--acme/", key=None).status
            if status != 200:
                failures.append(status)
            ready_seen.append(w.service("web")["ready"])

    thread = threading.Thread(target=hammer)
    thread.start()
    try:
        rolled = w.ok("PUT", "/v1/services/web", web(replicas=2, env={"GREETING": "hello"}, secrets=["TOKEN"],
                                                     placement={"spread": "node"}, public=True))  # fmt: skip
        assert (rolled["revision"], rolled["serving"], rolled["rollout"]) == (
            2,
            1,
            {"state": "in_progress", "from": 1, "to": 2},
        )
        done = w.wait_ready("web", 2)
    finally:
        stop.set()
        thread.join()
    assert (done["serving"], done["rollout"]["state"]) == (2, "done")
    assert {r["revision"] for r in done["replicas"]} == {2} and not before & {
        r["sandbox"] for r in done["replicas"]
    }
    assert failures == [] and min(ready_seen) >= 2, (failures, ready_seen)
    assert w.traffic("/svc/web--acme/", key=None).body.decode().split()[1] == "hello"
    # A revision that never becomes healthy fails its rollout and leaves the old one serving.
    broken = w.ok("PUT", "/v1/services/web", web(replicas=2, env={"GREETING": "x"}, secrets=["TOKEN"], public=True,
                                                 placement={"spread": "node"}, command=["sh", "-c", "exit 7"]))  # fmt: skip
    assert broken["rollout"]["to"] == 3
    failed = wait_for(lambda: (s := w.service("web"))["rollout"]["state"] == "failed" and s, 60)
    assert (failed["revision"], failed["serving"]) == (3, 2)
    assert (
        "revision 3 never became healthy" in failed["rollout"]["reason"]
        and "exited with code 7" in failed["rollout"]["reason"]
    )
    after = w.wait_ready("web", 2)
    assert {r["revision"] for r in after["replicas"]} == {2}
    assert w.traffic("/svc/web--acme/", key=None).body.decode().split()[1] == "hello"
    # A replica whose sandbox goes away is replaced, and counted.
    victim = after["replicas"][0]
    assert w.call("DELETE", f"/v1/sandboxes/{victim['sandbox']}").status == 204
    replaced = wait_for(lambda: (s := w.service("web"))["restarts"] > failed["restarts"] and s["ready"] == 2
                        and victim["sandbox"] not in {r["sandbox"] for r in s["replicas"]} and s, 60)  # fmt: skip
    assert max(r["restarts"] for r in replaced["replicas"]) >= 1
    gone(w, "web")


def test_replicas_on_a_node_that_stops_answering_are_replaced(w: World) -> None:
    w.ok("POST", "/v1/services", web(name="edge", replicas=2, placement={"spread": "node"}), status=201)
    svc = w.wait_ready("edge", 2)
    on_b = next(r for r in svc["replicas"] if r["node"] == "b")
    node_b = w.nodes["b"]
    assert node_b.proc is not None
    node_b.proc.send_signal(signal.SIGSTOP)
    try:
        lost = wait_for(lambda: (s := w.service("edge"))["ready"] == 2 and any(
            r["state"] == "lost" for r in s["replicas"]) and s, 60)  # fmt: skip
        states = {r["sandbox"]: (r["state"], r["node"]) for r in lost["replicas"]}
        assert states[on_b["sandbox"]] == ("lost", "b")
        assert sorted(v for v in states.values() if v[0] == "healthy") == [("healthy", "a"), ("healthy", "a")]
        assert lost["restarts"] == 1
        # Traffic goes on through the replacement.
        assert w.traffic("/svc/edge--acme/").status == 200
    finally:
        node_b.proc.send_signal(signal.SIGCONT)
    # The node answers again: its lost replica is ended, not kept as a surplus.
    back = wait_for(lambda: (s := w.service("edge"))["replicas"] and all(
        r["state"] == "healthy" for r in s["replicas"]) and len(s["replicas"]) == 2 and s, 60)  # fmt: skip
    assert on_b["sandbox"] not in {r["sandbox"] for r in back["replicas"]}
    wait_for(
        lambda: (
            node_b.request("GET", f"/v1/sandboxes/{on_b['sandbox']}").json().get("state")
            in (None, "terminated")
        )
    )
    gone(w, "edge")


def test_revoking_the_owner_stops_traffic_at_once_and_new_replicas(w: World) -> None:
    key = w.ok("POST", "/v1/admin/keys", {"user": "olga", "tenant": "acme",
                                          "scopes": ["sandbox:read", "sandbox:create"]}, key="admin", status=201)  # fmt: skip
    w.keys["olga"] = key["secret"]
    w.ok("POST", "/v1/services", web(name="owned", replicas=1, public=True), key="olga", status=201)
    svc = w.wait_ready("owned", 1, key="olga")
    slow: list[int] = []
    thread = threading.Thread(target=lambda: slow.append(w.traffic("/svc/owned--acme/slow", key=None).status))
    thread.start()
    time.sleep(1.0)
    started = time.monotonic()
    assert w.call("DELETE", f"/v1/admin/keys/{key['id']}", key="admin").status == 204
    thread.join(timeout=20)
    assert slow == [503] and time.monotonic() - started < 10  # the open request ended with the revocation
    resp = w.traffic("/svc/owned--acme/", key=None)
    assert (resp.status, resp.error[0]) == (503, "unavailable") and "no active key" in resp.error[1]
    # The replicas stay (until an admin deletes the service); none is replaced.
    kept = w.service("owned?tenant=acme", key="admin")
    assert [r["sandbox"] for r in kept["replicas"]] == [r["sandbox"] for r in svc["replicas"]]
    assert w.call("DELETE", f"/v1/sandboxes/{svc['replicas'][0]['sandbox']}", key="admin").status == 204
    stuck = wait_for(lambda: "error" in (s := w.service("owned?tenant=acme", key="admin")) and s, 30)
    assert "no active key" in stuck["error"] and stuck["ready"] == 0
    entries = w.ok("GET", "/v1/admin/audit?limit=1000", key="admin")["entries"]
    assert any(e["type"] == "service.revoked" and e["target"] == "owned" for e in entries)
    assert w.call("DELETE", "/v1/services/owned?tenant=acme", key="admin").status == 204


def test_a_restarted_gateway_takes_services_and_jobs_up_without_duplicates(w: World) -> None:
    w.ok("POST", "/v1/services", web(name="steady", replicas=2), status=201)
    before = w.wait_ready("steady", 2)
    job = w.ok("POST", "/v1/jobs", {"command": ["sh", "-c", "echo begin; sleep 6; echo end"]}, status=201)
    wait_for(lambda: w.job(job["id"])["runs"][0]["state"] == "running", 60)
    w.gw.kill()  # SIGKILL: nothing is shut down cleanly
    # While it is down: a replica made on a node but never recorded (as a create cut by the kill would leave),
    # and a sandbox of a service that no longer exists.
    labels = dict(w.live_on_nodes("gateway.service=steady")[0]["labels"])
    unrecorded = w.nodes["a"].create(labels=labels)
    w.nodes["a"].request("POST", f"/v1/sandboxes/{unrecorded['id']}/processes", {"argv": SERVE})
    stale = w.nodes["b"].create(labels={**labels, "gateway.service.id": "svc_0000000000000000"})
    w.gw.start()
    # The unrecorded one is adopted, then one of the three is ended (the newest not healthy first): two stay,
    # never a third made; the stale one is ended at start.
    after = w.wait_ready("steady", 2)
    assert len(w.live_on_nodes("gateway.service=steady")) == 2
    assert {r["sandbox"] for r in after["replicas"]} <= {r["sandbox"] for r in before["replicas"]} | {
        unrecorded["id"]
    }
    assert w.nodes["b"].request("GET", f"/v1/sandboxes/{stale['id']}").json()["state"] == "terminated"
    finished = w.wait_job(job["id"])
    assert (finished["state"], len(finished["runs"])) == ("succeeded", 1)  # reattached, not started again
    assert w.output(job["id"], 1)[0] == b"begin\nend\n"
    gone(w, "steady")


#: A hostile replica: answers with an endless header line, or a 101 nobody asked for.
HOSTILE = r"""
import socket
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", 8080)); srv.listen(16)
while True:
    conn, _ = srv.accept()
    data = conn.recv(65536)
    try:
        if b"/upgrade-anyway" in data:
            conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: evil\r\nConnection: Upgrade\r\n\r\nhello")
        elif b"/health" in data:
            conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\n\r\nok")
        else:
            conn.sendall(b"HTTP/1.1 200 OK\r\nX-Junk: " + b"a" * (1 << 20))
    except OSError:
        pass
    conn.close()
"""


def test_changes_are_checked_and_a_hostile_replica_leaves_the_gateway_well(w: World) -> None:
    w.ok("POST", "/v1/services", web(name="evil", replicas=1, command=["python3", "-c", HOSTILE],
                                     health={"http": "/health", "every_secs": 1}), status=201)  # fmt: skip
    before = w.wait_ready("evil", 1)
    changes = [
        ("PUT", "/v1/services/evil", web(name="other"), 400, "the body names 'other' but the path 'evil'"),
        ("PUT", "/v1/services/evil", web(name="evil", replicas=-1), 400, "replicas = -1"),
        ("POST", "/v1/services/evil/scale", {"replicas": 101}, 400, "replicas = 101"),
        ("POST", "/v1/services/evil/scale", {}, 400, "replicas is required"),
        ("PUT", "/v1/services/nope", web(name="nope"), 404, "no service 'nope' among yours"),
        (
            "POST",
            "/v1/services/evil/scale?tenant=beta",
            {"replicas": 2},
            404,
            "no service 'evil' among yours",
        ),
        ("DELETE", "/v1/services/evil?tenant=beta", None, 404, "no service 'evil' among yours"),
    ]
    for method, path, body, status, words in changes:
        resp = w.call(method, path, body)
        assert (resp.status, words in resp.error[1]) == (status, True), (method, path, resp.body)
    assert w.call("DELETE", "/v1/services/evil", key="bob").status == 404
    after = w.service("evil")
    assert (after["revision"], after["desired"], after["updated_at"]) == (1, 1, before["updated_at"])
    # Junk headers and an unasked-for switch of protocols are 502, and the gateway carries on.
    for path in ("/svc/evil--acme/", "/svc/evil--acme/upgrade-anyway"):
        resp = w.traffic(path)
        assert (resp.status, resp.error[0]) == (502, "internal"), (path, resp.body[:200])
    assert w.gw.request("GET", "/v1/health").status == 200
    assert w.service("evil")["ready"] == 1
    gone(w, "evil")


def test_a_rollout_that_outlasts_the_rollout_timeout_fails_and_the_old_revision_serves() -> None:
    """A gateway of its own with --rollout-timeout 4s: a new revision that is neither healthy nor failing yet
    (a health check every 10 s, three failures to be unhealthy) fails its rollout at the timeout."""
    slow = {"http": "/", "every_secs": 10, "failures": 3}
    with world(["--rollout-timeout", "4s"]) as w:
        w.ok("POST", "/v1/services", web(replicas=1, health=slow, public=True), status=201)
        first = w.wait_ready("web", 1)
        w.ok("PUT", "/v1/services/web", web(replicas=1, health=slow, public=True, command=["sleep", "3600"]))
        failed = wait_for(lambda: (s := w.service("web"))["rollout"]["state"] == "failed" and s, 60)
        assert failed["rollout"]["reason"] == "the rollout did not finish within 4 s", failed["rollout"]
        assert (failed["revision"], failed["serving"]) == (2, 1)
        after = w.wait_ready("web", 1)
        assert [r["sandbox"] for r in after["replicas"]] == [r["sandbox"] for r in first["replicas"]]
        assert w.traffic("/svc/web--acme/", key=None).status == 200

"""sandbox-gateway with three real sandboxd nodes: placement, capacity, cordon, drain, quotas, node loss and
recovery, and forgetting sandboxes a node no longer runs."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from sandboxd_harness import Sandboxd, free_port, localhost_certificate

CAPACITY = "[capacity]\ncpus = 8\nmemory_mb = 4096\ndisk_mb = 100000\n"


class Fleet:
    def __init__(self, gw: GatewayProcess, nodes: dict[str, Sandboxd], keys: dict[str, str]) -> None:
        self.gw = gw
        self.nodes = nodes
        self.keys = keys

    def node_of(self, sandbox_id: str) -> str:
        return sandbox_id.split("_")[1]

    def nodes_info(self) -> dict[str, dict[str, Any]]:
        listed = self.gw.request("GET", "/v1/admin/nodes", key=self.keys["admin"]).json()["nodes"]
        return {n["name"]: n for n in listed}

    def cleanup(self) -> None:
        """Terminate every sandbox on every node and lift every cordon (tests share the fleet)."""
        for name, node in self.nodes.items():
            if node.proc is None or node.proc.poll() is not None:
                continue
            for s in node.request("GET", "/v1/sandboxes").json()["sandboxes"]:
                if s["state"] != "terminated":
                    node.request("DELETE", f"/v1/sandboxes/{s['id']}")
            self.gw.request(
                "POST", f"/v1/admin/nodes/{name}/cordon", {"cordoned": False}, key=self.keys["admin"]
            )


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgwf-", dir="/var/tmp"))
    nodes: dict[str, Sandboxd] = {}
    for name in ("a", "b", "c"):
        (workdir / name).mkdir()
        nodes[name] = Sandboxd(workdir / name, CAPACITY, args=["--node-id", name]).start()
    (workdir / "gw").mkdir()
    (workdir / "gw" / "nodefiles").mkdir()
    gw = GatewayProcess(
        workdir / "gw",
        list(nodes.items()),
        [*FAST_ARGS, "--node-files-dir", str(workdir / "gw" / "nodefiles")],
    )
    crud = ("sandbox:read", "sandbox:create", "sandbox:delete")
    keys = {
        "admin": gw.create_key("root", "admin"),
        "alice": gw.create_key("alice", *crud, tenant="acme"),
        "bob": gw.create_key("bob", *crud, tenant="beta"),
        "dora": gw.create_key("dora", *crud, tenant="delta"),
    }
    gw.cli("quotas", "set", "beta", "--sandboxes", "2", "--cpus", "3")
    keys["greta"] = gw.create_key("greta", *crud, tenant="gamma")
    gw.cli("quotas", "set", "gamma", "--cpus", "1")
    gw.start()
    fl = Fleet(gw, nodes, keys)
    try:
        yield fl
    finally:
        gw.stop()
        for node in nodes.values():
            node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture
def clean(fleet: Fleet) -> Iterator[Fleet]:
    yield fleet
    fleet.cleanup()


def test_creates_spread_least_loaded_first_and_names_are_per_user(clean: Fleet) -> None:
    fleet = clean
    made = [fleet.gw.create(fleet.keys["alice"], cpus=1) for _ in range(3)]
    assert sorted(fleet.node_of(s["id"]) for s in made) == ["a", "b", "c"]
    # Two users may use one name, wherever placement puts them (a node scopes names by gateway.owner).
    first = fleet.gw.create(fleet.keys["alice"], name="dup")
    second = fleet.gw.create(fleet.keys["dora"], name="dup")
    assert fleet.gw.request("GET", "/v1/sandboxes/dup", key=fleet.keys["alice"]).json()["id"] == first["id"]
    assert fleet.gw.request("GET", "/v1/sandboxes/dup", key=fleet.keys["dora"]).json()["id"] == second["id"]
    # A second of one user's names is 409 wherever the first is, and makes nothing on any node.
    before = {
        n: len(node.request("GET", "/v1/sandboxes").json()["sandboxes"]) for n, node in fleet.nodes.items()
    }
    again = fleet.gw.request("POST", "/v1/sandboxes", {"name": "dup"}, key=fleet.keys["dora"])
    assert (again.status, again.error) == (
        409, ("conflict", "you already have a live sandbox named 'dup': pick another name or delete it"))  # fmt: skip
    assert {
        n: len(node.request("GET", "/v1/sandboxes").json()["sandboxes"]) for n, node in fleet.nodes.items()
    } == before


def test_no_node_with_room_is_503_and_creates_nothing(clean: Fleet) -> None:
    fleet = clean
    before = {
        n: len(node.request("GET", "/v1/sandboxes").json()["sandboxes"]) for n, node in fleet.nodes.items()
    }
    resp = fleet.gw.request("POST", "/v1/sandboxes", {"cpus": 4, "memory_mb": 8192}, key=fleet.keys["alice"])
    code, message = resp.error
    assert (resp.status, code) == (503, "unavailable") and message.startswith("no node can take this now")
    for name in fleet.nodes:
        assert fleet.gw.request("POST", f"/v1/admin/nodes/{name}/cordon", {"cordoned": True},
                                key=fleet.keys["admin"]).json()["cordoned"] is True  # fmt: skip
    resp = fleet.gw.request("POST", "/v1/sandboxes", {}, key=fleet.keys["alice"])
    assert (resp.status, resp.error[0]) == (503, "unavailable")
    after = {
        n: len(node.request("GET", "/v1/sandboxes").json()["sandboxes"]) for n, node in fleet.nodes.items()
    }
    assert after == before


def test_cordon_and_drain(clean: Fleet) -> None:
    fleet, admin = clean, clean.keys["admin"]
    on_a = [fleet.gw.create(fleet.keys["alice"]) for _ in range(3)]
    for name in ("b", "c"):
        fleet.gw.request("POST", f"/v1/admin/nodes/{name}/cordon", {"cordoned": True}, key=admin)
    assert fleet.nodes["b"].request("GET", "/v1/node").json()["cordoned"] is True
    assert {fleet.node_of(s["id"]) for s in on_a} <= {"a", "b", "c"}
    placed = fleet.gw.create(fleet.keys["alice"])
    assert fleet.node_of(placed["id"]) == "a"
    running_on_b = [s for s in fleet.nodes["b"].request("GET", "/v1/sandboxes").json()["sandboxes"]
                    if s["state"] != "terminated"]  # fmt: skip
    drained = fleet.gw.request("POST", "/v1/admin/nodes/b/drain", {"terminate": False}, key=admin).json()
    assert drained == {
        "node": "b", "cordoned": True, "remaining": len(running_on_b), "terminated": [], "suspended": []
    }  # fmt: skip
    # Drain with terminate ends the sandboxes still there, each audited.
    drained = fleet.gw.request("POST", "/v1/admin/nodes/a/drain", {"terminate": True}, key=admin).json()
    assert drained["remaining"] == 0 and placed["id"] in drained["terminated"]
    assert (
        fleet.gw.request("GET", f"/v1/sandboxes/{placed['id']}", key=fleet.keys["alice"]).json()["state"]
        == "terminated"
    )
    audit = fleet.gw.request("GET", "/v1/admin/audit?limit=1000", key=admin).json()["entries"]
    assert {e["target"] for e in audit if e.get("type") == "drain.terminate"} == set(drained["terminated"])
    # A drained node restarted clears its own cordon; the gateway restores it on its next poll.
    node = fleet.nodes["a"]
    node.stop()
    node.start()
    wait_for(lambda: node.request("GET", "/v1/node").json()["cordoned"], timeout_secs=10)
    # Errors: unknown node 404; bad body 400; node file nodes cannot be removed (409).
    resp = fleet.gw.request("POST", "/v1/admin/nodes/zz/cordon", {"cordoned": True}, key=admin)
    assert (resp.status, resp.error) == (404, ("not_found", "no node 'zz': see GET /v1/admin/nodes"))
    resp = fleet.gw.request("POST", "/v1/admin/nodes/a/cordon", {"cordoned": "yes"}, key=admin)
    assert (resp.status, resp.error) == (
        400,
        ("invalid_request", "cordoned: expected a boolean, got a string"),
    )
    resp = fleet.gw.request("DELETE", "/v1/admin/nodes/a", key=admin)
    assert (resp.status, resp.error[0]) == (409, "conflict") and "a" in fleet.nodes_info()


def test_admin_nodes_add_rules(clean: Fleet) -> None:
    fleet, admin = clean, clean.keys["admin"]
    cases = [
        ({"name": "x", "endpoint": "http://10.1.2.3:80"}, 400, "invalid_request"),
        ({"name": "Bad Name", "endpoint": "unix:///tmp/x.sock"}, 400, "invalid_request"),
        ({"name": "x", "endpoint": "ftp://localhost"}, 400, "invalid_request"),
        ({"name": "x", "endpoint": "unix:///tmp/x.sock", "token_file": "/etc/passwd"}, 403, "refused"),
        ({"name": "a", "endpoint": "unix:///tmp/x.sock"}, 409, "conflict"),
    ]
    for body, status, code in cases:
        resp = fleet.gw.request("POST", "/v1/admin/nodes", body, key=admin)
        assert (resp.status, resp.error[0]) == (status, code), body
    assert sorted(fleet.nodes_info()) == ["a", "b", "c"]


def test_tenant_quota(clean: Fleet) -> None:
    fleet, bob = clean, clean.keys["bob"]
    first = fleet.gw.create(bob, cpus=2)
    resp = fleet.gw.request("POST", "/v1/sandboxes", {"cpus": 2}, key=bob)
    assert resp.status == 403
    assert resp.error == (
        "refused",
        "over the quota of tenant beta: 4 cpus of 3; delete sandboxes or ask an admin for a larger quota",
    )
    fleet.gw.create(bob, cpus=1)
    resp = fleet.gw.request("POST", "/v1/sandboxes", {"cpus": 1}, key=bob)
    expected = "over the quota of tenant beta: 3 sandboxes of 2, 4 cpus of 3; delete sandboxes or ask an admin for a larger quota"
    assert (resp.status, resp.error) == (403, ("refused", expected))
    assert len(fleet.gw.request("GET", "/v1/sandboxes", key=bob).json()["sandboxes"]) == 2
    # A sandbox its node stops running (deleted beside the gateway) is forgotten and stops counting.
    fleet.nodes[fleet.node_of(first["id"])].request("DELETE", f"/v1/sandboxes/{first['id']}")
    wait_for(
        lambda: fleet.gw.request("POST", "/v1/sandboxes", {"cpus": 1}, key=bob).status == 201, timeout_secs=10
    )


def test_node_lost_and_back(clean: Fleet) -> None:
    fleet, alice, admin = clean, clean.keys["alice"], clean.keys["admin"]
    made = [fleet.gw.create(alice) for _ in range(3)]
    victim = next(s for s in made if fleet.node_of(s["id"]) == "c")
    node = fleet.nodes["c"]
    assert node.proc is not None
    node.proc.send_signal(signal.SIGKILL)
    node.proc.wait()
    wait_for(lambda: not fleet.nodes_info()["c"]["healthy"], timeout_secs=10)
    resp = fleet.gw.request("GET", f"/v1/sandboxes/{victim['id']}", key=alice)
    assert (resp.status, resp.error[0]) == (503, "unavailable") and "not answering" in resp.error[1]
    listed = {s["id"] for s in fleet.gw.request("GET", "/v1/sandboxes", key=alice).json()["sandboxes"]}
    assert victim["id"] not in listed and len(listed) >= 2
    assert all(fleet.node_of(fleet.gw.create(alice)["id"]) != "c" for _ in range(2))
    lost = wait_for(
        lambda: fleet.gw.request("GET", "/v1/admin/lost", key=admin).json()["sandboxes"], timeout_secs=10
    )
    assert [x["id"] for x in lost] == [victim["id"]]
    assert lost[0]["user"] == "alice" and lost[0]["tenant"] == "acme" and lost[0]["node"] == "c"
    assert fleet.nodes_info()["c"]["lost"] is True
    # Back: its sandboxes come back from its own listing, no longer lost.
    node.start()
    wait_for(lambda: fleet.nodes_info()["c"]["healthy"], timeout_secs=15)
    assert fleet.gw.request("GET", "/v1/admin/lost", key=admin).json()["sandboxes"] == []
    again = fleet.gw.request("GET", f"/v1/sandboxes/{victim['id']}", key=alice)
    assert again.status == 200 and again.json()["state"] == "running"
    assert victim["id"] in {
        s["id"] for s in fleet.gw.request("GET", "/v1/sandboxes", key=alice).json()["sandboxes"]
    }
    time.sleep(0.1)


def test_sandbox_cli_gateway_commands(clean: Fleet) -> None:
    fleet = clean
    env = {
        **os.environ,
        "SANDBOX_URL": f"http://127.0.0.1:{fleet.gw.port}",
        "SANDBOX_TOKEN": fleet.keys["admin"],
    }

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "sbx.cli.main", "gateway", *args], env=env,
                              capture_output=True, text=True, check=False)  # fmt: skip

    listed = cli("nodes")
    assert listed.returncode == 0, listed.stderr
    lines = listed.stdout.splitlines()
    assert lines[0].split()[:4] == ["NAME", "HEALTH", "CORDONED", "RUNNING"]
    assert [line.split()[:3] for line in lines[1:]] == [
        ["a", "up", "no"],
        ["b", "up", "no"],
        ["c", "up", "no"],
    ]
    assert cli("cordon", "b").stdout == "b: cordoned\n"
    assert fleet.nodes_info()["b"]["cordoned"] is True
    assert cli("uncordon", "b").stdout == "b: uncordoned\n"
    assert fleet.nodes_info()["b"]["cordoned"] is False
    s = fleet.gw.create(fleet.keys["alice"])
    node = fleet.node_of(s["id"])
    assert cli("drain", node).stdout == f"{node}: cordoned; 1 sandboxes still running\n"
    assert (
        cli("drain", node, "--terminate").stdout
        == f"{node}: cordoned; 0 sandboxes still running\nterminated: 1\n"
    )
    assert cli("lost").stdout.split() == ["ID", "USER", "TENANT", "NODE", "NODE", "DOWN", "SINCE"]
    audit = cli("audit", "--since", "10m", "--limit", "1000")
    assert audit.returncode == 0 and "drain.terminate" in audit.stdout and s["id"] in audit.stdout
    missing = cli("cordon", "zz")
    assert missing.returncode == 1 and missing.stderr == "not_found: no node 'zz': see GET /v1/admin/nodes\n"
    denied = subprocess.run([sys.executable, "-m", "sbx.cli.main", "gateway", "nodes"],
                            env={**env, "SANDBOX_TOKEN": fleet.keys["alice"]}, capture_output=True, text=True, check=False)  # fmt: skip
    assert denied.returncode == 1 and denied.stderr.startswith("refused: this API key lacks the scope admin")


def test_volumes_one_namespace_and_pinned_placement(clean: Fleet) -> None:
    fleet, alice, bob, admin = clean, clean.keys["alice"], clean.keys["bob"], clean.keys["admin"]
    made = fleet.gw.request("POST", "/v1/volumes", {"name": "data", "size_mb": 64}, key=alice)
    assert made.status == 201, made.body
    holder = next(n for n, node in fleet.nodes.items()
                  if any(v["name"] == "data" for v in node.request("GET", "/v1/volumes").json()["volumes"]))  # fmt: skip
    try:
        # One name space across the gateway: bob cannot take the name, nor see, nor delete alice's volume.
        taken = fleet.gw.request("POST", "/v1/volumes", {"name": "data"}, key=bob)
        assert (taken.status, taken.error[0]) == (
            409,
            "conflict",
        ) and "volume names are shared" in taken.error[1]
        assert sum(len(n.request("GET", "/v1/volumes").json()["volumes"]) for n in fleet.nodes.values()) == 1
        assert fleet.gw.request("GET", "/v1/volumes", key=bob).json() == {"volumes": []}
        assert [v["name"] for v in fleet.gw.request("GET", "/v1/volumes", key=alice).json()["volumes"]] == [
            "data"
        ]
        gone = fleet.gw.request("DELETE", "/v1/volumes/data", key=bob)
        assert (gone.status, gone.error) == (404, ("not_found", "no volume 'data' among yours"))
        assert err_code(fleet.gw.request("POST", "/v1/sandboxes", {"volumes": [{"name": "data", "path": "/data"}]},
                                         key=bob)) == (404, "not_found")  # fmt: skip
        # Mounting it pins the sandbox to the volume's node, whatever placement would prefer.
        mounted = [fleet.gw.create(alice, volumes=[{"name": "data", "path": "/data", "read_only": True}])
                   for _ in range(2)]  # fmt: skip
        assert {fleet.node_of(s["id"]) for s in mounted} == {holder}
        for s in mounted:
            fleet.gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=alice)
        # Two volumes on two nodes cannot be mounted together.
        fleet.gw.request("POST", f"/v1/admin/nodes/{holder}/cordon", {"cordoned": True}, key=admin)
        assert (
            fleet.gw.request("POST", "/v1/volumes", {"name": "other", "size_mb": 64}, key=alice).status == 201
        )
        fleet.gw.request("POST", f"/v1/admin/nodes/{holder}/cordon", {"cordoned": False}, key=admin)
        both = [{"name": "data", "path": "/data"}, {"name": "other", "path": "/other"}]
        listed = fleet.gw.request("GET", "/v1/sandboxes", key=alice).json()
        split = fleet.gw.request("POST", "/v1/sandboxes", {"volumes": both}, key=alice)
        assert (split.status, split.error[0]) == (409, "conflict") and "different nodes" in split.error[1]
        assert fleet.gw.request("GET", "/v1/sandboxes", key=alice).json() == listed
        assert fleet.gw.request("DELETE", "/v1/volumes/other", key=alice).status == 204
    finally:
        fleet.gw.request("DELETE", "/v1/volumes/data", key=alice)
    assert fleet.gw.request("GET", "/v1/volumes", key=alice).json() == {"volumes": []}


def err_code(resp: Any) -> tuple[int, str]:
    return resp.status, resp.error[0]


def test_a_node_over_https_with_a_token(clean: Fleet, tmp_path: Path) -> None:
    """A node added through the admin API at an https endpoint, with token and CA files from --node-files-dir:
    plain calls, streams and an upgrade all go over TLS with the token."""
    fleet, alice, admin = clean, clean.keys["alice"], clean.keys["admin"]
    files = fleet.gw.workdir / "nodefiles"
    cert, key = files / "cert.pem", files / "key.pem"
    localhost_certificate(cert, key)
    (files / "token").write_text("node-d-token\n")
    port = free_port()
    workdir = Path(tempfile.mkdtemp(prefix="sbxgwd-", dir="/var/tmp"))
    node = Sandboxd(workdir, CAPACITY, args=[
        "--socket", str(workdir / "d.sock"), "--node-id", "d", "--listen", f"127.0.0.1:{port}",
        "--token-file", str(files / "token"), "--tls-cert", str(cert), "--tls-key", str(key)])  # fmt: skip
    node.socket_path = workdir / "d.sock"
    node.token = "node-d-token"
    node.start()
    try:
        body = {"name": "d", "endpoint": f"https://127.0.0.1:{port}", "token_file": str(files / "token"),
                "ca_file": str(cert)}  # fmt: skip
        added = fleet.gw.request("POST", "/v1/admin/nodes", body, key=admin)
        assert added.status == 201 and added.json()["healthy"] is True, added.body
        for name in ("a", "b", "c"):
            fleet.gw.request("POST", f"/v1/admin/nodes/{name}/cordon", {"cordoned": True}, key=admin)
        s = fleet.gw.create(alice)
        assert fleet.node_of(s["id"]) == "d"
        run = fleet.gw.request("POST", f"/v1/sandboxes/{s['id']}/run", {"argv": ["echo", "tls"]}, key=alice)
        assert run.status == 200 and run.json()["stdout"] == "dGxzCg=="
        proc = fleet.gw.request(
            "POST", f"/v1/sandboxes/{s['id']}/processes", {"argv": ["cat"]}, key=alice
        ).json()
        sock = socket.create_connection(("127.0.0.1", fleet.gw.port), timeout=30)
        sock.sendall(f"GET /v1/sandboxes/{s['id']}/processes/{proc['pid']}/attach HTTP/1.1\r\nHost: x\r\n"
                     f"Authorization: Bearer {alice}\r\nConnection: Upgrade\r\nUpgrade: sbx-stream/1\r\n\r\n".encode())  # fmt: skip
        data = b""
        while b"\r\n\r\n" not in data:  # frames go only after the 101 has been read
            data += sock.recv(4096)
        sock.sendall(b"i\x00\x00\x00\x03hi\ne\x00\x00\x00\x00")
        while chunk := sock.recv(65536):
            data += chunk
        sock.close()
        assert data.startswith(b"HTTP/1.1 101") and b"o\x00\x00\x00\x03hi\n" in data
        assert fleet.gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=alice).status == 204
        # Files outside --node-files-dir are refused; the node is removed again (its owners kept).
        outside = fleet.gw.request("POST", "/v1/admin/nodes", {**body, "name": "e", "token_file": str(tmp_path / "t")},
                                   key=admin)  # fmt: skip
        assert (outside.status, outside.error[0]) == (403, "refused") and "--node-files-dir" in outside.error[
            1
        ]
        assert fleet.gw.request("DELETE", "/v1/admin/nodes/d", key=admin).status == 204
        assert sorted(fleet.nodes_info()) == ["a", "b", "c"]
    finally:
        fleet.gw.request("DELETE", "/v1/admin/nodes/d", key=admin)
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def test_snapshots_belong_to_the_owner_and_pin_forks(clean: Fleet) -> None:
    fleet, alice, bob = clean, clean.keys["alice"], clean.keys["bob"]
    caps = fleet.gw.request("GET", "/v1/capabilities", key=alice).json()["capabilities"]
    if not caps.get("disk_snapshot"):
        pytest.skip("the nodes' backend takes no disk snapshots (capability disk_snapshot)")
    s = fleet.gw.create(alice)
    fleet.gw.request(
        "POST", f"/v1/sandboxes/{s['id']}/run", {"argv": ["sh", "-c", "echo kept > /tmp/mark"]}, key=alice
    )
    taken = fleet.gw.request("POST", f"/v1/sandboxes/{s['id']}/snapshots", {"kind": "disk"}, key=alice)
    assert taken.status == 201, taken.body
    snap = taken.json()
    try:
        assert [x["id"] for x in fleet.gw.request("GET", "/v1/snapshots", key=alice).json()["snapshots"]] == [
            snap["id"]
        ]
        assert fleet.gw.request("GET", "/v1/snapshots", key=bob).json() == {"snapshots": []}
        resp = fleet.gw.request("DELETE", f"/v1/snapshots/{snap['id']}", key=bob)
        assert (resp.status, resp.error) == (404, ("not_found", f"no snapshot {snap['id']!r} among yours"))
        resp = fleet.gw.request("POST", "/v1/sandboxes", {"snapshot_id": snap["id"]}, key=bob)
        assert err_code(resp) == (404, "not_found")
        forks = [fleet.gw.create(alice, snapshot_id=snap["id"]) for _ in range(2)]
        assert {fleet.node_of(f["id"]) for f in forks} == {fleet.node_of(s["id"])}
        # One taken beside the gateway (as a schedule would) belongs to the owner of its sandbox.
        node = fleet.nodes[fleet.node_of(s["id"])]
        beside = node.request("POST", f"/v1/sandboxes/{s['id']}/snapshots", {"kind": "disk"}).json()
        mine = {x["id"] for x in fleet.gw.request("GET", "/v1/snapshots", key=alice).json()["snapshots"]}
        assert mine == {snap["id"], beside["id"]}
        resp = fleet.gw.request("DELETE", f"/v1/snapshots/{beside['id']}", key=bob)
        assert (resp.status, resp.error[0]) == (404, "not_found")
        fork = fleet.gw.create(alice, snapshot_id=beside["id"])
        assert fleet.node_of(fork["id"]) == fleet.node_of(s["id"])
        assert fleet.gw.request("DELETE", f"/v1/snapshots/{beside['id']}", key=alice).status == 204
    finally:
        assert fleet.gw.request("DELETE", f"/v1/snapshots/{snap['id']}", key=alice).status == 204
    assert fleet.gw.request("GET", "/v1/snapshots", key=alice).json() == {"snapshots": []}


def test_sigkilled_gateway_keeps_everything_it_acknowledged(clean: Fleet) -> None:
    fleet, admin = clean, clean.keys["admin"]
    gw = fleet.gw
    # While it serves, the offline commands refuse and change nothing.
    refused = gw.cli("keys", "create", "--user", "x", "--scope", "admin", check=False)
    assert refused.returncode == 1 and "another process holds the state file lock" in refused.stderr
    made = gw.request(
        "POST", "/v1/admin/keys", {"user": "gina", "scopes": ["sandbox:read", "sandbox:create"]}, key=admin
    )
    secret = made.json()["secret"]
    s = gw.create(secret, name="survivor")
    gw.request("POST", "/v1/admin/nodes/b/drain", {"terminate": False}, key=admin)
    revoked = gw.request(
        "POST", "/v1/admin/keys", {"user": "hal", "scopes": ["sandbox:read"]}, key=admin
    ).json()
    assert gw.request("DELETE", f"/v1/admin/keys/{revoked['id']}", key=admin).status == 204
    gw.kill()
    gw.start()
    assert gw.request("GET", "/v1/sandboxes/survivor", key=secret).json()["id"] == s["id"]
    assert gw.request("GET", "/v1/whoami", key=revoked["secret"]).status == 401
    assert fleet.nodes_info()["b"]["cordoned"] is True
    assert all(fleet.node_of(gw.create(secret)["id"]) != "b" for _ in range(2))


def test_a_stop_cuts_open_streams_within_seconds(clean: Fleet) -> None:
    fleet, alice = clean, clean.keys["alice"]
    gw = fleet.gw
    s = gw.create(alice)
    pid = gw.request(
        "POST", f"/v1/sandboxes/{s['id']}/processes", {"argv": ["sleep", "600"]}, key=alice
    ).json()["pid"]
    conn = gw.connection(30)
    conn.request(
        "GET", f"/v1/sandboxes/{s['id']}/processes/{pid}/output", headers={"Authorization": f"Bearer {alice}"}
    )
    assert conn.getresponse().status == 200
    started = time.monotonic()
    gw.stop()
    assert gw.proc is not None and gw.proc.returncode == 0
    assert time.monotonic() - started < 10
    conn.close()
    gw.start()
    assert gw.request("GET", f"/v1/sandboxes/{s['id']}", key=alice).status == 200


def test_quota_passed_by_node_defaults_is_undone(clean: Fleet) -> None:
    fleet, greta = clean, clean.keys["greta"]
    first = fleet.gw.create(greta, cpus=1)
    # The request names no cpus: only the node's answer (its default, 2) shows the quota is passed.
    resp = fleet.gw.request("POST", "/v1/sandboxes", {}, key=greta)
    assert (resp.status, resp.error) == (
        403, ("refused", "over the quota of tenant gamma: 3 cpus of 1; delete sandboxes or ask an admin for a larger quota"))  # fmt: skip
    assert [s["id"] for s in fleet.gw.request("GET", "/v1/sandboxes", key=greta).json()["sandboxes"]] == [
        first["id"]
    ]
    live = [s for node in fleet.nodes.values() for s in node.request("GET", "/v1/sandboxes").json()["sandboxes"]
            if s["labels"].get("gateway.tenant") == "gamma" and s["state"] != "terminated"]  # fmt: skip
    assert [s["id"] for s in live] == [first["id"]]

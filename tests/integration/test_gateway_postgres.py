"""A real sandbox-gateway keeping its state in PostgreSQL (a private cluster, tests/support/pg_cluster.py) in
front of a real sandboxd: keys made offline and through the API, create/run/delete, cordon and quotas, the owner
lock against offline commands (a second replica serves beside the first), and restarts (SIGTERM and SIGKILL) that take everything
back."""

from __future__ import annotations

import base64
import json
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from pg_cluster import PgCluster
from sandboxd_harness import Sandboxd

ALL = ("sandbox:read", "sandbox:create", "sandbox:delete")


class World:
    def __init__(
        self, gw: GatewayProcess, node: Sandboxd, cluster: PgCluster, url: str, workdir: Path
    ) -> None:
        self.gw = gw
        self.node = node
        self.cluster = cluster
        self.url = url
        self.workdir = workdir


@pytest.fixture(scope="module")
def world(pg_cluster: PgCluster) -> Iterator[World]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgw-pg-", dir="/var/tmp"))
    (workdir / "n1").mkdir()
    (workdir / "gw").mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "a"]).start()
    url = pg_cluster.create_database()
    gw = GatewayProcess(
        workdir / "gw", [("n1", node)], FAST_ARGS, database=url, database_env=pg_cluster.env()
    )
    try:
        yield World(gw, node, pg_cluster, url, workdir)
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def test_a_gateway_on_postgresql_serves_and_takes_everything_back(world: World) -> None:
    gw = world.gw
    # The first admin key, made offline against the database; the gateway's tables are there once it ran.
    admin = gw.create_key("root", "admin")
    alice = gw.create_key("alice", *ALL, tenant="acme")
    gw.start()
    assert gw.request("GET", "/v1/whoami", key=alice).json()["user"] == "alice"

    # While it serves, the offline commands are refused and change nothing.
    for args in (["keys", "list"], ["keys", "create", "--user", "x", "--scope", "admin"], ["nodes", "list"]):
        refused = gw.cli(*args, check=False)
        assert refused.returncode == 1 and "another sandbox-gateway holds the database" in refused.stderr
    # A second replica on the same database serves beside it (the owner lock is shared between replicas); the
    # offline commands stay refused while either serves, and while only the second one does.
    (world.workdir / "gw2").mkdir()
    second = GatewayProcess(world.workdir / "gw2", [("n1", world.node)], FAST_ARGS, database=world.url,
                            database_env=world.cluster.env())  # fmt: skip
    try:
        second.start()
        assert second.request("GET", "/v1/whoami", key=alice).json()["user"] == "alice"
        for args in (["keys", "list"], ["nodes", "list"]):
            refused = gw.cli(*args, check=False)
            assert refused.returncode == 1 and "another sandbox-gateway holds the database" in refused.stderr
        gw.stop()
        refused = gw.cli("keys", "create", "--user", "x", "--scope", "admin", check=False)
        assert refused.returncode == 1 and "another sandbox-gateway holds the database" in refused.stderr
        gw.start()
    finally:
        second.stop()

    # Keys made and revoked through the API; create, run, delete.
    made = gw.request("POST", "/v1/admin/keys", {"user": "bob", "scopes": list(ALL)}, key=admin)
    assert made.status == 201, made.body
    bob = made.json()["secret"]
    doomed = gw.request("POST", "/v1/admin/keys", {"user": "eve", "scopes": list(ALL)}, key=admin).json()
    assert gw.request("DELETE", f"/v1/admin/keys/{doomed['id']}", key=admin).status in (200, 204)
    assert gw.request("GET", "/v1/whoami", key=doomed["secret"]).status == 401
    kept = gw.create(alice, name="kept")
    gone = gw.create(bob)
    run = gw.request("POST", f"/v1/sandboxes/{kept['id']}/run", {"argv": ["sh", "-c", "echo hi"]}, key=alice)
    assert run.status == 200 and base64.b64decode(run.json()["stdout"]) == b"hi\n"
    assert gw.request("DELETE", f"/v1/sandboxes/{gone['id']}", key=bob).status in (200, 202, 204)
    wait_for(lambda: gw.request("GET", "/v1/sandboxes", key=bob).json()["sandboxes"] == [], 60)
    assert gw.request("POST", "/v1/admin/nodes/n1/cordon", {"cordoned": True}, key=admin).status == 200
    quota = gw.request("PUT", "/v1/admin/quotas/acme", {"sandboxes": 5}, key=admin)
    assert quota.status == 200, quota.body

    def everything_is_back(cordoned: bool = True) -> None:
        assert gw.request("GET", "/v1/whoami", key=bob).json()["user"] == "bob"
        assert gw.request("GET", "/v1/whoami", key=doomed["secret"]).status == 401
        got = gw.request("GET", "/v1/sandboxes/kept", key=alice)
        assert got.status == 200 and got.json()["id"] == kept["id"]
        assert gw.request("GET", f"/v1/sandboxes/{kept['id']}", key=bob).status == 404  # still alice's
        assert [s["id"] for s in gw.request("GET", "/v1/sandboxes", key=bob).json()["sandboxes"]] == []
        nodes = gw.request("GET", "/v1/admin/nodes", key=admin).json()["nodes"]
        assert [n["cordoned"] for n in nodes if n["name"] == "n1"] == [cordoned]
        quotas = gw.request("GET", "/v1/admin/quotas", key=admin).json()["quotas"]
        assert [q["sandboxes"] for q in quotas if q["tenant"] == "acme"] == [5]

    everything_is_back()
    # A stop, then the offline commands see what the API wrote (the same database).
    gw.stop()
    listed = json.loads(gw.cli("keys", "list", "--json").stdout)["keys"]
    assert {k["user"] for k in listed} == {"root", "alice", "bob", "eve"}
    assert [k.get("revoked") is not None for k in listed if k["user"] == "eve"] == [True]
    gw.start()
    everything_is_back()
    # SIGKILL: nothing acknowledged is lost, and the dead gateway's hold on the database goes with it.
    assert gw.request("POST", "/v1/admin/nodes/n1/cordon", {"cordoned": False}, key=admin).status == 200
    after = gw.create(alice, name="after-restart")
    gw.kill()
    gw.start()
    everything_is_back(cordoned=False)
    assert gw.request("GET", "/v1/sandboxes/after-restart", key=alice).json()["id"] == after["id"]
    run = gw.request("POST", f"/v1/sandboxes/{after['id']}/run", {"argv": ["true"]}, key=alice)
    assert run.status == 200 and run.json()["exit_code"] == 0
    for s in (kept, after):
        assert gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=alice).status in (200, 202, 204)
    wait_for(lambda: gw.request("GET", "/v1/sandboxes", key=alice).json()["sandboxes"] == [], 60)


def test_a_gateway_that_loses_its_database_stops_and_starts_again(world: World) -> None:
    """PostgreSQL crashes under a serving gateway: its owner lock is gone with the connection, so the gateway
    stops with exit 1 (systemd starts it again) rather than write on beside another owner; once the database is
    back, a start takes everything back."""
    cluster = PgCluster.start()  # its own: this one crashes
    try:
        (world.workdir / "gw3").mkdir()
        gw = GatewayProcess(world.workdir / "gw3", [("n1", world.node)], FAST_ARGS,
                            database=cluster.create_database(), database_env=cluster.env())  # fmt: skip
        admin = gw.create_key("root", "admin")
        gw.start()
        try:
            made = gw.request("POST", "/v1/admin/keys", {"user": "bob", "scopes": list(ALL)}, key=admin)
            assert made.status == 201
            cluster.pause()
            assert gw.proc is not None
            assert gw.proc.wait(timeout=60) == 1
            log = gw.log_text()
            assert "lost the database's owner lock; stopping" in log
            assert "stopped: the database let go of this gateway's owner lock" in log
            assert cluster.password not in log
            cluster.resume()
            gw.start()
            assert gw.request("GET", "/v1/whoami", key=made.json()["secret"]).json()["user"] == "bob"
        finally:
            gw.stop()
    finally:
        cluster.stop()

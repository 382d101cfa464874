"""A serving gateway on PostgreSQL with a synchronous streaming standby, as docs/ha.md deploys it: the database
URL names both servers with ``target_session_attrs=read-write``. The primary is stopped as a crash would, the
standby promoted; the gateway, having lost its owner lock, stops with exit 1 and, started again (as systemd's
``Restart=on-failure`` does), finds the new primary by itself, with every write it had acknowledged."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from gateway_harness import GatewayProcess, wait_for
from pg_cluster import PgCluster


@pytest.fixture
def primary() -> Iterator[PgCluster]:
    cluster = PgCluster.start()  # its own: this one is stopped under the gateway
    try:
        yield cluster
    finally:
        cluster.stop()


def test_a_gateway_restarts_onto_the_promoted_standby_with_every_acknowledged_write(
    primary: PgCluster,
) -> None:
    url = primary.create_database()
    dbname = url.split("@/", 1)[1].split("?")[0]
    standby = primary.standby("standby", synchronous=True)
    workdir = Path(tempfile.mkdtemp(prefix="sbxgw-failover-", dir="/var/tmp"))
    try:
        both = f"postgresql://sbx@/{dbname}?host={primary.socket_dir},{standby.socket_dir}" \
               "&target_session_attrs=read-write"  # fmt: skip
        gw = GatewayProcess(workdir, [], database=both, database_env=primary.env())
        admin = gw.create_key("root", "admin")
        gw.start()
        acknowledged = []
        for i in range(20):
            made = gw.request(
                "POST", "/v1/admin/keys", {"user": f"u{i}", "scopes": ["sandbox:read"]}, key=admin
            )
            assert made.status == 201, made.body
            acknowledged.append(made.json())
        with standby.connect(
            dbname
        ) as conn:  # already there, before any failover: the standby is synchronous
            ids = {row[0] for row in conn.execute("SELECT id FROM keys").fetchall()}
        assert {k["id"] for k in acknowledged} <= ids

        primary.pause()  # the primary crashes
        assert gw.proc is not None
        assert gw.proc.wait(60) == 1  # lost its owner lock: stops, for systemd to start it again
        assert "lost the database's owner lock" in gw.log_text()
        standby.promote()
        gw.start()  # what Restart=on-failure does; libpq skips the dead primary and takes the new one
        listed = gw.request("GET", "/v1/admin/keys", key=admin).json()["keys"]
        assert {k["id"] for k in acknowledged} <= {k["id"] for k in listed}
        for key in acknowledged:
            assert gw.request("GET", "/v1/whoami", key=key["secret"]).json()["user"] == key["user"]
        again = gw.request("POST", "/v1/admin/keys", {"user": "after", "scopes": ["sandbox:read"]}, key=admin)
        assert again.status == 201, again.body
        assert gw.request("GET", "/v1/ready").status == 200
        gw.stop()
        wait_for(lambda: gw.proc is not None and gw.proc.poll() is not None, 30)
    finally:
        standby.stop()
        shutil.rmtree(workdir, ignore_errors=True)

"""Exposed ports across gateway replicas on PostgreSQL (docs/ports.md, docs/ha.md): a port token made on one
replica opens the port on the other at once, the cookie it is traded for works on both, a public flag set on one
is in force on the other, and revoking the key on one closes the port on the other."""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from pg_cluster import PgCluster
from sandboxd_harness import Response, Sandboxd, send

ALL = ("sandbox:read", "sandbox:create", "sandbox:delete")
DOMAIN = "ports.test"
#: The spec's bound for a revocation to take effect on every replica.
REVOCATION_BOUND_SECS = 2.0


@pytest.fixture(scope="module")
def replicas(pg_cluster: PgCluster) -> Iterator[tuple[GatewayProcess, GatewayProcess, str]]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgw-ports-ha-", dir="/var/tmp"))
    for d in ("n1", "a", "b"):
        (workdir / d).mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "pr"]).start()
    url, env = pg_cluster.create_database(), pg_cluster.env()
    a, b = (
        GatewayProcess(workdir / name, [("n1", node)], [*FAST_ARGS, "--ports-domain", DOMAIN], database=url,
                       database_env=env)
        for name in ("a", "b")
    )  # fmt: skip
    admin = a.create_key("root", "admin")
    try:
        a.start()
        b.start()
        yield a, b, admin
    finally:
        a.stop()
        b.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def visit(gw: GatewayProcess, host: str, path: str = "/", headers: dict[str, str] | None = None) -> Response:
    return send(gw.connection(60), "GET", path, None, None, {"Host": host, **(headers or {})})


def test_tokens_cookies_public_flags_and_revocation_hold_on_every_replica(
    replicas: tuple[GatewayProcess, GatewayProcess, str],
) -> None:
    a, b, admin = replicas
    made = a.request("POST", "/v1/admin/keys", {"user": "alice", "scopes": list(ALL)}, key=admin)
    assert made.status == 201, made.body
    alice, alice_id = made.json()["secret"], made.json()["id"]
    box = a.create(alice, name="web")["id"]
    started = a.request("POST", f"/v1/sandboxes/{box}/processes", {
        "argv": ["python3", "-m", "http.server", "8080", "--directory", "/etc"],
    }, key=alice)  # fmt: skip
    assert started.status == 201, started.body
    wait_for(lambda: 8080 in [p["port"] for p in a.request("GET", f"/v1/sandboxes/{box}/ports", key=alice).json()
                              ["ports"] if p["listening"]], 30)  # fmt: skip
    for maker, opener in ((a, b), (b, a)):
        token = maker.request("POST", f"/v1/sandboxes/{box}/ports/8080/tokens", {}, key=alice)
        assert token.status == 201, token.body
        parts = urlsplit(token.json()["url"])
        host = parts.netloc.split(":")[0]
        # Opened on the other replica, the very next request: traded for a cookie there.
        traded = visit(opener, host, f"{parts.path}?{parts.query}")
        assert traded.status == 303, (traded.status, traded.body)
        cookie = traded.headers["set-cookie"].split(";")[0]
        for gw in (a, b):
            page = visit(gw, host, "/hostname", {"Cookie": cookie})
            assert page.status == 200, (page.status, page.body)
    host = urlsplit(token.json()["url"]).netloc.split(":")[0]
    # Public on one replica: open to anyone on the other at once; private again likewise.
    assert a.request("PUT", f"/v1/sandboxes/{box}/ports/8080", {"public": True}, key=alice).status == 200
    assert visit(b, host, "/hostname").status == 200
    assert b.request("PUT", f"/v1/sandboxes/{box}/ports/8080", {"public": False}, key=alice).status == 200
    assert visit(a, host, "/hostname").status == 401
    # The key revoked on A: its cookie opens nothing on B within the spec's bound.
    assert a.request("DELETE", f"/v1/admin/keys/{alice_id}", key=admin).status in (200, 204)
    revoked = time.monotonic()
    wait_for(lambda: visit(b, host, "/hostname", {"Cookie": cookie}).status == 401, 10)
    assert time.monotonic() - revoked < REVOCATION_BOUND_SECS

"""sandbox-gateway in front of a real sandboxd: keys, scopes, Origin, ownership, labels, relay of runs, streams,
files, attach and tunnel, revocation, orgs, audit and metrics."""

from __future__ import annotations

import base64
import json
import shutil
import socket
import struct
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from sandboxd_harness import Sandboxd, free_port

from sbx.gateway.keys import SCOPES


class Fleet:
    def __init__(self, gw: GatewayProcess, node: Sandboxd, keys: dict[str, str]) -> None:
        self.gw = gw
        self.node = node
        self.keys = keys


@pytest.fixture(scope="module")
def fleet() -> Iterator[Fleet]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgw-", dir="/var/tmp"))
    (workdir / "n1").mkdir()
    (workdir / "gw").mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "a"]).start()
    metrics_port = free_port()
    gw = GatewayProcess(
        workdir / "gw", [("n1", node)],
        [*FAST_ARGS, "--cors-origin", "https://console.example", "--metrics-listen", f"127.0.0.1:{metrics_port}",
         "--max-orgs-per-user", "2"],
    )  # fmt: skip
    all_three = ("sandbox:read", "sandbox:create", "sandbox:delete")
    keys = {
        "admin": gw.create_key("root", "admin"),
        "alice": gw.create_key("alice", *all_three, "org:create", tenant="acme"),
        "alice2": gw.create_key("alice", *all_three, tenant="acme"),
        "carol": gw.create_key("carol", *all_three, tenant="acme"),
        "bob": gw.create_key("bob", *all_three, "org:create", tenant="beta"),
        "dan": gw.create_key("dan", *all_three),
    }
    for scope in sorted(SCOPES):
        keys[f"only:{scope}"] = gw.create_key("scoper", scope)
    gw.start()
    gw.metrics_port = metrics_port  # type: ignore[attr-defined]
    try:
        yield Fleet(gw, node, keys)
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def err(resp: Any) -> tuple[int, str, str]:
    code, message = resp.error
    return resp.status, code, message


# -- auth, Origin, scopes ---------------------------------------------------------------------------


def test_health_needs_no_key_and_whoami_names_the_key(fleet: Fleet) -> None:
    gw = fleet.gw
    assert gw.request("GET", "/v1/health").json() == {"status": "ok"}
    me = gw.request("GET", "/v1/whoami", key=fleet.keys["alice"]).json()
    assert me["user"] == "alice" and me["tenant"] == "acme" and me["key_id"].startswith("key_")
    assert me["org"] is None and "sandbox:read" in me["scopes"]


@pytest.mark.parametrize(
    ("headers", "expected"),
    [
        ({}, (401, "unauthorized", "missing API key: send Authorization: Bearer sgk_...")),
        ({"Authorization": "Bearer sgk_not-a-key"}, (401, "unauthorized", "unknown or revoked API key")),
        (
            {"Authorization": "Basic abc"},
            (401, "unauthorized", "missing API key: send Authorization: Bearer sgk_..."),
        ),
    ],
)
def test_missing_or_unknown_key_is_401(
    fleet: Fleet, headers: dict[str, str], expected: tuple[int, str, str]
) -> None:
    before = fleet.gw.request("GET", "/v1/sandboxes", key=fleet.keys["admin"]).json()
    assert err(fleet.gw.request("GET", "/v1/sandboxes", headers=headers)) == expected
    assert err(fleet.gw.request("POST", "/v1/sandboxes", {}, headers=headers)) == expected
    assert fleet.gw.request("GET", "/v1/sandboxes", key=fleet.keys["admin"]).json() == before


def test_origin_is_checked_before_the_key(fleet: Fleet) -> None:
    gw = fleet.gw
    status, code, message = err(gw.request("GET", "/v1/whoami", headers={"Origin": "https://evil.example"}))
    assert (status, code) == (403, "forbidden_origin") and "--cors-origin" in message
    ok = gw.request(
        "GET", "/v1/whoami", key=fleet.keys["alice"], headers={"Origin": "https://console.example"}
    )
    assert ok.status == 200 and ok.headers["access-control-allow-origin"] == "https://console.example"
    own = gw.request(
        "GET", "/v1/whoami", key=fleet.keys["alice"], headers={"Origin": f"http://127.0.0.1:{gw.port}"}
    )
    assert own.status == 200


# (method, path, body, scopes that pass; None = any key). Refs name nothing, so a key with the scope gets an
# answer other than 403 (404, 400, 501) and nothing is created.
ROUTES: list[tuple[str, str, Any, str | None]] = [
    ("GET", "/v1/sandboxes", None, "sandbox:read"),
    ("POST", "/v1/sandboxes", {"bogus": 1}, "sandbox:create"),
    ("GET", "/v1/sandboxes/nope", None, "sandbox:read"),
    ("PATCH", "/v1/sandboxes/nope", {}, "sandbox:create"),
    ("DELETE", "/v1/sandboxes/nope", None, "sandbox:delete"),
    ("POST", "/v1/sandboxes/nope/run", {"argv": ["true"]}, "sandbox:create"),
    ("GET", "/v1/sandboxes/nope/processes", None, "sandbox:read"),
    ("POST", "/v1/sandboxes/nope/processes", {"argv": ["true"]}, "sandbox:create"),
    ("GET", "/v1/sandboxes/nope/processes/1", None, "sandbox:read"),
    ("GET", "/v1/sandboxes/nope/processes/1/output", None, "sandbox:read"),
    ("POST", "/v1/sandboxes/nope/processes/1/stdin", None, "sandbox:create"),
    ("POST", "/v1/sandboxes/nope/processes/1/signal", {"signal": "INT"}, "sandbox:create"),
    ("GET", "/v1/sandboxes/nope/processes/1/attach", None, "sandbox:create"),
    ("GET", "/v1/sandboxes/nope/tunnel?port=80", None, "sandbox:create"),
    ("GET", "/v1/sandboxes/nope/files?path=/etc/hostname", None, "sandbox:read"),
    ("PUT", "/v1/sandboxes/nope/files?path=/tmp/x", None, "sandbox:create"),
    ("DELETE", "/v1/sandboxes/nope/files?path=/tmp/x", None, "sandbox:create"),
    ("GET", "/v1/sandboxes/nope/dirs?path=/", None, "sandbox:read"),
    ("GET", "/v1/sandboxes/nope/events", None, "sandbox:read"),
    ("GET", "/v1/sandboxes/nope/metrics", None, "sandbox:read"),
    ("POST", "/v1/sandboxes/nope/suspend", None, "sandbox:create"),
    ("POST", "/v1/sandboxes/nope/resume", None, "sandbox:create"),
    ("POST", "/v1/sandboxes/nope/snapshots", {}, "sandbox:create"),
    ("PUT", "/v1/sandboxes/nope/snapshot-schedule", {}, "sandbox:create"),
    ("POST", "/v1/sandboxes/nope/ssh-access", {}, "sandbox:ssh"),
    ("GET", "/v1/volumes", None, "sandbox:read"),
    ("POST", "/v1/volumes", {}, "sandbox:create"),
    ("DELETE", "/v1/volumes/nope", None, "sandbox:delete"),
    ("GET", "/v1/snapshots", None, "sandbox:read"),
    ("DELETE", "/v1/snapshots/nope", None, "sandbox:delete"),
    ("GET", "/v1/ssh-keys", None, "sandbox:ssh"),
    ("POST", "/v1/ssh-keys", {}, "sandbox:ssh"),
    ("DELETE", "/v1/ssh-keys/nope", None, "sandbox:ssh"),
    ("PUT", "/v1/secrets/TOKEN", {"value": "x"}, "secrets:write"),
    ("DELETE", "/v1/secrets/TOKEN", None, "secrets:write"),
    ("GET", "/v1/secrets", None, "sandbox:read"),
    ("GET", "/v1/jobs", None, "sandbox:read"),
    ("POST", "/v1/jobs", {}, "sandbox:create"),
    ("GET", "/v1/services", None, "sandbox:read"),
    ("POST", "/v1/services", {}, "sandbox:create"),
    ("POST", "/v1/agent-runs", {}, "sandbox:create"),
    ("POST", "/v1/orgs", {"name": "Bad!"}, "org:create"),
    ("GET", "/v1/admin/keys", None, "admin"),
    ("POST", "/v1/admin/keys", {}, "admin"),
    ("DELETE", "/v1/admin/keys/key_nope", None, "admin"),
    ("GET", "/v1/admin/nodes", None, "admin"),
    ("POST", "/v1/admin/nodes", {}, "admin"),
    ("DELETE", "/v1/admin/nodes/nope", None, "admin"),
    ("POST", "/v1/admin/nodes/nope/cordon", {"cordoned": True}, "admin"),
    ("POST", "/v1/admin/nodes/nope/drain", {}, "admin"),
    ("GET", "/v1/admin/lost", None, "admin"),
    ("GET", "/v1/admin/audit", None, "admin"),
    ("GET", "/v1/admin/orgs", None, "admin"),
    ("GET", "/v1/admin/ssh-keys?user=x", None, "admin"),
    ("GET", "/v1/whoami", None, None),
    ("GET", "/v1/capabilities", None, None),
    ("GET", "/v1/orgs", None, None),
    ("GET", "/v1/ssh", None, None),
]


def test_every_scope_against_every_route(fleet: Fleet) -> None:
    before = fleet.gw.request("GET", "/v1/sandboxes", key=fleet.keys["admin"]).json()
    failures = []
    for method, path, body, needed in ROUTES:
        for scope in sorted(SCOPES):
            resp = fleet.gw.request(method, path, body, key=fleet.keys[f"only:{scope}"])
            allowed = needed is None or scope in (needed, "admin")
            if allowed and resp.status == 403 and resp.error[0] == "refused":
                failures.append(f"{scope} refused on {method} {path}: {resp.body!r}")
            refusal = (
                "refused",
                f"this API key lacks the scope {needed}: ask an admin for a key with {needed}",
            )
            if not allowed and (resp.status != 403 or resp.error != refusal):
                failures.append(f"{scope} not refused on {method} {path}: {resp.status} {resp.body!r}")
    assert not failures, "\n".join(failures)
    assert fleet.gw.request("GET", "/v1/sandboxes", key=fleet.keys["admin"]).json() == before


NO_SECRETS_KEY = "this gateway keeps no secrets: start it with --secrets-key-file (make a key with sandbox-gateway secrets-key new FILE)"


@pytest.mark.parametrize(
    ("method", "path", "expected"),
    [
        ("GET", "/v1/node", (404, "not_found", "a gateway does not serve /v1/node: use GET /v1/admin/nodes with an admin key")),
        ("POST", "/v1/node/cordon", (404, "not_found", "a gateway does not serve /v1/node: use GET /v1/admin/nodes with an admin key")),
        ("GET", "/v1/images", (501, "unsupported", "a gateway does not manage images: install them on each node with its images API")),
        ("POST", "/v1/images", (501, "unsupported", "a gateway does not manage images: install them on each node with its images API")),
        ("GET", "/v1/ssh", (404, "unsupported", "this gateway serves no SSH: start it with --ssh-listen HOST:PORT")),
        ("POST", "/v1/ssh-keys", (404, "unsupported", "this gateway serves no SSH: start it with --ssh-listen HOST:PORT")),
        ("GET", "/v1/ssh-keys", (404, "unsupported", "this gateway serves no SSH: start it with --ssh-listen HOST:PORT")),
        ("DELETE", "/v1/ssh-keys/ssh_x", (404, "unsupported", "this gateway serves no SSH: start it with --ssh-listen HOST:PORT")),
        ("POST", "/v1/sandboxes/x/ssh-access", (404, "unsupported", "this gateway serves no SSH: start it with --ssh-listen HOST:PORT")),
        ("GET", "/v1/admin/ssh-keys?user=x", (404, "unsupported", "this gateway serves no SSH: start it with --ssh-listen HOST:PORT")),
        ("DELETE", "/v1/admin/ssh-keys/ssh_x", (404, "unsupported", "this gateway serves no SSH: start it with --ssh-listen HOST:PORT")),
        ("GET", "/v1/secrets", (501, "unsupported", NO_SECRETS_KEY)),
    ],
)  # fmt: skip
def test_endpoints_a_gateway_does_not_serve(
    fleet: Fleet, method: str, path: str, expected: tuple[int, str, str]
) -> None:
    def node_state() -> tuple[Any, bool]:
        images = fleet.node.request("GET", "/v1/images").json()
        return images, fleet.node.request("GET", "/v1/node").json()["cordoned"]

    before = node_state()
    resp = fleet.gw.request(method, path, {} if method == "POST" else None, key=fleet.keys["admin"])
    assert err(resp) == expected
    assert node_state() == before


def test_capabilities_never_offer_images(fleet: Fleet) -> None:
    caps = fleet.gw.request("GET", "/v1/capabilities", key=fleet.keys["dan"]).json()
    assert caps["api_version"] == "v1" and caps["capabilities"]["images"] is False
    assert (
        caps["limits"]["max_cpus"]
        == fleet.node.request("GET", "/v1/capabilities").json()["limits"]["max_cpus"]
    )


# -- ownership and labels ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("labels", "message"),
    [
        (
            {"gateway.owner": "mallory"},
            "label 'gateway.owner': labels beginning gateway. are set by the gateway",
        ),
        ({"gateway.x": "1"}, "label 'gateway.x': labels beginning gateway. are set by the gateway"),
        ({f"k{i}": "v" for i in range(31)}, "labels: 31 labels given; at most 30 through a gateway"),
    ],
)
def test_label_rules_on_create(fleet: Fleet, labels: dict[str, str], message: str) -> None:
    before = fleet.node.request("GET", "/v1/sandboxes").json()
    status, code, got = err(
        fleet.gw.request("POST", "/v1/sandboxes", {"labels": labels}, key=fleet.keys["dan"])
    )
    assert (status, code) == (400, "invalid_request") and got.startswith(message)
    assert fleet.node.request("GET", "/v1/sandboxes").json() == before


def test_two_users_two_tenants_see_only_their_own(fleet: Fleet) -> None:
    gw, k = fleet.gw, fleet.keys
    a = gw.create(k["alice"], name="shared-name", labels={"team": "x"})
    b = gw.create(k["bob"], name="bobs-name")
    try:
        assert a["labels"] == {"team": "x", "gateway.owner": "alice", "gateway.tenant": "acme"}
        assert b["labels"] == {"gateway.owner": "bob", "gateway.tenant": "beta"}
        ids = lambda key: {s["id"] for s in gw.request("GET", "/v1/sandboxes", key=key).json()["sandboxes"]}
        assert a["id"] in ids(k["alice"]) and b["id"] not in ids(k["alice"])
        assert b["id"] in ids(k["bob"]) and a["id"] not in ids(k["bob"])
        assert a["id"] in ids(k["alice2"])  # another key of the same user and tenant
        assert a["id"] not in ids(k["carol"])  # same tenant, other user
        assert {a["id"], b["id"]} <= ids(k["admin"])
        # The name resolves to each caller's own sandbox.
        assert gw.request("GET", "/v1/sandboxes/shared-name", key=k["alice"]).json()["id"] == a["id"]
        assert gw.request("GET", "/v1/sandboxes/bobs-name", key=k["bob"]).json()["id"] == b["id"]
        assert err(gw.request("GET", "/v1/sandboxes/shared-name", key=k["bob"]))[:2] == (404, "not_found")
        # Someone else's sandbox is 404, exactly like one that does not exist; nothing changes.
        for method, path, body in [("GET", "", None), ("POST", "/run", {"argv": ["true"]}), ("DELETE", "", None),
                                   ("PATCH", "", {"name": "stolen"})]:  # fmt: skip
            resp = gw.request(method, f"/v1/sandboxes/{a['id']}{path}", body, key=k["bob"])
            assert err(resp) == (404, "not_found", f"no sandbox {a['id']!r} among yours")
        assert err(gw.request("GET", "/v1/sandboxes/sbx_a_0000000000000000", key=k["bob"]))[:2] == (
            404,
            "not_found",
        )
        assert gw.request("GET", f"/v1/sandboxes/{a['id']}", key=k["alice"]).json()["name"] == "shared-name"
        # Names are unique per user: a second live one is 409 and makes nothing.
        count = len(fleet.node.request("GET", "/v1/sandboxes").json()["sandboxes"])
        status, code, message = err(
            gw.request("POST", "/v1/sandboxes", {"name": "shared-name"}, key=k["alice2"])
        )
        assert (status, code) == (
            409,
            "conflict",
        ) and "already have a live sandbox named 'shared-name'" in message
        assert len(fleet.node.request("GET", "/v1/sandboxes").json()["sandboxes"]) == count
    finally:
        gw.request("DELETE", f"/v1/sandboxes/{a['id']}", key=k["alice"])
        gw.request("DELETE", f"/v1/sandboxes/{b['id']}", key=k["bob"])


def test_one_node_two_users_one_name(fleet: Fleet) -> None:
    """One node, users of two tenants and two users of one tenant each with a sandbox named ``web``: every
    name ref reaches the caller's own; renames are per user; the node itself refuses to guess."""
    gw, k = fleet.gw, fleet.keys
    made = {who: gw.create(k[who], name="web") for who in ("alice", "bob", "carol")}
    by_id = {s["id"]: who for who, s in made.items()}
    try:
        for who, s in made.items():
            assert gw.request("GET", "/v1/sandboxes/web", key=k[who]).json()["id"] == s["id"]
            ran = gw.request("POST", "/v1/sandboxes/web/run", {"argv": ["true"]}, key=k[who])
            assert ran.status == 200 and ran.json()["exit_code"] == 0
        assert gw.request("GET", "/v1/sandboxes/web", key=k["alice2"]).json()["id"] == made["alice"]["id"]
        # Through the node itself a shared name is 409 naming the ids, never one of them.
        ids = ", ".join(sorted(by_id))
        direct = fleet.node.request("GET", "/v1/sandboxes/web")
        assert (direct.status, direct.error) == (
            409, ("conflict", f"the name 'web' matches 3 live sandboxes ({ids}); use the id"))  # fmt: skip
        # So is an admin's name look-up among others' (the admin has no sandbox of that name).
        assert err(gw.request("GET", "/v1/sandboxes/web", key=k["admin"])) == (
            409, "conflict", f"the name 'web' matches 3 live sandboxes ({ids}); use the id")  # fmt: skip
        # Renames by name: each user's own; a name another user holds is free, one's own is 409.
        renamed = gw.request("PATCH", "/v1/sandboxes/web", {"name": "app"}, key=k["alice"])
        assert renamed.status == 200 and renamed.json()["id"] == made["alice"]["id"]
        assert gw.request("GET", "/v1/sandboxes/web", key=k["bob"]).json()["id"] == made["bob"]["id"]
        assert err(gw.request("GET", "/v1/sandboxes/web", key=k["alice"]))[:2] == (404, "not_found")
        carol = gw.request("PATCH", "/v1/sandboxes/web", {"name": "app"}, key=k["carol"])
        assert carol.status == 200 and carol.json()["id"] == made["carol"]["id"]
        back = gw.request("PATCH", "/v1/sandboxes/app", {"name": "web"}, key=k["alice"])
        assert back.status == 200 and back.json()["name"] == "web"
        bob_app = gw.create(k["bob"], name="app")
        try:
            status, code, message = err(
                gw.request("PATCH", "/v1/sandboxes/web", {"name": "app"}, key=k["bob"])
            )
            assert (status, code, message) == (
                409, "conflict", "you already have a live sandbox named 'app': pick another name")  # fmt: skip
            assert (
                gw.request("GET", f"/v1/sandboxes/{made['bob']['id']}", key=k["bob"]).json()["name"] == "web"
            )
            for who, name in (("alice", "web"), ("carol", "app"), ("bob", "app")):
                want = bob_app["id"] if (who, name) == ("bob", "app") else made[who]["id"]
                assert gw.request("GET", f"/v1/sandboxes/{name}", key=k[who]).json()["id"] == want
        finally:
            gw.request("DELETE", f"/v1/sandboxes/{bob_app['id']}", key=k["bob"])
        # A DELETE by name ends the caller's own only.
        assert gw.request("DELETE", "/v1/sandboxes/web", key=k["bob"]).status == 204
        states = {s["id"]: s["state"] for s in fleet.node.request("GET", "/v1/sandboxes").json()["sandboxes"]}
        assert states[made["bob"]["id"]] == "terminated"
        assert states[made["alice"]["id"]] == states[made["carol"]["id"]] == "running"
    finally:
        for who, s in made.items():
            gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=k[who])


def test_patch_keeps_gateway_labels(fleet: Fleet) -> None:
    gw, key = fleet.gw, fleet.keys["dan"]
    s = gw.create(key, name="patchme")
    try:
        resp = gw.request("PATCH", f"/v1/sandboxes/{s['id']}", {"labels": {"a": "1"}}, key=key)
        assert resp.status == 200 and resp.json()["labels"] == {"a": "1", "gateway.owner": "dan"}
        same = gw.request("PATCH", f"/v1/sandboxes/{s['id']}", {"labels": {"gateway.owner": "dan"}}, key=key)
        assert same.status == 200 and same.json()["labels"] == {"gateway.owner": "dan"}
        status, code, message = err(
            gw.request("PATCH", f"/v1/sandboxes/{s['id']}", {"labels": {"gateway.owner": "eve"}}, key=key)
        )
        assert (status, code) == (400, "invalid_request") and "send them back unchanged" in message
        assert gw.request("GET", f"/v1/sandboxes/{s['id']}", key=key).json()["labels"] == {
            "gateway.owner": "dan"
        }
        renamed = gw.request("PATCH", "/v1/sandboxes/patchme", {"name": "renamed"}, key=key)
        assert renamed.status == 200
        assert gw.request("GET", "/v1/sandboxes/renamed", key=key).json()["id"] == s["id"]
        assert gw.request("GET", "/v1/sandboxes/patchme", key=key).status == 404
    finally:
        assert gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=key).status == 204


# -- relay: runs, files, streams, attach, tunnel ----------------------------------------------------


def test_run_files_and_errors_are_relayed_as_sent(fleet: Fleet) -> None:
    gw, key = fleet.gw, fleet.keys["dan"]
    s = gw.create(key)
    try:
        run = gw.request(
            "POST", f"/v1/sandboxes/{s['id']}/run", {"argv": ["sh", "-c", "echo hi; echo err >&2"]}, key=key
        )
        assert run.status == 200
        assert (
            base64.b64decode(run.json()["stdout"]) == b"hi\n"
            and base64.b64decode(run.json()["stderr"]) == b"err\n"
        )
        payload = bytes(range(256)) * 4096
        put = gw.request("PUT", f"/v1/sandboxes/{s['id']}/files?path=/tmp/blob", body=payload, key=key,
                         headers={"Content-Type": "application/octet-stream"})  # fmt: skip
        assert put.status == 204, put.body
        got = gw.request("GET", f"/v1/sandboxes/{s['id']}/files?path=/tmp/blob", key=key)
        assert got.status == 200 and got.body == payload
        # Errors from the node come back exactly as the node sent them.
        direct = fleet.node.request("POST", f"/v1/sandboxes/{s['id']}/run", {"argv": ["no-such-command"]})
        through = gw.request("POST", f"/v1/sandboxes/{s['id']}/run", {"argv": ["no-such-command"]}, key=key)
        assert (through.status, through.body) == (direct.status, direct.body)
    finally:
        gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=key)


def _frame(kind: bytes, payload: bytes = b"") -> bytes:
    return kind + struct.pack(">I", len(payload)) + payload


def _upgrade(gw: GatewayProcess, key: str, path: str, protocol: str) -> tuple[socket.socket, bytes]:
    sock = socket.create_connection(("127.0.0.1", gw.port), timeout=30)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\nConnection: Upgrade\r\n"
                 f"Upgrade: {protocol}\r\n\r\n".encode())  # fmt: skip
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    head, _, rest = head.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock, rest


def _read_all(sock: socket.socket, first: bytes = b"") -> bytes:
    data = first
    while chunk := sock.recv(65536):
        data += chunk
    return data


def test_attach_relays_frames_byte_for_byte(fleet: Fleet) -> None:
    gw, key = fleet.gw, fleet.keys["dan"]
    s = gw.create(key)
    try:
        proc = gw.request("POST", f"/v1/sandboxes/{s['id']}/processes", {"argv": ["cat"]}, key=key).json()
        sock, rest = _upgrade(
            gw, key, f"/v1/sandboxes/{s['id']}/processes/{proc['pid']}/attach", "sbx-stream/1"
        )
        sock.sendall(_frame(b"i", b"hello gateway\n") + _frame(b"e"))
        data = _read_all(sock, rest)
        sock.close()
        assert _frame(b"o", b"hello gateway\n") in data
        assert data.endswith(_frame(b"x", struct.pack(">i", 0)))
    finally:
        gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=key)


def test_tunnel_relays_bytes_and_half_close(fleet: Fleet) -> None:
    gw, key = fleet.gw, fleet.keys["dan"]
    s = gw.create(key)
    server = ("import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
              "s.bind(('127.0.0.1',7000));s.listen(1);print('up',flush=True)\nc,_=s.accept();d=b''\n"
              "while (x:=c.recv(65536)): d+=x\nc.sendall(d[::-1]);c.close()\n")  # fmt: skip
    try:
        gw.request("PUT", f"/v1/sandboxes/{s['id']}/files?path=/tmp/srv.py", body=server.encode(), key=key)
        proc = gw.request(
            "POST", f"/v1/sandboxes/{s['id']}/processes", {"argv": ["python3", "/tmp/srv.py"]}, key=key
        )
        pid = proc.json()["pid"]
        for event in gw.follow(key, s["id"], pid):
            if "data" in event:
                break
        sock, rest = _upgrade(gw, key, f"/v1/sandboxes/{s['id']}/tunnel?port=7000", "sbx-tunnel/1")
        payload = bytes(range(256)) * 1024
        sock.sendall(payload)
        sock.shutdown(socket.SHUT_WR)  # the half-close must reach the guest for it to answer
        assert _read_all(sock, rest) == payload[::-1]
        sock.close()
    finally:
        gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=key)


# -- revocation -------------------------------------------------------------------------------------


def _api_key(fleet: Fleet, user: str, tenant: str | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"user": user, "scopes": ["sandbox:read", "sandbox:create", "sandbox:delete"]}
    if tenant:
        body["tenant"] = tenant
    resp = fleet.gw.request("POST", "/v1/admin/keys", body, key=fleet.keys["admin"])
    assert resp.status == 201, resp.body
    return resp.json()  # type: ignore[no-any-return]


def test_revocation_cuts_a_followed_stream_before_delete_returns(fleet: Fleet) -> None:
    gw = fleet.gw
    doomed = _api_key(fleet, "erin")
    other = _api_key(fleet, "erin")
    assert doomed["secret"].startswith("sgk_")
    listed = gw.request("GET", "/v1/admin/keys", key=fleet.keys["admin"]).json()["keys"]
    assert doomed["secret"] not in json.dumps(listed) and any(k["id"] == doomed["id"] for k in listed)
    s = gw.create(doomed["secret"])
    try:
        loop = ["sh", "-c", "while true; do echo tick; sleep 0.1; done"]
        pid = gw.request(
            "POST", f"/v1/sandboxes/{s['id']}/processes", {"argv": loop}, key=doomed["secret"]
        ).json()["pid"]
        streams: dict[str, dict[str, Any]] = {}

        def follow(name: str, secret: str) -> None:
            state: dict[str, Any] = {"lines": 0, "ended": None}
            streams[name] = state
            conn = gw.connection(60)
            conn.request("GET", f"/v1/sandboxes/{s['id']}/processes/{pid}/output",
                         headers={"Authorization": f"Bearer {secret}"})  # fmt: skip
            resp = conn.getresponse()
            try:
                while resp.readline():
                    state["lines"] += 1
            except OSError:
                pass
            state["ended"] = time.monotonic()
            conn.close()

        threads = [threading.Thread(target=follow, args=(n, k["secret"]), daemon=True)
                   for n, k in (("doomed", doomed), ("other", other))]  # fmt: skip
        for t in threads:
            t.start()
        wait_for(lambda: len(streams) == 2 and all(v["lines"] > 2 for v in streams.values()))
        # A waiting run on the same key: cut before the node answered, so it gets 401.
        run_result: dict[str, Any] = {}
        runner = threading.Thread(target=lambda: run_result.update(r=gw.request(
            "POST", f"/v1/sandboxes/{s['id']}/run", {"argv": ["sleep", "30"]}, key=doomed["secret"])), daemon=True)  # fmt: skip
        runner.start()
        time.sleep(0.5)
        assert gw.request("DELETE", f"/v1/admin/keys/{doomed['id']}", key=fleet.keys["admin"]).status == 204
        returned = time.monotonic()
        threads[0].join(timeout=3)
        assert streams["doomed"]["ended"] is not None, "the revoked key's stream is still open"
        # Cut before DELETE returned (the reader thread may notice a moment later).
        assert streams["doomed"]["ended"] - returned < 1.0
        runner.join(timeout=5)
        assert err(run_result["r"])[:2] == (401, "unauthorized")
        assert streams["other"]["ended"] is None, "another key of the same user was cut"
        assert err(gw.request("GET", "/v1/whoami", key=doomed["secret"])) == (
            401,
            "unauthorized",
            "unknown or revoked API key",
        )
        revoked = [
            k
            for k in gw.request("GET", "/v1/admin/keys", key=fleet.keys["admin"]).json()["keys"]
            if k["id"] == doomed["id"]
        ]
        assert "revoked" in revoked[0]
        audit = gw.request("GET", "/v1/admin/audit?limit=1000", key=fleet.keys["admin"]).json()["entries"]
        closed = [e for e in audit if e.get("type") == "api.revoked" and e.get("key_id") == doomed["id"]]
        assert len(closed) == 2 and all(e["result"] == "closed" and e["target"] == s["id"] for e in closed)
        assert err(gw.request("DELETE", "/v1/admin/keys/key_nope", key=fleet.keys["admin"])) == (
            404, "not_found", "no API key 'key_nope'")  # fmt: skip
    finally:
        gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=fleet.keys["admin"])


# -- orgs -------------------------------------------------------------------------------------------


def test_org_rules(fleet: Fleet) -> None:
    gw, k = fleet.gw, fleet.keys
    org = lambda key, name, **kw: gw.request(
        "GET", "/v1/whoami", key=key, headers={"X-Sandbox-Org": name}, **kw
    )
    for bad in ["", "Upper", "1abc", "ab-", "a--b", "default", "admin", "x" * 31]:
        status, code, _ = err(gw.request("POST", "/v1/orgs", {"name": bad}, key=k["alice"]))
        assert (status, code) == (400, "invalid_request"), bad
    assert err(gw.request("POST", "/v1/orgs", {"name": "beta"}, key=k["alice"]))[:2] == (
        409,
        "conflict",
    )  # a tenant
    made = gw.request("POST", "/v1/orgs", {"name": "rocket"}, key=k["alice"])
    assert made.status == 201 and made.json()["created_by"] == "alice"
    assert err(gw.request("POST", "/v1/orgs", {"name": "ROCKET"}, key=k["bob"]))[:2] == (
        400,
        "invalid_request",
    )
    assert err(gw.request("POST", "/v1/orgs", {"name": "rocket"}, key=k["bob"]))[:2] == (409, "conflict")
    # Non-members: 404 'no such organization', the same as a nonexistent one.
    for name in ("rocket", "ghost"):
        assert err(org(k["bob"], name)) == (404, "not_found", "no such organization")
        assert err(gw.request("GET", f"/v1/orgs/{name}/members", key=k["bob"])) == (
            404,
            "not_found",
            "no such organization",
        )
    assert err(gw.request("GET", "/v1/orgs/acme/members", key=k["alice"])) == (
        404,
        "not_found",
        "no such organization",
    )
    # Given twice: 400.
    conn = gw.connection()
    conn.putrequest("GET", "/v1/whoami")
    for header, value in (
        ("Authorization", f"Bearer {k['alice']}"),
        ("X-Sandbox-Org", "rocket"),
        ("X-Sandbox-Org", "rocket"),
    ):
        conn.putheader(header, value)
    conn.endheaders()
    twice = conn.getresponse()
    assert twice.status == 400 and json.loads(twice.read())["error"]["code"] == "invalid_request"
    conn.close()
    # Own tenant by name changes nothing; the org header acts in it.
    assert org(k["alice"], "acme").json()["org"] is None
    assert org(k["alice"], "rocket").json()["org"] == "rocket"
    # Members: add bob from tenant beta; a member who is not an owner may not change anything.
    added = gw.request("POST", "/v1/orgs/rocket/members", {"user": "bob", "tenant": "beta"}, key=k["alice"])
    assert added.status == 201 and added.json()["role"] == "member" and added.json()["tenant"] == "beta"
    assert org(k["bob"], "rocket").json()["org"] == "rocket"
    assert err(gw.request("POST", "/v1/orgs/rocket/members", {"user": "carol"}, key=k["bob"]))[:2] == (
        403,
        "refused",
    )
    # The same user name from another tenant: 409.
    assert err(
        gw.request("POST", "/v1/orgs/rocket/members", {"user": "bob", "tenant": "acme"}, key=k["alice"])
    )[:2] == (409, "conflict")
    # Demoting or removing the last owner: 409; after promoting bob it works.
    assert err(
        gw.request("POST", "/v1/orgs/rocket/members", {"user": "alice", "role": "member"}, key=k["alice"])
    )[:2] == (409, "conflict")
    assert err(gw.request("DELETE", "/v1/orgs/rocket/members/alice", key=k["alice"]))[:2] == (409, "conflict")
    promoted = gw.request(
        "POST", "/v1/orgs/rocket/members", {"user": "bob", "tenant": "beta", "role": "owner"}, key=k["alice"]
    )
    assert promoted.status == 200 and promoted.json()["role"] == "owner"
    # Sandboxes made in the org belong to (user, org): the user's own tenant does not see them.
    s = gw.request("POST", "/v1/sandboxes", {}, key=k["bob"], headers={"X-Sandbox-Org": "rocket"}).json()
    try:
        assert s["labels"] == {"gateway.owner": "bob", "gateway.tenant": "rocket"}
        assert gw.request("GET", f"/v1/sandboxes/{s['id']}", key=k["bob"]).status == 404
        assert (
            gw.request(
                "GET", f"/v1/sandboxes/{s['id']}", key=k["bob"], headers={"X-Sandbox-Org": "rocket"}
            ).status
            == 200
        )
        listed = gw.request("GET", "/v1/orgs", key=k["bob"]).json()["orgs"]
        assert listed[0] == {"name": "beta", "role": "owner", "current": True}
        assert {"name": "rocket", "role": "owner", "current": False} == {
            x: listed[1][x] for x in ("name", "role", "current")
        }
        members = gw.request("GET", "/v1/orgs/rocket/members", key=k["bob"]).json()["members"]
        assert sorted((m["user"], m.get("tenant"), m["role"]) for m in members) == [
            ("alice", "acme", "owner"),
            ("bob", "beta", "owner"),
        ]
        assert gw.request("DELETE", "/v1/orgs/rocket/members/bob?tenant=beta", key=k["alice"]).status == 204
        assert err(org(k["bob"], "rocket")) == (404, "not_found", "no such organization")
        assert err(gw.request("DELETE", "/v1/orgs/rocket/members/bob", key=k["alice"]))[:2] == (
            404,
            "not_found",
        )
    finally:
        gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=k["admin"])
    # --max-orgs-per-user 2: alice owns rocket; one more, then 403.
    assert gw.request("POST", "/v1/orgs", {"name": "second"}, key=k["alice"]).status == 201
    status, code, message = err(gw.request("POST", "/v1/orgs", {"name": "third"}, key=k["alice"]))
    assert (status, code) == (403, "refused") and "--max-orgs-per-user 2" in message
    admin_orgs = gw.request("GET", "/v1/admin/orgs", key=k["admin"]).json()["orgs"]
    assert [o["name"] for o in admin_orgs] == ["rocket", "second"] and admin_orgs[0]["owners"] == ["alice"]
    audit = gw.request("GET", "/v1/admin/audit?limit=1000", key=k["admin"]).json()["entries"]
    kinds = {e["type"] for e in audit if e.get("kind") == "org"}
    assert {"org.created", "org.member_added", "org.member_role", "org.member_removed"} <= kinds


# -- audit and metrics ------------------------------------------------------------------------------


def test_audit_log_and_metrics(fleet: Fleet) -> None:
    gw, k = fleet.gw, fleet.keys
    marker = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() - 1))
    gw.request("GET", "/v1/sandboxes?label=secret=hunter2", key=k["dan"])
    resp = gw.request("GET", f"/v1/admin/audit?since={marker}&limit=1000", key=k["admin"])
    entries = resp.json()["entries"]
    assert any(e.get("route") == "/v1/sandboxes" and e.get("user") == "dan" for e in entries)
    log_file = gw.workdir / "audit" / "gateway.jsonl"
    assert log_file.stat().st_mode & 0o777 == 0o600
    text = log_file.read_text()
    assert "hunter2" not in text and "sgk_" not in text
    limited = gw.request("GET", "/v1/admin/audit?limit=1", key=k["admin"]).json()
    assert len(limited["entries"]) == 1 and limited["truncated"] is True
    for bad in ("limit=0", "limit=1001", "since=yesterday"):
        assert err(gw.request("GET", f"/v1/admin/audit?{bad}", key=k["admin"]))[:2] == (
            400,
            "invalid_request",
        )
    conn = __import__("http.client").client.HTTPConnection("127.0.0.1", gw.metrics_port, timeout=10)  # type: ignore[attr-defined]
    conn.request("GET", "/metrics")
    metrics = conn.getresponse().read().decode()
    assert 'sandbox_gateway_node_up{node="n1"} 1.0' in metrics
    assert (
        "sandbox_gateway_http_requests_total" in metrics
        and "sandbox_gateway_create_seconds_bucket" in metrics
    )
    for name in ("alice", "bob", "acme", "beta", "sbx_a_"):
        assert name not in metrics


def test_revocation_closes_attach_and_tunnel_on_both_sides(fleet: Fleet) -> None:
    gw = fleet.gw
    doomed = _api_key(fleet, "frank")
    s = gw.create(doomed["secret"])
    try:
        proc = gw.request(
            "POST", f"/v1/sandboxes/{s['id']}/processes", {"argv": ["cat"]}, key=doomed["secret"]
        ).json()
        hold = "import socket,time\ns=socket.socket();s.bind(('127.0.0.1',7001));s.listen(1);print('up',flush=True)\nc,_=s.accept();time.sleep(60)\n"
        gw.request(
            "PUT",
            f"/v1/sandboxes/{s['id']}/files?path=/tmp/hold.py",
            body=hold.encode(),
            key=doomed["secret"],
        )
        server = gw.request(
            "POST",
            f"/v1/sandboxes/{s['id']}/processes",
            {"argv": ["python3", "/tmp/hold.py"]},
            key=doomed["secret"],
        ).json()
        events = gw.follow(doomed["secret"], s["id"], server["pid"])
        for event in events:
            if "data" in event:
                break
        events.close()  # closes the followed stream, so only attach and tunnel stay open
        attach, _ = _upgrade(
            gw, doomed["secret"], f"/v1/sandboxes/{s['id']}/processes/{proc['pid']}/attach", "sbx-stream/1"
        )
        tunnel, _ = _upgrade(
            gw, doomed["secret"], f"/v1/sandboxes/{s['id']}/tunnel?port=7001", "sbx-tunnel/1"
        )
        attach.sendall(_frame(b"i", b"ping\n"))
        seen = b""
        while _frame(b"o", b"ping\n") not in seen:
            chunk = attach.recv(4096)
            assert chunk, seen
            seen += chunk
        assert gw.request("DELETE", f"/v1/admin/keys/{doomed['id']}", key=fleet.keys["admin"]).status == 204
        for sock in (attach, tunnel):
            sock.settimeout(2)
            try:
                rest = _read_all(sock)
            except ConnectionResetError:
                rest = b""
            assert not rest.endswith(_frame(b"x", struct.pack(">i", 0)))  # cut off, not a clean exit
            sock.close()
        # The process itself was not touched: detaching never stops it.
        processes = fleet.node.request("GET", f"/v1/sandboxes/{s['id']}/processes").json()
        listed = processes["processes"] if isinstance(processes, dict) else processes
        assert [p["state"] for p in listed if p["pid"] == proc["pid"]] == ["running"]
        audit = gw.request("GET", "/v1/admin/audit?limit=1000", key=fleet.keys["admin"]).json()["entries"]
        routes = sorted(
            e["route"] for e in audit if e.get("type") == "api.revoked" and e.get("key_id") == doomed["id"]
        )
        assert routes == ["GET /v1/sandboxes/{ref}/processes/{pid}/attach", "GET /v1/sandboxes/{ref}/tunnel"]
    finally:
        gw.request("DELETE", f"/v1/sandboxes/{s['id']}", key=fleet.keys["admin"])

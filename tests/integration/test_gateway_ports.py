"""Exposed ports (issue 33) through a real gateway (``--ports-domain ports.test``) in front of two real sandboxd
nodes with gVisor: real guest servers (HTTP, server-sent events and a WebSocket echo, written here) reached on
``<port>-<sandbox>.ports.test``: private by default (the owner's key in every spelling the auth takes, never seen
by the guest), port tokens traded for a cookie of that one host, public ports, the gateway's own answers (502, 404,
409), wake on traffic and activity, revocation, and hostile callers (a cookie of one label at another, Host and
X-Forwarded-Host confusion, the token kept out of the logs and the Referer, request smuggling, public caps)."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import time
from collections.abc import Iterator
from typing import Any

import aiohttp
import pytest
from gateway_harness import wait_for
from sandboxd_harness import Response, send
from services_world import World, world

pytestmark = pytest.mark.timeout(600)

DOMAIN = "ports.test"
PER_SANDBOX, TOTAL = 4, 6

#: The guest's server: ``/`` and anything else echo the method, path, headers and body as JSON; ``/sse?n=N``
#: sends N events 0.3 s apart; ``Upgrade: websocket`` is a WebSocket echoing text messages. Port from argv.
GUEST = r"""
import base64, hashlib, http.server, json, socketserver, sys, time
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        if self.headers.get("Upgrade", "").lower() == "websocket":
            return self.websocket()
        if self.path.startswith("/sse"):
            n = int(self.path.split("n=")[1])
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(n):
                if i:
                    time.sleep(0.3)
                data = ("data: event %d\n\n" % i).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            return
        self.echo(b"")
    def do_POST(self):
        self.echo(self.rfile.read(int(self.headers.get("Content-Length", "0"))))
    do_PUT = do_POST
    def echo(self, body):
        out = json.dumps({"method": self.command, "path": self.path, "headers": self.headers.items(),
                          "body_bytes": len(body), "port": PORT}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(out)))
        self.send_header("Set-Cookie", "app=1; Path=/")
        self.end_headers()
        self.wfile.write(out)
    def websocket(self):
        accept = base64.b64encode(hashlib.sha1((self.headers["Sec-WebSocket-Key"] +
                                  "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest()).decode()
        self.send_response(101)
        self.send_header("Upgrade", "websocket")
        self.send_header("Connection", "Upgrade")
        self.send_header("Sec-WebSocket-Accept", accept)
        self.end_headers()
        self.wfile.flush()
        while True:
            head = self.rfile.read(2)
            if len(head) < 2:
                return
            op, n = head[0] & 15, head[1] & 127
            if n == 126:
                n = int.from_bytes(self.rfile.read(2), "big")
            elif n == 127:
                n = int.from_bytes(self.rfile.read(8), "big")
            mask = self.rfile.read(4)
            data = bytes(b ^ mask[i % 4] for i, b in enumerate(self.rfile.read(n)))
            if op == 8:
                self.wfile.write(b"\x88\x00")
                return
            if op == 1:
                size = bytes([n]) if n < 126 else b"\x7e" + n.to_bytes(2, "big")
                self.wfile.write(b"\x81" + size + data)
                self.wfile.flush()
    def log_message(self, *args):
        pass
PORT = int(sys.argv[1])
class S(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    address_family = __import__("socket").AF_INET
S(("0.0.0.0", PORT), H).serve_forever()
"""


def start_guest(w: World, sandbox: str, *ports: int, key: str = "alice") -> None:
    """The guest server on each port, as daemons of a run (no API process: the sandbox may still idle)."""
    put = w.gw.request("PUT", f"/v1/sandboxes/{sandbox}/files?path=/tmp/guest.py", key=w.keys[key],
                       body=GUEST.encode())  # fmt: skip
    assert put.status in (200, 201, 204), put.body
    for port in ports:
        line = f"setsid python3 /tmp/guest.py {port} >/dev/null 2>&1 </dev/null &"
        w.ok("POST", f"/v1/sandboxes/{sandbox}/run", {"argv": ["sh", "-c", line]}, key=key)
    for port in ports:
        wait_for(lambda p=port: any(x["port"] == p and x["listening"]  # type: ignore[misc]
                                    for x in w.ok("GET", f"/v1/sandboxes/{sandbox}/ports", key=key)["ports"]),
                 30, 0.2)  # fmt: skip


def label(sandbox: str, port: int) -> str:
    return f"{port}-{sandbox.removeprefix('sbx_').replace('_', '-')}.{DOMAIN}"


def visit(w: World, host: str, path: str = "/", headers: dict[str, str] | None = None, method: str = "GET",
          body: bytes | None = None) -> Response:  # fmt: skip
    return send(w.gw.connection(60), method, path, None, body, {"Host": host, **(headers or {})})


def echoed(resp: Response) -> dict[str, Any]:
    assert resp.status == 200, (resp.status, resp.body[:500])
    return resp.json()  # type: ignore[no-any-return]


def cookie_of(resp: Response) -> str:
    return resp.headers["set-cookie"].split(";")[0]


@pytest.fixture(scope="module")
def w() -> Iterator[World]:
    with world(["--ports-domain", DOMAIN, "--max-public-connections-per-sandbox", str(PER_SANDBOX),
                "--max-public-connections", str(TOTAL)], prefix="sbxports-") as built:  # fmt: skip
        yield built


@pytest.fixture(scope="module")
def box(w: World) -> str:
    made = w.ok("POST", "/v1/sandboxes", {}, status=201)
    start_guest(w, made["id"], 8080, 9090)
    return str(made["id"])


def test_capability_listing_and_urls(w: World, box: str) -> None:
    assert w.ok("GET", "/v1/capabilities")["capabilities"]["exposed_ports"] is True
    listed = w.ok("GET", f"/v1/sandboxes/{box}/ports")["ports"]
    mine = {p["port"]: p for p in listed}
    assert mine[8080] == {
        "port": 8080,
        "url": f"http://{label(box, 8080)}/",
        "public": False,
        "listening": True,
    }
    assert mine[9090]["listening"] is True
    one = w.ok("GET", f"/v1/sandboxes/{box}/ports/7777")
    assert one == {"port": 7777, "url": f"http://{label(box, 7777)}/", "public": False, "listening": False}
    # Another user's sandbox is 404 on every endpoint, as for none.
    for method, path, body in [
        ("GET", "/ports", None),
        ("GET", "/ports/8080", None),
        ("PUT", "/ports/8080", {"public": True}),
        ("POST", "/ports/8080/tokens", {}),
    ]:
        resp = w.call(method, f"/v1/sandboxes/{box}{path}", body, key="bob")
        assert (resp.status, resp.json()["error"]["code"]) == (404, "not_found"), path


def test_bad_inputs_change_nothing(w: World, box: str) -> None:
    cases = [
        ("GET", "/ports/0", None, "port '0' must be an integer from 1 to 65535"),
        ("PUT", "/ports/65536", {"public": True}, "port '65536' must be an integer from 1 to 65535"),
        ("PUT", "/ports/8080", {"public": True, "extra": 1}, "extra"),
        ("PUT", "/ports/8080", {"public": "yes"}, "public"),
        ("POST", "/ports/8080/tokens", {"ttl_secs": 0}, "ttl_secs must be from 1 to 86400"),
        ("POST", "/ports/8080/tokens", {"ttl_secs": 86401}, "ttl_secs must be from 1 to 86400"),
        ("POST", "/ports/8080/tokens", {"ttl": 5}, "ttl"),
    ]
    before = w.ok("GET", f"/v1/sandboxes/{box}/ports")
    for method, path, body, message in cases:
        resp = w.call(method, f"/v1/sandboxes/{box}{path}", body)
        assert resp.status == 400 and resp.json()["error"]["code"] == "invalid_request", (path, resp.body)
        assert message in resp.json()["error"]["message"], (path, resp.body)
    assert w.ok("GET", f"/v1/sandboxes/{box}/ports") == before
    # A key that lacks sandbox:create may read, not change.
    assert w.call("PUT", f"/v1/sandboxes/{box}/ports/8080", {"public": True}, key="reader").status in (
        403,
        404,
    )


def test_private_by_default_and_the_key_never_reaches_the_guest(w: World, box: str) -> None:
    host = label(box, 8080)
    none = visit(w, host)
    assert (none.status, none.json()["error"]["code"]) == (401, "unauthorized")
    assert "is private" in none.json()["error"]["message"]
    bob = visit(w, host, headers={"Authorization": f"Bearer {w.keys['bob']}"})
    assert (bob.status, bob.json()["error"]["code"]) == (404, "not_found")
    secret = w.keys["alice"]
    for spelling in [f"Bearer {secret}", f"bearer {secret}", f"BEARER \t{secret}  ", f"Bearer\t{secret}"]:
        got = echoed(visit(w, host, "/a/b?x=1&y=2", {"Authorization": spelling, "Cookie": "theme=dark",
                                                     "X-Sandbox-Org": "acme", "X-App": "kept"}))  # fmt: skip
        headers = {k.lower(): v for k, v in got["headers"]}
        assert got["path"] == "/a/b?x=1&y=2" and got["port"] == 8080
        assert "authorization" not in headers and "x-sandbox-org" not in headers
        assert headers["cookie"] == "theme=dark" and headers["x-app"] == "kept"
        assert headers["x-forwarded-host"] == host and headers["x-forwarded-proto"] == "http"
        assert headers["x-forwarded-for"] == "127.0.0.1"
        assert secret not in json.dumps(got)
    assert echoed(visit(w, host, headers={"Authorization": f"Bearer {w.keys['admin']}"}))["port"] == 8080
    # An application's own Authorization is passed on as sent.
    app = echoed(visit(w, label(box, 9090), headers={"Authorization": f"Bearer {secret}", "X-Auth": "x"}))
    assert app["port"] == 9090
    # A POST body reaches it whole.
    assert echoed(visit(w, host, "/upload", {"Authorization": f"Bearer {secret}"}, "POST", b"x" * 300_000))[
        "body_bytes"] == 300_000  # fmt: skip
    audit = w.ok("GET", "/v1/admin/audit?limit=1000", key="admin")["entries"]
    assert any(e.get("route") == "{port}.{ports-domain}" and e.get("target") == box for e in audit)


def test_a_token_is_traded_for_a_cookie_of_that_one_host(w: World, box: str) -> None:
    made = w.ok("POST", f"/v1/sandboxes/{box}/ports/8080/tokens", {"ttl_secs": 600}, status=201)
    token = made["token"]
    assert made["url"] == f"http://{label(box, 8080)}/?sbx_port_token={token}"
    traded = visit(w, label(box, 8080), f"/deep/path?keep=1&sbx_port_token={token}",
                   {"Referer": "https://elsewhere/"})  # fmt: skip
    assert traded.status == 303, traded.body
    assert traded.headers["location"] == "/deep/path?keep=1"
    assert traded.headers["referrer-policy"] == "no-referrer"
    set_cookie = traded.headers["set-cookie"]
    assert set_cookie.startswith(f"sbx-port={token};") and "HttpOnly" in set_cookie
    assert "SameSite=Lax" in set_cookie and "domain" not in set_cookie.lower()
    cookie = cookie_of(traded)
    got = echoed(visit(w, label(box, 8080), "/deep/path?keep=1", {"Cookie": f"a=1; {cookie}; b=2"}))
    headers = {k.lower(): v for k, v in got["headers"]}
    assert headers["cookie"] == "a=1; b=2" and token not in json.dumps(got)
    # The cookie (or the token) of port 8080 opens no other port, nor another sandbox's.
    other = w.ok("POST", "/v1/sandboxes", {}, status=201)["id"]
    for host in (label(box, 9090), label(other, 8080)):
        assert visit(w, host, headers={"Cookie": cookie}).status == 401
        assert visit(w, host, f"/?sbx_port_token={token}").status == 401
    # Tossed cookies (another host's, a junk one of the same name) do not hide the good one.
    assert (
        echoed(visit(w, label(box, 8080), headers={"Cookie": f"sbx-port=sgp_junk; {cookie}"}))["port"] == 8080
    )
    # The token is in no log and no audit line; the trade is audited.
    assert token not in w.gw.log_text()
    audit = w.ok("GET", "/v1/admin/audit?limit=1000", key="admin")["entries"]
    assert token not in json.dumps(audit)
    assert any(e["type"] == "port.token_traded" and e.get("target") == box and e.get("port") == 8080
               for e in audit)  # fmt: skip
    w.ok("DELETE", f"/v1/sandboxes/{other}", status=204)


def test_an_expired_token_and_cookie_open_nothing(w: World, box: str) -> None:
    made = w.ok("POST", f"/v1/sandboxes/{box}/ports/8080/tokens", {"ttl_secs": 1}, status=201)
    cookie = cookie_of(visit(w, label(box, 8080), f"/?sbx_port_token={made['token']}"))
    time.sleep(1.5)
    assert visit(w, label(box, 8080), headers={"Cookie": cookie}).status == 401
    assert visit(w, label(box, 8080), f"/?sbx_port_token={made['token']}").status == 401


def test_public_ports_and_their_caps(w: World, box: str) -> None:
    host = label(box, 9090)
    assert w.ok("PUT", f"/v1/sandboxes/{box}/ports/9090", {"public": True})["public"] is True
    assert echoed(visit(w, host))["port"] == 9090
    assert visit(w, label(box, 8080)).status == 401  # only that port
    # Idle keep-alive connections without a key: at most PER_SANDBOX held; newcomers still get in.
    conns = []
    for _ in range(PER_SANDBOX + 3):
        conn = http.client.HTTPConnection("127.0.0.1", w.gw.port, timeout=30)
        conn.request("GET", "/", headers={"Host": host})
        resp = conn.getresponse()
        assert resp.status == 200
        resp.read()
        conns.append(conn)
    alive = 0
    for conn in conns:
        try:
            conn.request("GET", "/", headers={"Host": host})
            conn.getresponse().read()
            alive += 1
        except (http.client.HTTPException, OSError):
            pass
        finally:
            conn.close()
    assert alive <= PER_SANDBOX + 1
    # Private again: closed to anyone without a credential.
    assert w.ok("PUT", f"/v1/sandboxes/{box}/ports/9090", {"public": False})["public"] is False
    assert visit(w, host).status == 401


def test_server_sent_events_arrive_as_sent(w: World, box: str) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", w.gw.port, timeout=30)
    conn.request(
        "GET", "/sse?n=4", headers={"Host": label(box, 8080), "Authorization": f"Bearer {w.keys['alice']}"}
    )
    resp = conn.getresponse()
    assert resp.status == 200 and resp.getheader("Content-Type") == "text/event-stream"
    arrivals = []
    for _ in range(4):
        line = resp.fp.readline()  # the chunk size
        data = resp.fp.read(int(line, 16) + 2)
        arrivals.append((time.monotonic(), data))
    conn.close()
    assert [d for _, d in arrivals] == [f"data: event {i}\n\n\r\n".encode() for i in range(4)]
    assert arrivals[-1][0] - arrivals[0][0] >= 0.6  # streamed as they came, not gathered


def ws_echo(w: World, host: str, headers: dict[str, str], messages: list[str]) -> list[str]:
    async def go() -> list[str]:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"http://127.0.0.1:{w.gw.port}/ws", headers={"Host": host, **headers}) as ws,
        ):
            out = []
            for m in messages:
                await ws.send_str(m)
                out.append((await ws.receive(timeout=30)).data)
            return out

    return asyncio.run(go())


def test_websocket_through_a_cookie_and_revocation_ends_it(w: World, box: str) -> None:
    created = w.ok("POST", "/v1/admin/keys", {"user": "alice", "tenant": "acme",
                                              "scopes": ["sandbox:read", "sandbox:create"]}, "admin", 201)  # fmt: skip
    key = created["secret"]
    made = send(w.gw.connection(), "POST", f"/v1/sandboxes/{box}/ports/8080/tokens", {},
                None, {"Authorization": f"Bearer {key}"})  # fmt: skip
    assert made.status == 201, made.body
    cookie = cookie_of(visit(w, label(box, 8080), f"/?sbx_port_token={made.json()['token']}"))
    assert ws_echo(w, label(box, 8080), {"Cookie": cookie}, ["hello", "x" * 1000]) == ["hello", "x" * 1000]

    async def revoked_while_open() -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(
                f"http://127.0.0.1:{w.gw.port}/ws", headers={"Host": label(box, 8080), "Cookie": cookie}
            ) as ws,
        ):
            await ws.send_str("before")
            assert (await ws.receive(timeout=30)).data == "before"
            who = await asyncio.to_thread(send, w.gw.connection(), "GET", "/v1/whoami", None, None,
                                          {"Authorization": f"Bearer {key}"})  # fmt: skip
            newest = who.json()["key_id"]
            await asyncio.to_thread(w.ok, "DELETE", f"/v1/admin/keys/{newest}", None, "admin", 204)
            return await ws.receive(timeout=10)

    ended = asyncio.run(revoked_while_open())
    assert ended.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSED, aiohttp.WSMsgType.ERROR)
    assert visit(w, label(box, 8080), headers={"Cookie": cookie}).status == 401


def test_host_confusion_and_smuggling(w: World, box: str) -> None:
    host = label(box, 8080)
    secret = w.keys["alice"]
    # The API's host with X-Forwarded-Host naming a port: the API answers (404 for no route), never the guest.
    api = w.call("GET", "/", headers={"X-Forwarded-Host": host})
    assert api.status == 404 and "method" not in api.json()
    # A port's host with an API path: the guest answers, the admin key stripped.
    got = echoed(visit(w, host, "/v1/admin/keys", {"Authorization": f"Bearer {w.keys['admin']}"}))
    assert got["path"] == "/v1/admin/keys" and w.keys["admin"] not in json.dumps(got)
    # Hosts that only look like a port's.
    for bad in (
        f"x.{host}",
        f"{host}.evil",
        host.upper().replace("PORTS.TEST", "ports.test") + "x",
        f"08080-{box.removeprefix('sbx_').replace('_', '-')}.{DOMAIN}",
        f"[::1].{host}",
    ):
        resp = visit(w, bad, headers={"Authorization": f"Bearer {secret}"})
        assert resp.status in (400, 403, 404), (bad, resp.status)
        assert b'"port": 8080' not in resp.body
    # Smuggling: a body framed by both Content-Length and chunked is refused, never split into two requests.
    sock = socket.create_connection(("127.0.0.1", w.gw.port), timeout=30)
    sock.sendall((f"POST / HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {secret}\r\nContent-Length: 4\r\n"
                  "Transfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: " + host +
                  "\r\n\r\n").encode())  # fmt: skip
    answer = b""
    sock.settimeout(10)
    try:
        while chunk := sock.recv(65536):
            answer += chunk
    except TimeoutError:
        pass
    sock.close()
    assert b"/smuggled" not in answer
    assert answer.split(b"\r\n")[0].endswith(b" 400 Bad Request"), answer[:200]


def test_the_gateways_own_answers(w: World) -> None:
    made = w.ok("POST", "/v1/sandboxes", {}, status=201)["id"]
    alice = {"Authorization": f"Bearer {w.keys['alice']}"}
    nothing = visit(w, label(made, 7777), headers=alice)
    assert (nothing.status, nothing.json()["error"]["code"]) == (502, "internal")
    assert "nothing listens on port 7777" in nothing.json()["error"]["message"]
    w.ok("POST", f"/v1/sandboxes/{made}/suspend", {})
    asleep = visit(w, label(made, 7777), headers=alice)
    assert (asleep.status, asleep.json()["error"]["code"]) == (409, "conflict"), asleep.body
    w.ok("DELETE", f"/v1/sandboxes/{made}", status=204)
    gone = visit(w, label(made, 7777), headers=alice)
    assert (gone.status, gone.json()["error"]["code"]) == (404, "not_found")
    unknown = visit(w, label("sbx_a_0123456789abcdef", 80), headers=alice)
    assert unknown.status == 404


def state_listed(w: World, sandbox: str) -> str:
    """The sandbox's state as its node's listing shows it (a request naming it would count as activity)."""
    for node in w.nodes.values():
        for s in node.request("GET", "/v1/sandboxes").json()["sandboxes"]:
            if s["id"] == sandbox:
                return str(s["state"])
    raise AssertionError(f"{sandbox} is on no node")


def test_wake_on_traffic_and_activity_keeps_it_awake(w: World) -> None:
    made = w.ok("POST", "/v1/sandboxes", {"name": "sleeper", "persistent": True, "idle_timeout_secs": 4},
                status=201)["id"]  # fmt: skip
    start_guest(w, made, 8080)
    host, alice = label(made, 8080), {"Authorization": f"Bearer {w.keys['alice']}"}
    w.ok("POST", f"/v1/sandboxes/{made}/suspend", {})
    wait_for(lambda: w.ok("GET", f"/v1/sandboxes/{made}")["state"] == "suspended", 60)
    listed = w.ok("GET", f"/v1/sandboxes/{made}/ports")["ports"]
    assert all(not p["listening"] for p in listed)
    assert w.ok("GET", f"/v1/sandboxes/{made}")["state"] == "suspended"  # listing did not wake it
    started = time.monotonic()
    assert echoed(visit(w, host, headers=alice))["port"] == 8080
    print(f"wake on traffic: {time.monotonic() - started:.2f} s")
    # An open WebSocket keeps it from its idle timeout (4 s) while it lasts.

    async def hold_open() -> None:
        async with (
            aiohttp.ClientSession() as session,
            session.ws_connect(f"http://127.0.0.1:{w.gw.port}/ws", headers={"Host": host, **alice}) as ws,
        ):
            for _ in range(4):
                await asyncio.sleep(2.5)
                assert await asyncio.to_thread(state_listed, w, made) == "running"
            await ws.send_str("still")
            assert (await ws.receive(timeout=30)).data == "still"

    asyncio.run(hold_open())
    # Once it is closed (and the kept-alive connection after it), the idle timeout comes.
    wait_for(lambda: state_listed(w, made) == "suspended", 60, 0.5)
    w.ok("DELETE", f"/v1/sandboxes/{made}", status=204)


def test_a_stopped_sandbox_is_started_and_says_its_server_is_gone(w: World) -> None:
    """A stopped persistent sandbox is booted from its disk by the first request; no server of before runs, so the
    answer is a prompt 502 saying so, not a wait for a port nothing will open."""
    made = w.ok("POST", "/v1/sandboxes", {"name": "stopped-web", "persistent": True}, status=201)["id"]
    start_guest(w, made, 8080)
    host, alice = label(made, 8080), {"Authorization": f"Bearer {w.keys['alice']}"}
    w.ok("POST", f"/v1/sandboxes/{made}/stop", {})
    started = time.monotonic()
    resp = visit(w, host, headers=alice)
    assert resp.status == 502, (resp.status, resp.body)
    assert "it was stopped, so it was started again from its disk" in resp.json()["error"]["message"]
    assert time.monotonic() - started < 15  # the boot, not the 30 s wait for a port
    assert state_listed(w, made) == "running"
    start_guest(w, made, 8080)
    assert echoed(visit(w, host, headers=alice))["port"] == 8080
    w.ok("DELETE", f"/v1/sandboxes/{made}", status=204)


def test_without_a_ports_domain_the_endpoints_are_501() -> None:
    with world(prefix="sbxnoports-") as plain:
        made = plain.ok("POST", "/v1/sandboxes", {}, status=201)["id"]
        assert plain.ok("GET", "/v1/capabilities")["capabilities"]["exposed_ports"] is False
        for method, path in [("GET", "/ports"), ("GET", "/ports/80"), ("PUT", "/ports/80"),
                             ("POST", "/ports/80/tokens")]:  # fmt: skip
            resp = plain.call(
                method, f"/v1/sandboxes/{made}{path}", {"public": True} if method == "PUT" else {}
            )
            assert (resp.status, resp.json()["error"]["code"]) == (501, "unsupported"), path
            assert "--ports-domain" in resp.json()["error"]["message"]

"""Hostile clients and replicas of services, through a real gateway in front of two real sandboxd nodes: a
caller's key never reaches a replica however the header is spelled, keep-alive floods without a key to public
services hold their caps (per service and in all) while the API and honest traffic go on, and a replica that
never answers gets its caller a 504 and its tunnel closed while a slow stream of server-sent events is never cut.

The replicas are real servers in the sandboxes (python3 of the default image) that echo the headers they got."""

from __future__ import annotations

import base64
import http.client
import json
import re
import select
import socket
import threading
import time
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from gateway_harness import wait_for
from sandboxd_harness import free_port
from services_world import World, world

#: A replica: ``/`` and anything else echo the path and the headers as JSON; ``/sleep?secs=S`` answers after S
#: seconds; ``/hang?id=I`` notes I in /tmp/hangs, never answers, and notes I in /tmp/hung-up once the other end
#: closes; ``/sse?n=N&every=S`` sends N server-sent events S seconds apart (the head at once).
ECHO = r"""
import http.server, json, time, urllib.parse
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def note(self, name, value):
        with open(name, "a") as f:
            f.write(value + "\n")
    def do_GET(self):
        url = urllib.parse.urlsplit(self.path)
        q = dict(urllib.parse.parse_qsl(url.query))
        if url.path == "/hang":
            self.note("/tmp/hangs", q["id"])
            while self.rfile.read(1):
                pass
            self.note("/tmp/hung-up", q["id"])
            self.close_connection = True
            return
        if url.path == "/sse":
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            self.wfile.flush()
            for i in range(int(q["n"])):
                if i:
                    time.sleep(float(q["every"]))
                data = ("data: event %d at %.3f\n\n" % (i, time.time())).encode()
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()
            return
        if url.path == "/sleep":
            time.sleep(float(q["secs"]))
        body = json.dumps({"path": self.path, "headers": self.headers.items()}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8080), H).serve_forever()
"""
HEALTH = {"http": "/", "every_secs": 1, "failures": 2}
PER_SERVICE, TOTAL = 8, 12


def echo(name: str, **fields: Any) -> dict[str, Any]:
    return {"name": name, "command": ["python3", "-c", ECHO], "port": 8080, "health": HEALTH, **fields}


@pytest.fixture(scope="module")
def w() -> Iterator[World]:
    metrics_port = free_port()
    with world([
        "--max-unauthenticated", "16", "--max-public-connections-per-service", str(PER_SERVICE),
        "--max-public-connections", str(TOTAL), "--idle-timeout", "300", "--metrics-listen",
        f"127.0.0.1:{metrics_port}",
    ], prefix="sbxsvch-") as started:  # fmt: skip
        started.metrics_port = metrics_port  # type: ignore[attr-defined]
        started.ok("POST", "/v1/services", echo("open", public=True, answer_timeout_secs=5), status=201)
        started.ok("POST", "/v1/services", echo("other", public=True), status=201)
        started.ok("POST", "/v1/services", echo("shut"), status=201)
        for name in ("open", "other", "shut"):
            started.wait_ready(name, 1)
        yield started


# -- a raw HTTP/1.1 client: exact header bytes, connections kept alive ------------------------------------------


def connect(w: World) -> socket.socket:
    return socket.create_connection(("127.0.0.1", w.gw.port), timeout=60)


def ask(
    sock: socket.socket, path: str, host: str = "127.0.0.1", headers: list[tuple[str, str]] | None = None
) -> tuple[int, dict[str, str], bytes]:
    """One GET on ``sock`` with ``headers`` sent byte for byte; (status, headers, body) of a Content-Length
    answer."""
    lines = [f"GET {path} HTTP/1.1", f"Host: {host}", *(f"{n}: {v}" for n, v in headers or [])]
    sock.sendall(("\r\n".join(lines) + "\r\n\r\n").encode("latin-1"))
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError(f"closed by the gateway: {data!r}")
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    answer = {k.strip().lower(): v.strip() for k, _, v in (h.partition(":") for h in header_lines)}
    while len(body) < int(answer.get("content-length", "0")):
        chunk = sock.recv(65536)
        if not chunk:
            raise ConnectionError("closed in the middle of an answer")
        body += chunk
    return int(status_line.split()[1]), answer, body


def closed_by_gateway(sock: socket.socket) -> bool:
    """Whether the gateway closed ``sock`` (an idle keep-alive connection is never readable otherwise)."""
    readable, _, _ = select.select([sock], [], [], 0)
    if not readable:
        return False
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""
    except ConnectionError:
        return True


def metric(w: World, name: str) -> float:
    url = f"http://127.0.0.1:{w.metrics_port}/metrics"  # type: ignore[attr-defined]
    with urllib.request.urlopen(url, timeout=10) as resp:
        text = resp.read().decode()
    found = re.search(rf"^{re.escape(name)} (\S+)$", text, re.MULTILINE)
    assert found, (name, text[-2000:])
    return float(found.group(1))


def replica_file(w: World, service: str, path: str) -> list[str]:
    sandbox = w.service(service)["replicas"][0]["sandbox"]
    out = w.ok(
        "POST", f"/v1/sandboxes/{sandbox}/run", {"argv": ["sh", "-c", f"cat {path} 2>/dev/null; true"]}
    )
    return base64.b64decode(out["stdout"]).decode().split()


# -- 2. the key never reaches a replica -------------------------------------------------------------------------

#: Every spelling of the key the gateway accepts (tests/unit/test_gateway_auth.py holds the exhaustive table).
SPELLINGS = [
    "Bearer {k}", "bearer {k}", "BEARER {k}", "BeArEr {k}", "Bearer  {k}", "Bearer\t{k}", "Bearer \t {k}",
    "Bearer {k}  ", "Bearer {k}\t", "bearer\t\t{k}\t ",
]  # fmt: skip
ROUTES = [("path", "/svc/{label}/who?x=1", "127.0.0.1"), ("host", "/who?x=1", "{label}.svc.test")]


@pytest.mark.parametrize("service", ["open", "shut"])
@pytest.mark.parametrize(("route", "path", "host"), ROUTES, ids=[r[0] for r in ROUTES])
def test_no_spelling_of_the_key_reaches_the_replica(
    w: World, service: str, route: str, path: str, host: str
) -> None:
    secret = w.keys["alice"]
    label = f"{service}--acme"
    sock = connect(w)
    try:
        for spelling in SPELLINGS:
            value = spelling.format(k=secret)
            # The API takes the spelling as the key (one parse decides both).
            with connect(w) as api:
                assert ask(api, "/v1/whoami", headers=[("Authorization", value)])[0] == 200, repr(value)
            sent = [("Authorization", value), ("X-Sandbox-Org", "acme"), ("X-Probe", "seen")]
            status, _, body = ask(sock, path.format(label=label), host.format(label=label), sent)
            assert status == 200, (repr(value), body[:300])
            got = json.loads(body)
            names = [n.lower() for n, _ in got["headers"]]
            assert "x-probe" in names and got["path"] == "/who?x=1", got  # the echo works: the check can fail
            assert "authorization" not in names and "x-sandbox-org" not in names, (repr(value), got)
            assert secret not in body.decode() and secret[4:] not in body.decode(), repr(value)
        # Two Authorization headers, each a spelling of the key: neither reaches the replica.
        twice = [("Authorization", f"Bearer {secret}"), ("Authorization", f"bearer  {secret}")]
        status, _, body = ask(sock, path.format(label=label), host.format(label=label), twice)
        assert status == 200 and secret[4:] not in body.decode(), body[:300]
    finally:
        sock.close()


@pytest.mark.parametrize(("route", "path", "host"), ROUTES, ids=[r[0] for r in ROUTES])
def test_a_public_service_gets_its_own_authorization_but_never_a_key_under_any_scheme(
    w: World, route: str, path: str, host: str
) -> None:
    secret = w.keys["alice"]
    sock = connect(w)
    try:
        for value, passed in [
            ("Basic dXNlcjpwYXNz", True), ("Bearer app-token-123", True), (f"Token {secret}", False),
            (f"Bearer{secret}", False), (f"Bearer sgk_{'x' * 43}", False), (f"Basic {secret}", False),
        ]:  # fmt: skip
            status, _, body = ask(sock, path.format(label="open--acme"), host.format(label="open--acme"),
                                  [("Authorization", value)])  # fmt: skip
            assert status == 200, body[:300]
            got = {n.lower(): v for n, v in json.loads(body)["headers"]}
            assert (got.get("authorization") == value) is passed, (value, got)
            assert "sgk_" not in body.decode()
    finally:
        sock.close()


# -- 3. the answer timeout -------------------------------------------------------------------------------------


def test_a_replica_that_never_answers_gets_a_504_and_its_tunnel_closed(w: World) -> None:
    started = time.monotonic()
    resp = w.traffic("/svc/open--acme/hang?id=t1", key=None)
    elapsed = time.monotonic() - started
    assert (resp.status, resp.error) == (504, (
        "internal", "the replica did not begin its answer within 5 s (the service's answer_timeout_secs)"
    )), resp.body  # fmt: skip
    assert 4.5 <= elapsed < 60, elapsed
    assert "t1" in replica_file(w, "open", "/tmp/hangs")
    # The gateway closed its tunnel: the replica saw its connection end.
    wait_for(lambda: "t1" in replica_file(w, "open", "/tmp/hung-up"), 30, 0.5)
    # Within the timeout, a slow answer (a long poll) is not cut; the replica still serves.
    assert w.traffic("/svc/open--acme/sleep?secs=1", key=None).status == 200
    assert w.gw.request("GET", "/v1/health").status == 200


def test_server_sent_events_outlast_the_answer_timeout(w: World) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", w.gw.port, timeout=60)
    try:
        started = time.monotonic()
        conn.request("GET", "/svc/open--acme/sse?n=4&every=3")
        resp = conn.getresponse()
        assert (resp.status, resp.getheader("Content-Type")) == (200, "text/event-stream")
        arrived = []
        events = []
        while line := resp.readline():
            if line.startswith(b"data: "):
                events.append(line.split()[2])
                arrived.append(time.monotonic() - started)
    finally:
        conn.close()
    assert events == [
        b"0",
        b"1",
        b"2",
        b"3",
    ]  # the whole stream, though it lasted nearly twice the 5 s timeout
    assert arrived[-1] - arrived[0] >= 8.5, arrived


def test_the_answer_timeout_has_a_default_and_changes_without_a_rollout(w: World) -> None:
    assert w.service("other")["spec"]["answer_timeout_secs"] == 120
    svc = w.service("open")
    assert svc["spec"]["answer_timeout_secs"] == 5
    changed = w.ok("PUT", "/v1/services/open", echo("open", public=True, answer_timeout_secs=14))
    assert (changed["revision"], "rollout" in changed) == (svc["revision"], "rollout" in svc)
    assert changed["spec"]["answer_timeout_secs"] == 14
    assert w.traffic("/svc/open--acme/sleep?secs=7", key=None).status == 200  # over 5, under 14: at once
    w.ok("PUT", "/v1/services/open", echo("open", public=True, answer_timeout_secs=5))
    assert w.traffic("/svc/open--acme/sleep?secs=7", key=None).status == 504


@pytest.mark.parametrize(
    ("value", "message"),
    [
        (0, "answer_timeout_secs = 0: give 1 to 3600"),
        (3601, "answer_timeout_secs = 3601: give 1 to 3600"),
        ("10", "answer_timeout_secs: expected an integer, got a string"),
    ],
)
def test_a_bad_answer_timeout_is_refused_and_changes_nothing(w: World, value: Any, message: str) -> None:
    before = w.service("open")
    for method, path, spec in [
        ("POST", "/v1/services", echo("late", answer_timeout_secs=value)),
        ("PUT", "/v1/services/open", echo("open", public=True, answer_timeout_secs=value)),
    ]:
        resp = w.call(method, path, spec)
        assert (resp.status, resp.error) == (400, ("invalid_request", message)), resp.body
    assert w.call("GET", "/v1/services/late").status == 404
    assert w.service("open")["spec"] == before["spec"]


# -- 1. connections without a key to public services -----------------------------------------------------------


def _flood(w: World, count: int, path: str, host: str = "127.0.0.1") -> list[socket.socket]:
    """``count`` keep-alive connections, one after the other, each sending one request without a key: every
    one is answered 200 (a newcomer is always let in while older ones are idle)."""
    socks = []
    for _ in range(count):
        sock = connect(w)
        socks.append(sock)
        status, _, body = ask(sock, path, host)
        assert status == 200, body[:300]
    return socks


def _kept(socks: list[socket.socket], expected: int) -> list[socket.socket]:
    """The connections the gateway kept, once it has closed all but ``expected`` of them (waited for)."""
    wait_for(lambda: sum(not closed_by_gateway(s) for s in socks) == expected, 30, 0.2)
    return [s for s in socks if not closed_by_gateway(s)]


def test_keep_alive_floods_without_a_key_hold_the_caps_and_honest_traffic_goes_on(w: World) -> None:
    shed_before = metric(w, 'sandbox_gateway_service_public_connections_shed_total{how="closed_idle"}')
    socks: list[socket.socket] = []
    try:
        # 40 connections to one public service by path: the 8 newest stay; each kept one answers again.
        socks += _flood(w, 40, "/svc/open--acme/x")
        kept = _kept(socks, PER_SERVICE)
        assert kept == socks[40 - PER_SERVICE :]  # the longest idle went first
        for sock in kept:
            assert ask(sock, "/svc/open--acme/again")[0] == 200
        wait_for(lambda: metric(w, "sandbox_gateway_service_public_connections") == PER_SERVICE, 10, 0.2)
        # 40 more to another public service by its host name: 8 of its own, and the gateway-wide 12 in all.
        more = _flood(w, 40, "/y", "other--acme.svc.test")
        socks += more
        assert len(_kept(more, PER_SERVICE)) == PER_SERVICE
        assert len(_kept(socks, TOTAL)) == TOTAL
        wait_for(lambda: metric(w, "sandbox_gateway_service_public_connections") == TOTAL, 10, 0.2)
        assert (
            metric(w, 'sandbox_gateway_service_public_connections_shed_total{how="closed_idle"}')
            - shed_before
            == 80 - TOTAL
        )
        # Meanwhile the API answers keys, and a new client of either service gets in (closing an idle one).
        assert w.call("GET", "/v1/whoami").status == 200
        assert w.traffic("/svc/open--acme/z", key=None).status == 200
        assert w.traffic("/v", key=None, headers={"Host": "other--acme.svc.test"}).status == 200
        # The flood did not count against --max-unauthenticated (16): 16 connections waiting there all stay.
        waiting = [connect(w) for _ in range(16)]
        socks += waiting
        time.sleep(0.5)
        assert not any(closed_by_gateway(s) for s in waiting)
    finally:
        for sock in socks:
            sock.close()


def test_busy_connections_without_a_key_are_never_closed_and_a_newcomer_is_refused(w: World) -> None:
    refused_before = metric(w, 'sandbox_gateway_service_public_connections_shed_total{how="refused"}')
    busy: list[socket.socket] = []
    ids = [f"b{i}-{time.monotonic_ns()}" for i in range(PER_SERVICE)]
    try:
        for ident in ids:  # requests in progress on every place of the service (its answer_timeout: 120 s)
            sock = connect(w)
            busy.append(sock)
            sock.sendall(f"GET /svc/other--acme/hang?id={ident} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
        wait_for(lambda: set(ids) <= set(replica_file(w, "other", "/tmp/hangs")), 60, 0.5)
        late = connect(w)
        try:
            status, headers, body = ask(late, "/svc/other--acme/x")
            assert (status, json.loads(body)["error"]["code"]) == (503, "unavailable"), body
            assert "too many connections without a key" in json.loads(body)["error"]["message"]
            assert (headers.get("connection"), headers.get("retry-after")) == ("close", "1")
            wait_for(lambda: closed_by_gateway(late), 10, 0.1)
        finally:
            late.close()
        assert not any(closed_by_gateway(s) for s in busy)  # none was closed to make room
        assert (
            metric(w, 'sandbox_gateway_service_public_connections_shed_total{how="refused"}') > refused_before
        )
        # A key is not counted against these caps: an authenticated client still gets through.
        assert w.traffic("/svc/other--acme/x").status == 200
    finally:
        for sock in busy:
            sock.close()
    # The callers went away: their requests end and the tunnels close (the replica sees each end).
    wait_for(lambda: set(ids) <= set(replica_file(w, "other", "/tmp/hung-up")), 60, 0.5)
    assert w.traffic("/svc/other--acme/x", key=None).status == 200


def test_many_parallel_clients_without_a_key_all_get_an_answer(w: World) -> None:
    """Honest concurrency past the cap: 12 clients at once (fewer than --max-unauthenticated, more than the
    service's 8 places), each a short request on a new connection; each gets 200 or, when every place is busy at
    that moment, a 503 it can retry (never a connection closed without an answer); retried, all succeed."""
    results: list[int] = []
    lock = threading.Lock()

    def client() -> None:
        deadline = time.monotonic() + 90
        status = 0
        while time.monotonic() < deadline:
            status = w.traffic("/svc/open--acme/sleep?secs=0.2", key=None).status
            if status != 503:
                break
            time.sleep(0.2)
        with lock:
            results.append(status)

    threads = [threading.Thread(target=client) for _ in range(12)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert results == [200] * 12

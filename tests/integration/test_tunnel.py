"""Tunnel (sbx-tunnel/1) against a real sandboxd: bytes to guest loopback, half-close, refusals, audit."""

from __future__ import annotations

import base64
import hashlib
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from sandboxd_harness import Sandboxd, free_port, localhost_certificate

MiB = 1024 * 1024

# A guest server on 127.0.0.1:PORT: serves GET /blob (size bytes of a fixed pattern) over HTTP/1.0, and on
# "SUM\n" reads to EOF, answers the sha256 of what it read, then closes (proves both half-closes).
GUEST_SERVER = r"""
import hashlib, socket, sys, threading
port, size = int(sys.argv[1]), int(sys.argv[2])
block = bytes(range(256)) * 4096
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port)); srv.listen(16)
print("listening", flush=True)
def serve(c):
    head = c.recv(4)
    if head == b"SUM\n":
        h = hashlib.sha256()
        while d := c.recv(65536):
            h.update(d)
        c.sendall(h.hexdigest().encode()); c.close(); return
    while b"\r\n\r\n" not in head:
        more = c.recv(4096)
        if not more:
            c.close(); return
        head += more
    c.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % size)
    left = size
    while left:
        chunk = block[: min(left, len(block))]
        c.sendall(chunk); left -= len(chunk)
    c.close()
while True:
    conn, _ = srv.accept()
    threading.Thread(target=serve, args=(conn,), daemon=True).start()
"""


def open_tunnel(server: Sandboxd, ref: str, port: int) -> tuple[socket.socket, bytes]:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(60)
    sock.connect(str(server.socket_path))
    sock.sendall(
        f"GET /v1/sandboxes/{ref}/tunnel?port={port} HTTP/1.1\r\nHost: localhost\r\n"
        "Connection: Upgrade\r\nUpgrade: sbx-tunnel/1\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    head, rest = head.split(b"\r\n\r\n", 1)
    return sock, head + b"\r\n\r\n" + rest


def start_guest_server(server: Sandboxd, ref: str, port: int, size: int) -> dict[str, Any]:
    resp = server.request(
        "POST",
        f"/v1/sandboxes/{ref}/processes",
        {"argv": ["python3", "-c", GUEST_SERVER, str(port), str(size)]},
    )
    assert resp.status == 201
    follower = server.follow(ref, resp.json()["pid"])
    assert b"listening" in base64.b64decode(next(follower)["data"])
    return {"port": port, "size": size}


@pytest.fixture(scope="module")
def guest(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> dict[str, Any]:
    """A guest server streaming 100 MiB (the issue's digest test)."""
    return start_guest_server(sandboxd, sandbox["id"], 8000, 100 * MiB)


@pytest.fixture(scope="module")
def small_guest(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> dict[str, Any]:
    """A guest server streaming 4 MiB, for tests about behaviour rather than volume."""
    return start_guest_server(sandboxd, sandbox["id"], 8001, 4 * MiB)


def expected_digest(size: int) -> str:
    block = bytes(range(256)) * 4096
    h = hashlib.sha256()
    left = size
    while left:
        h.update(block[: min(left, len(block))])
        left -= min(left, len(block))
    return h.hexdigest()


def test_100_mib_through_a_guest_http_server(
    sandboxd: Sandboxd, sandbox: dict[str, Any], guest: dict[str, Any]
) -> None:
    sock, head = open_tunnel(sandboxd, sandbox["id"], guest["port"])
    assert head.startswith(b"HTTP/1.1 101") and b"sbx-tunnel/1" in head
    rest = head.split(b"\r\n\r\n", 1)[1]
    sock.sendall(b"GET /blob HTTP/1.0\r\nHost: x\r\n\r\n")
    data = bytearray(rest)
    started = time.monotonic()
    while chunk := sock.recv(1 << 20):
        data += chunk
    elapsed = time.monotonic() - started
    sock.close()
    header, body = bytes(data).split(b"\r\n\r\n", 1)
    assert header.startswith(b"HTTP/1.0 200")
    assert len(body) == guest["size"]
    assert hashlib.sha256(body).hexdigest() == expected_digest(guest["size"])
    print(f"tunnel: {guest['size'] / MiB / elapsed:.0f} MiB/s")


def test_half_close_both_ways(
    sandboxd: Sandboxd, sandbox: dict[str, Any], small_guest: dict[str, Any]
) -> None:
    sock, head = open_tunnel(sandboxd, sandbox["id"], small_guest["port"])
    payload = bytes(range(256)) * 40_000  # ~10 MB
    sock.sendall(b"SUM\n" + payload)
    sock.shutdown(socket.SHUT_WR)  # our half-close reaches the guest as EOF...
    answer = head.split(b"\r\n\r\n", 1)[1]
    while chunk := sock.recv(65536):  # ...and its answer and close reach us
        answer += chunk
    sock.close()
    assert answer.decode() == hashlib.sha256(payload).hexdigest()


def test_refused_port_and_bad_requests(sandboxd: Sandboxd, sandbox: dict[str, Any]) -> None:
    base = f"/v1/sandboxes/{sandbox['id']}/tunnel"
    upgrade = {"Connection": "Upgrade", "Upgrade": "sbx-tunnel/1"}
    resp = sandboxd.request("GET", f"{base}?port=9", headers=upgrade)
    assert resp.status == 409 and resp.error[0] == "conflict" and "127.0.0.1:9" in resp.error[1]
    for query, needle in (("", "port"), ("?port=0", "port"), ("?port=70000", "port"), ("?port=x", "port")):
        resp = sandboxd.request("GET", f"{base}{query}", headers=upgrade)
        assert resp.status == 400 and needle in resp.error[1], query
    resp = sandboxd.request("GET", f"{base}?port=8000")
    assert resp.status == 400 and "sbx-tunnel/1" in resp.error[1]
    resp = sandboxd.request("GET", "/v1/sandboxes/sbx_0000000000000000/tunnel?port=8000", headers=upgrade)
    assert resp.status == 404


def test_tunnel_is_audited(sandboxd: Sandboxd, sandbox: dict[str, Any], small_guest: dict[str, Any]) -> None:
    sock, _ = open_tunnel(sandboxd, sandbox["id"], small_guest["port"])
    sock.close()
    events = sandboxd.request("GET", f"/v1/sandboxes/{sandbox['id']}/events").json()["events"]
    assert {"type": "tunnel.opened", "port": small_guest["port"]}.items() <= next(
        e for e in reversed(events) if e["type"] == "tunnel.opened"
    ).items()


async def test_sdk_tunnel_and_attach(
    sandboxd: Sandboxd, sandbox: dict[str, Any], small_guest: dict[str, Any]
) -> None:
    """The SDK's tunnel and attach against the real server (their framing is unit-tested on its own)."""
    from sbx.client import AsyncClient

    async with AsyncClient(f"unix://{sandboxd.socket_path}") as client:
        sb = await client.sandboxes.get(sandbox["id"])
        async with await sb.tunnel(small_guest["port"]) as tunnel:
            tunnel.writer.write(b"GET /blob HTTP/1.0\r\n\r\n")
            await tunnel.writer.drain()
            data = await tunnel.reader.read()
        body = data.split(b"\r\n\r\n", 1)[1]
        assert hashlib.sha256(body).hexdigest() == expected_digest(small_guest["size"])
        proc = await sb.start_process(["sh", "-c", "read x; echo got-$x; exit 4"])
        async with await proc.attach() as attached:
            await attached.write_stdin(b"ping\n")
            out = b""
            async for frame in attached:
                if frame.type == b"o":
                    out += frame.payload
            assert out == b"got-ping\n" and attached.exit_code == 4


def test_cli_forward(sandboxd: Sandboxd, sandbox: dict[str, Any], small_guest: dict[str, Any]) -> None:
    """`sandbox-cli forward LOCAL:REMOTE` listens locally and tunnels each connection."""
    import subprocess
    import sys

    local = socket.socket()
    local.bind(("127.0.0.1", 0))
    port = local.getsockname()[1]
    local.close()
    forward = subprocess.Popen(
        [sys.executable, "-m", "sbx.cli.main", "--url", f"unix://{sandboxd.socket_path}", "forward",
         sandbox["id"], f"{port}:{small_guest['port']}"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                conn = socket.create_connection(("127.0.0.1", port), timeout=30)
                break
            except ConnectionRefusedError:
                assert time.monotonic() < deadline and forward.poll() is None, forward.communicate()
                time.sleep(0.1)
        for _ in range(2):  # each connection is its own tunnel
            conn.sendall(b"GET /blob HTTP/1.0\r\n\r\n")
            data = b""
            while chunk := conn.recv(1 << 20):
                data += chunk
            conn.close()
            assert hashlib.sha256(data.split(b"\r\n\r\n", 1)[1]).hexdigest() == expected_digest(
                small_guest["size"]
            )
            conn = socket.create_connection(("127.0.0.1", port), timeout=30)
        conn.close()
    finally:
        forward.terminate()
        forward.wait(timeout=10)


def test_tunnels_per_sandbox_are_capped(sandboxd: Sandboxd) -> None:
    """A client opening tunnels without end gets 503 at the cap (128), changing nothing; one closed frees one."""
    from sbx.node.streams import MAX_TUNNELS

    # A sandbox of its own: the module's holds other tests' tunnels until their guest side closes.
    created = sandboxd.request("POST", "/v1/sandboxes", {})
    assert created.status == 201, created.body
    sandbox = created.json()
    small_guest = start_guest_server(sandboxd, sandbox["id"], 8001, 4 * MiB)
    upgrade = {"Connection": "Upgrade", "Upgrade": "sbx-tunnel/1"}
    base = f"/v1/sandboxes/{sandbox['id']}/tunnel?port={small_guest['port']}"
    opened = []
    try:
        for _ in range(MAX_TUNNELS):
            sock, head = open_tunnel(sandboxd, sandbox["id"], small_guest["port"])
            opened.append(sock)
            assert head.startswith(b"HTTP/1.1 101"), head
        resp = sandboxd.request("GET", base, headers=upgrade)
        assert resp.status == 503 and resp.error == (
            "unavailable",
            f"{MAX_TUNNELS} tunnels are open in this sandbox; close one and retry",
        )
        # Every open tunnel still works, and the node answers other calls.
        opened[-1].sendall(b"SUM\nabc")
        opened[-1].shutdown(socket.SHUT_WR)
        assert opened[-1].recv(100) == hashlib.sha256(b"abc").hexdigest().encode()
        assert sandboxd.request("GET", "/v1/node").status == 200
        opened.pop().close()
        deadline = time.monotonic() + 10
        while True:  # the slot is freed when the server sees the close
            sock, head = open_tunnel(sandboxd, sandbox["id"], small_guest["port"])
            opened.append(sock)
            if head.startswith(b"HTTP/1.1 101") or time.monotonic() > deadline:
                break
            opened.pop().close()
            time.sleep(0.2)
        assert head.startswith(b"HTTP/1.1 101"), head
    finally:
        for sock in opened:
            sock.close()
        sandboxd.request("DELETE", f"/v1/sandboxes/{sandbox['id']}")


def fetch_blob(sock: socket.socket, rest: bytes = b"") -> bytes:
    """GET /blob over an open tunnel: the body."""
    sock.sendall(b"GET /blob HTTP/1.0\r\nHost: x\r\n\r\n")
    data = bytearray(rest)
    while chunk := sock.recv(1 << 20):
        data += chunk
    return bytes(data).split(b"\r\n\r\n", 1)[1]


def test_tunnels_are_raw_connections_relayed_by_the_kernel(
    sandboxd: Sandboxd, sandbox: dict[str, Any], small_guest: dict[str, Any]
) -> None:
    """An agent of protocol version 4 takes each tunnel on a connection of its own (no framed fallback)."""
    sock, head = open_tunnel(sandboxd, sandbox["id"], small_guest["port"])
    body = fetch_blob(sock, head.split(b"\r\n\r\n", 1)[1])
    sock.close()
    assert hashlib.sha256(body).hexdigest() == expected_digest(small_guest["size"])
    assert "takes no raw tunnels" not in sandboxd.log_text()


def test_a_tunnel_over_tls_is_relayed_through_the_event_loop(
    sandboxd_factory: Callable[..., Sandboxd], tmp_path: Path
) -> None:
    """TLS cannot be spliced: a client on sandboxd's TLS listener still gets every byte, and the half-close."""
    import ssl

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    localhost_certificate(cert, key)
    (tmp_path / "token").write_text("tls-token")
    port = free_port()
    server = sandboxd_factory(
        args=["--socket", str(tmp_path / "s.sock"), "--listen", f"127.0.0.1:{port}",
              "--token-file", str(tmp_path / "token"), "--tls-cert", str(cert), "--tls-key", str(key)],
        wait=False,
    )  # fmt: skip
    server.socket_path = tmp_path / "s.sock"
    server.token = "tls-token"
    server.wait_ready()
    ref = server.create()["id"]
    guest = start_guest_server(server, ref, 8003, 4 * MiB)
    context = ssl.create_default_context(cafile=str(cert))
    with context.wrap_socket(
        socket.create_connection(("127.0.0.1", port), timeout=60), server_hostname="localhost"
    ) as sock:
        sock.sendall(
            f"GET /v1/sandboxes/{ref}/tunnel?port={guest['port']} HTTP/1.1\r\nHost: localhost\r\n"
            "Authorization: Bearer tls-token\r\nConnection: Upgrade\r\nUpgrade: sbx-tunnel/1\r\n\r\n".encode()
        )
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = sock.recv(4096)
            assert chunk, head
            head += chunk
        assert head.startswith(b"HTTP/1.1 101"), head
        body = fetch_blob(sock, head.split(b"\r\n\r\n", 1)[1])
    assert hashlib.sha256(body).hexdigest() == expected_digest(guest["size"])

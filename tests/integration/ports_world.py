"""A gateway serving exposed ports (``--ports-domain ports.test:<its port>``) over one real sandboxd, a guest server
to open through it, and a loopback client that opens port URLs as a browser would.

Nothing leaves loopback: a port URL ``http://<label>.ports.test:<port>/`` is opened by connecting to
``127.0.0.1:<port>`` with the URL's host in the ``Host`` header (``open_url``); Chromium maps ``*.ports.test`` to
127.0.0.1 with ``--host-resolver-rules`` (``CHROMIUM_ARGS``).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import shutil
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from gateway_harness import FAST_ARGS, GatewayProcess
from sandboxd_harness import Sandboxd

DOMAIN = "ports.test"
#: Chromium's flag sending every name under the ports domain to loopback (and nothing else anywhere).
CHROMIUM_ARGS = [f"--host-resolver-rules=MAP *.{DOMAIN} 127.0.0.1"]
#: What the guest's page says, and what its WebSocket answers to "ping".
PAGE_TEXT = "hello from the guest"
ECHO_TEXT = "echo: ping"
GUEST_PORT = 8000
GUEST_SCRIPT = "/sandbox/home/guest_server.py"
DEADLINE_SECS = 90.0

#: The guest's server (Python's standard library only): GET / is a page that opens a WebSocket to /ws on its own
#: host and shows the answer; /ws echoes each text message prefixed with "echo: ". Listens on every address.
GUEST_SERVER = r'''
import base64, hashlib, http.server, socketserver, struct

PAGE = b"""<!doctype html><html><head><title>guest</title></head><body>
<h1 id="hello">hello from the guest</h1><p id="ws">connecting</p>
<script>
const ws = new WebSocket(`ws://${location.host}/ws`);
ws.onopen = () => ws.send("ping");
ws.onmessage = (event) => { document.getElementById("ws").textContent = event.data; };
ws.onerror = () => { document.getElementById("ws").textContent = "websocket failed"; };
</script></body></html>"""

def recv_exact(f, n):
    data = f.read(n)
    if len(data) < n:
        raise EOFError
    return data

class Handler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/ws" and self.headers.get("Upgrade", "").lower() == "websocket":
            key = self.headers["Sec-WebSocket-Key"]
            accept = base64.b64encode(hashlib.sha1((key + "258EAFA5-E914-47DA-95CA-C5AB0DC85B11").encode()).digest())
            self.send_response(101)
            self.send_header("Upgrade", "websocket")
            self.send_header("Connection", "Upgrade")
            self.send_header("Sec-WebSocket-Accept", accept.decode())
            self.end_headers()
            self.wfile.flush()
            try:
                while True:
                    head = recv_exact(self.rfile, 2)
                    opcode, length = head[0] & 0x0F, head[1] & 0x7F
                    if length == 126:
                        length = struct.unpack(">H", recv_exact(self.rfile, 2))[0]
                    elif length == 127:
                        length = struct.unpack(">Q", recv_exact(self.rfile, 8))[0]
                    mask = recv_exact(self.rfile, 4) if head[1] & 0x80 else b"\0\0\0\0"
                    payload = bytes(b ^ mask[i % 4] for i, b in enumerate(recv_exact(self.rfile, length)))
                    if opcode == 8:
                        self.wfile.write(b"\x88\x00")
                        return
                    if opcode == 1:
                        answer = b"echo: " + payload
                        self.wfile.write(bytes([0x81, len(answer)]) + answer)
                        self.wfile.flush()
            except EOFError:
                return
        body = PAGE if self.path == "/" else ("path " + self.path).encode()
        self.send_response(200)
        self.send_header("Content-Type", "text/html; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass

class Server(socketserver.ThreadingMixIn, http.server.HTTPServer):
    daemon_threads = True
    allow_reuse_address = True

Server(("0.0.0.0", 8000), Handler).serve_forever()
'''


@dataclass
class PortsWorld:
    """The gateway (``gw``), its node, and the keys: ``owner`` (read, create, delete), ``other`` (another user),
    ``admin``."""

    gw: GatewayProcess
    node: Sandboxd
    keys: dict[str, str]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.gw.port}"

    def port_url(self, sandbox_id: str, port: int) -> str:
        """The URL docs/ports.md gives a port: ``<port>-<hex>.<domain>`` (``<port>-<node>-<hex>`` with a node id)."""
        label = f"{port}-" + sandbox_id.removeprefix("sbx_").replace("_", "-")
        return f"http://{label}.{DOMAIN}:{self.gw.port}/"

    def ok(self, method: str, path: str, body: Any = None, key: str = "owner", status: int = 200) -> Any:
        resp = self.gw.request(method, path, body, key=self.keys[key])
        assert resp.status == status, (method, path, resp.status, resp.body)
        return resp.json() if resp.body else None

    def sandbox_with_server(self) -> str:
        """A new sandbox of ``owner`` whose guest server listens on GUEST_PORT (seen by the gateway's listing)."""
        sandbox_id = str(self.ok("POST", "/v1/sandboxes", {}, status=201)["id"])
        resp = self.gw.request(
            "PUT", f"/v1/sandboxes/{sandbox_id}/files?path={GUEST_SCRIPT}", key=self.keys["owner"],
            body=GUEST_SERVER.encode(), headers={"Content-Type": "application/octet-stream"},
        )  # fmt: skip
        assert resp.status in (200, 204), (resp.status, resp.body)
        self.ok(
            "POST", f"/v1/sandboxes/{sandbox_id}/processes", {"argv": ["python3", GUEST_SCRIPT]}, status=201
        )
        wait_until(
            lambda: self.listening(sandbox_id, GUEST_PORT), f"the guest server of {sandbox_id} listening"
        )
        return sandbox_id

    def listening(self, sandbox_id: str, port: int) -> bool:
        ports = self.ok("GET", f"/v1/sandboxes/{sandbox_id}/ports")["ports"]
        return any(p["port"] == port and p["listening"] for p in ports)


def wait_until(condition: Any, what: str, timeout_secs: float = DEADLINE_SECS) -> Any:
    deadline = time.monotonic() + timeout_secs
    while True:
        found = condition()
        if found:
            return found
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


@dataclass
class Opened:
    status: int
    headers: dict[str, str]
    body: bytes
    cookie: str | None


def open_url(url: str, *, cookie: str | None = None, key: str | None = None, upgrade: bool = False) -> Opened:
    """One GET of a port URL at 127.0.0.1 (the URL's host and port in ``Host``), redirects not followed.
    ``cookie``: a ``name=value`` to send; ``upgrade``: ask for a WebSocket and send one text frame "ping"."""
    parts = urlsplit(url)
    assert parts.hostname is not None and parts.hostname.endswith("." + DOMAIN), url
    conn = http.client.HTTPConnection("127.0.0.1", parts.port or 80, timeout=60)
    headers = {"Host": parts.netloc}
    if cookie:
        headers["Cookie"] = cookie
    if key:
        headers["Authorization"] = f"Bearer {key}"
    if upgrade:
        headers.update({"Connection": "Upgrade", "Upgrade": "websocket", "Sec-WebSocket-Version": "13",
                        "Sec-WebSocket-Key": base64.b64encode(b"0123456789abcdef").decode()})  # fmt: skip
    try:
        conn.request("GET", parts.path + (f"?{parts.query}" if parts.query else ""), headers=headers)
        resp = conn.getresponse()
        got = {k.lower(): v for k, v in resp.getheaders()}
        if upgrade and resp.status == 101:
            sock = conn.sock
            assert sock is not None
            sock.sendall(
                bytes([0x81, 0x84])
                + b"\x01\x02\x03\x04"
                + bytes(b ^ m for b, m in zip(b"ping", b"\x01\x02\x03\x04", strict=True))
            )
            frame = resp.fp.read(2)
            body = resp.fp.read(frame[1] & 0x7F)
        else:
            body = resp.read()
        set_cookie = got.get("set-cookie")
        return Opened(resp.status, got, body, set_cookie.split(";", 1)[0] if set_cookie else None)
    finally:
        conn.close()


def open_like_a_browser(token_url: str) -> tuple[Opened, str]:
    """Open a token URL as a browser does: the gateway's redirect (with its cookie), then the URL it points to with
    that cookie. Returns the final answer and the cookie."""
    first = open_url(token_url)
    assert first.status in (302, 303, 307), (first.status, first.body)
    assert first.cookie is not None, first.headers
    location = first.headers["location"]
    if location.startswith("/"):
        parts = urlsplit(token_url)
        location = f"{parts.scheme}://{parts.netloc}{location}"
    assert "sbx_port_token" not in location
    return open_url(location, cookie=first.cookie), first.cookie


@contextlib.contextmanager
def ports_world(node: Sandboxd, prefix: str = "sbxports-") -> Iterator[PortsWorld]:
    """A gateway with ``--ports-domain ports.test:<its port>`` over ``node``; stopped at the end."""
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    gw = GatewayProcess(workdir, [("n", node)])
    gw.args = [*FAST_ARGS, "--ports-domain", f"{DOMAIN}:{gw.port}"]
    crud = ("sandbox:read", "sandbox:create", "sandbox:delete")
    keys = {
        "owner": gw.create_key("olive", *crud), "other": gw.create_key("oscar", *crud),
        "admin": gw.create_key("root", "admin"),
    }  # fmt: skip
    gw.start()
    try:
        yield PortsWorld(gw, node, keys)
    finally:
        gw.stop()
        shutil.rmtree(workdir, ignore_errors=True)

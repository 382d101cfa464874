"""A two-node fleet behind one gateway for the services and jobs tests (and their benchmark): real sandboxd nodes
with gVisor, a gateway with a secrets key, an agents file and fast health settings, and the programs the
replicas and jobs run (python3 of the default image)."""

from __future__ import annotations

import base64
import http.client
import json
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from sandboxd_harness import Response, Sandboxd, send

CAPACITY = "[capacity]\ncpus = 12\nmemory_mb = 6144\ndisk_mb = 100000\n"

#: A replica: answers GET with its own random id, the GREETING variable, the length of the TOKEN secret (never
#: the value), the path, the prefix and Authorization it was given; echoes POST bodies; switches to an echo of
#: raw bytes for ``Upgrade: echo``; ``/slow`` answers after 30 s.
SERVER = r"""
import http.server, os, time, uuid
ident = uuid.uuid4().hex[:12]
class H(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def _send(self, body, status=200):
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def do_GET(self):
        if self.headers.get("Upgrade") == "echo":
            self.send_response(101)
            self.send_header("Connection", "Upgrade")
            self.send_header("Upgrade", "echo")
            self.end_headers()
            self.wfile.flush()
            while True:
                data = self.rfile.read1(65536)
                if not data:
                    return
                self.wfile.write(data)
                self.wfile.flush()
        if self.path == "/slow":
            time.sleep(30)
        fields = [ident, os.environ.get("GREETING", "-"), str(len(os.environ.get("TOKEN", ""))), self.path,
                  self.headers.get("X-Forwarded-Prefix", "-"), self.headers.get("Authorization", "-")]
        self._send((" ".join(fields) + "\n").encode())
    def do_POST(self):
        length = int(self.headers.get("Content-Length", "0"))
        self._send(self.rfile.read(length))
    def log_message(self, *args):
        pass
http.server.ThreadingHTTPServer(("127.0.0.1", 8080), H).serve_forever()
"""
SERVE = ["python3", "-c", SERVER]
#: The agent of the tests: a script of the image's python3 reading its prompt file, writing a result file.
AGENT = r"""
import os, sys
prompt = open(sys.argv[1]).read()
open("/sandbox/home/result.txt", "w").write(prompt.upper())
print("agent read", len(prompt), "chars; key", "present" if os.environ.get("AGENT_KEY") else "absent")
"""
AGENTS_TOML = f"""
[[agent]]
name = "shouter"
argv = ["python3", "-c", {json.dumps(AGENT)}, "{{prompt_file}}"]
secrets = ["AGENT_KEY"]
timeout_secs = 120
"""


class World:
    """The nodes, the gateway and its keys."""

    def __init__(self, workdir: Path, nodes: dict[str, Sandboxd], gw: GatewayProcess, keys: dict[str, str]):
        self.workdir = workdir
        self.nodes = nodes
        self.gw = gw
        self.keys = keys

    def call(self, method: str, path: str, body: Any = None, key: str = "alice", **kw: Any) -> Response:
        return self.gw.request(method, path, body, key=self.keys[key] if key else None, **kw)

    def ok(self, method: str, path: str, body: Any = None, key: str = "alice", status: int = 200) -> Any:
        resp = self.call(method, path, body, key)
        assert resp.status == status, (method, path, resp.status, resp.body[:2000])
        return resp.json() if resp.body else None

    def service(self, name: str, key: str = "alice") -> dict[str, Any]:
        return self.ok("GET", f"/v1/services/{name}", key=key)  # type: ignore[no-any-return]

    def wait_ready(
        self, name: str, ready: int, timeout_secs: float = 90.0, key: str = "alice"
    ) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            svc = self.service(name, key)
            settled = (
                (svc["rollout"] or {}).get("state", "done") != "in_progress" if "rollout" in svc else True
            )
            healthy = [r for r in svc["replicas"] if r["state"] == "healthy"]
            return svc if svc["ready"] == ready and len(svc["replicas"]) == ready == len(healthy) and settled \
                else None  # fmt: skip

        return wait_for(done, timeout_secs, 0.2)  # type: ignore[no-any-return]

    def job(self, job_id: str, key: str = "alice") -> dict[str, Any]:
        return self.ok("GET", f"/v1/jobs/{job_id}", key=key)  # type: ignore[no-any-return]

    def wait_job(self, job_id: str, timeout_secs: float = 120.0, key: str = "alice") -> dict[str, Any]:
        return wait_for(  # type: ignore[no-any-return]
            lambda: (j := self.job(job_id, key))["state"] in ("succeeded", "failed", "cancelled") and j,
            timeout_secs, 0.2,
        )  # fmt: skip

    def output(self, job_id: str, n: int, key: str = "alice") -> tuple[bytes, bytes, bool]:
        out = self.ok("GET", f"/v1/jobs/{job_id}/runs/{n}/output", key=key)
        return base64.b64decode(out["stdout"]), base64.b64decode(out["stderr"]), out["truncated"]

    def live_on_nodes(self, label: str) -> list[dict[str, Any]]:
        """Live sandboxes carrying ``label`` (key=value) on every node, as the nodes list them."""
        found = []
        for name, node in self.nodes.items():
            if node.proc is None or node.proc.poll() is not None:
                continue
            listed = node.request("GET", f"/v1/sandboxes?label={label}").json()["sandboxes"]
            found += [dict(s, node=name) for s in listed if s["state"] != "terminated"]
        return found

    def traffic(self, path: str, key: str | None = "alice", headers: dict[str, str] | None = None,
                method: str = "GET", body: bytes | None = None) -> Response:  # fmt: skip
        hdrs = dict(headers or {})
        if key:
            hdrs["Authorization"] = f"Bearer {self.keys[key]}"
        return send(self.gw.connection(60), method, path, None, body, hdrs)


def start_world(
    extra_args: list[str] | None = None, prefix: str = "sbxsvc-"
) -> tuple[World, list[Sandboxd]]:  # fmt: skip
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    nodes: dict[str, Sandboxd] = {}
    for name in ("a", "b"):
        (workdir / name).mkdir()
        nodes[name] = Sandboxd(workdir / name, CAPACITY, args=["--node-id", name]).start()
    (workdir / "gw").mkdir()
    key_file = workdir / "gw" / "secrets.key"
    subprocess.run([sys.executable, "-m", "sbx.gateway.main", "secrets-key", "new", str(key_file)], check=True,
                   capture_output=True)  # fmt: skip
    agents = workdir / "gw" / "agents.toml"
    agents.write_text(AGENTS_TOML, encoding="utf-8")
    gw = GatewayProcess(workdir / "gw", list(nodes.items()), [
        *FAST_ARGS, "--secrets-key-file", str(key_file), "--agents-file", str(agents), "--notify-allow-private",
        "--rollout-timeout", "120", "--services-domain", "svc.test", *(extra_args or []),
    ])  # fmt: skip
    crud = ("sandbox:read", "sandbox:create", "sandbox:delete")
    keys = {
        "admin": gw.create_key("root", "admin"),
        "alice": gw.create_key("alice", *crud, "secrets:write", tenant="acme"),
        "reader": gw.create_key("rita", "sandbox:read", tenant="acme"),
        "bob": gw.create_key("bob", *crud, tenant="beta"),
        "carol": gw.create_key("carol", *crud, "secrets:write", tenant="acme"),
    }
    gw.start()
    wait_for(lambda: gw.request("GET", "/v1/capabilities", key=keys["admin"]).status == 200)
    return World(workdir, nodes, gw, keys), list(nodes.values())


@contextmanager
def world(extra_args: list[str] | None = None, prefix: str = "sbxsvc-") -> Iterator[World]:
    """A gateway over two nodes for the block's length (``start_world``), stopped and removed after it."""
    w, nodes = start_world(extra_args, prefix)
    try:
        yield w
    finally:
        w.gw.stop()
        for node in nodes:
            node.teardown()
        shutil.rmtree(w.workdir, ignore_errors=True)


class Receiver:
    """A local notification receiver on loopback (http): records each POST body; answers ``statuses`` in turn,
    then 200."""

    def __init__(self, statuses: list[int] | None = None) -> None:
        import threading
        from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

        self.bodies: list[dict[str, Any]] = []
        self.raw: list[bytes] = []
        self.statuses = list(statuses or [])
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                data = self.rfile.read(int(self.headers.get("Content-Length", "0")))
                outer.raw.append(data)
                status = outer.statuses.pop(0) if outer.statuses else 200
                if status == 200:
                    outer.bodies.append(json.loads(data))
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def raw_upgrade(port: int, path: str, key: str) -> socket.socket:
    """A client socket that asked ``path`` to switch to ``echo`` and read the 101 (raises otherwise)."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=30)
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: Upgrade\r\nUpgrade: echo\r\n"
                 f"Authorization: Bearer {key}\r\n\r\n".encode())  # fmt: skip
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(4096)
        if not chunk:
            raise AssertionError(f"closed before the upgrade: {head!r}")
        head += chunk
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def timed(fn: Any) -> float:
    started = time.monotonic()
    fn()
    return time.monotonic() - started


__all__ = ["SERVE", "Receiver", "World", "http", "raw_upgrade", "start_world", "timed", "world"]

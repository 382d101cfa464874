"""Three real sandbox-gateway replicas on one PostgreSQL database (a private cluster) before one real sandboxd, behind
a real HAProxy started here on loopback with the configuration docs/ha.md gives (read from that file, so the doc
cannot rot; only its ``global`` section, its addresses and the TLS words of its checks are replaced: the replicas
listen on loopback without TLS). Clients talk to HAProxy only:

- creates, runs and GETs work, and a WebSocket attach is relayed;
- a replica SIGKILLed under client load is taken out by HAProxy's checks; the clients keep working, and the only
  requests that may fail are those in flight on the killed replica (at most one per client thread);
- a replica SIGTERMed with ``--drain`` turns not ready at once, HAProxy takes it out while it still serves, and no
  client request fails; it comes back in once started again.
"""

from __future__ import annotations

import http.client
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Self

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from pg_cluster import PgCluster
from sandboxd_harness import Response, Sandboxd, free_port, send
from ws_attach import WsAttach

from sbx.api import frames

HA_DOC = Path(__file__).resolve().parents[2] / "docs" / "ha.md"
ALL = ("sandbox:read", "sandbox:create", "sandbox:delete")
#: Long enough for HAProxy (inter 1s, fall 2) to take a draining replica out on a loaded machine.
DRAIN = "12s"

pytestmark = pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed "
                                "(scripts/install.sh --test-deps)")  # fmt: skip


def doc_config() -> str:
    """The HAProxy configuration block of docs/ha.md."""
    text = HA_DOC.read_text()
    found = re.search(
        r"<!-- haproxy\.cfg: begin -->\n```\n(.*?)```\n<!-- haproxy\.cfg: end -->", text, re.DOTALL
    )
    assert found, "docs/ha.md lost its HAProxy block (between the haproxy.cfg markers)"
    return found.group(1)


def lb_config(replicas: dict[str, tuple[int, int]], api_port: int, ssh_port: int, stats: Path) -> str:
    """The doc's configuration for this test: its own ``global`` (a stats socket, foreground), the frontends bound
    on loopback, each backend's servers pointed at the replicas (``replicas``: name -> (api port, ssh port)), and
    the checks without TLS. Everything else (defaults, balancing, checks, timeouts, retries) is the doc's."""
    config = doc_config()
    sections = re.split(r"\n(?=\S)", config)
    assert sections[0].startswith("global"), sections[0]
    out = [f"global\n    maxconn 2000\n    stats socket {stats} mode 600 level admin\n"]
    for section in sections[1:]:
        lines = section.splitlines()
        head = lines[0]
        body: list[str] = []
        servers_done = False
        for line in lines[1:]:
            word = line.split()[0] if line.split() else ""
            if word == "bind":
                port = ssh_port if "ssh" in head else api_port
                body.append(f"    bind 127.0.0.1:{port}")
            elif word == "default-server":
                body.append(re.sub(r" check-ssl| verify \S+| ca-file \S+| sni \S+", "", line))
            elif word == "server":
                # The doc's servers gw1, gw2, ... become the replicas, their options (a check, a track) kept.
                if not servers_done:
                    options = " ".join(line.split()[3:])
                    for name, (api, ssh) in replicas.items():
                        port = ssh if "ssh" in head else api
                        named = re.sub(r"/gw1\b", f"/{name}", options)
                        body.append(f"    server {name} 127.0.0.1:{port} {named}".rstrip())
                    servers_done = True
            else:
                body.append(line)
        out.append("\n".join([head, *body]) + "\n")
    return "\n".join(out)


class HaProxy:
    def __init__(self, workdir: Path, replicas: dict[str, tuple[int, int]]) -> None:
        self.port, self.ssh_port = free_port(), free_port()
        self.stats = workdir / "haproxy.sock"
        self.config = workdir / "haproxy.cfg"
        self.config.write_text(lb_config(replicas, self.port, self.ssh_port, self.stats))
        self.log = workdir / "haproxy.log"
        check = subprocess.run(
            ["haproxy", "-c", "-f", str(self.config)], capture_output=True, text=True, check=False
        )
        assert check.returncode == 0, check.stdout + check.stderr
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(["haproxy", "-db", "-f", str(self.config)], stdout=log, stderr=log,
                                         stdin=subprocess.DEVNULL)  # fmt: skip

    def states(self) -> dict[str, str]:
        """The ``gateways`` backend's servers and their status (UP, DOWN, ...), from the stats socket."""
        assert self.proc.poll() is None, self.log.read_text(errors="replace")[-3000:]
        data = b""
        with socket.socket(socket.AF_UNIX) as s:
            try:
                s.connect(str(self.stats))
            except OSError:  # HAProxy is starting
                return {}
            s.sendall(b"show stat\n")
            while chunk := s.recv(65536):
                data += chunk
        rows = [line.split(",") for line in data.decode().splitlines() if line and not line.startswith("#")]
        return {r[1]: r[17] for r in rows if r[0] == "gateways" and r[1] not in ("FRONTEND", "BACKEND")}

    def request(
        self, method: str, path: str, json_body: Any = None, *, key: str | None = None, timeout: float = 120.0
    ) -> Response:
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        return send(http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout), method, path, json_body,
                    None, headers)  # fmt: skip

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class Front:
    def __init__(self, gws: dict[str, GatewayProcess], lb: HaProxy, admin: str) -> None:
        self.gws, self.lb, self.admin = gws, lb, admin


@pytest.fixture(scope="module")
def front(pg_cluster: PgCluster) -> Iterator[Front]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxgw-lb-", dir="/var/tmp"))
    names = ("gw1", "gw2", "gw3")
    for d in ("n1", *names):
        (workdir / d).mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "lb"]).start()
    url = pg_cluster.create_database()
    gws: dict[str, GatewayProcess] = {}
    ssh_ports: dict[str, int] = {}
    for name in names:
        ssh_ports[name] = free_port()
        gws[name] = GatewayProcess(
            workdir / name, [("n1", node)],
            [*FAST_ARGS, "--drain", DRAIN, "--ssh-listen", f"127.0.0.1:{ssh_ports[name]}"],
            database=url, database_env=pg_cluster.env(),
        )  # fmt: skip
    admin = gws["gw1"].create_key("root", "admin")
    lb: HaProxy | None = None
    try:
        for gw in gws.values():
            gw.start()
        lb = HaProxy(workdir, {n: (gws[n].port, ssh_ports[n]) for n in names})
        wait_for(lambda: lb is not None and lb.states() == dict.fromkeys(names, "UP"), 30)
        yield Front(gws, lb, admin)
    finally:
        if lb is not None:
            lb.stop()
            if lb.log.exists():
                print(lb.log.read_text(errors="replace")[-3000:])
        # SIGINT: stop at once, all three together (SIGTERM would wait out each one's DRAIN in turn).
        for gw in gws.values():
            if gw.proc is not None and gw.proc.poll() is None:
                gw.proc.send_signal(signal.SIGINT)
        for gw in gws.values():
            gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def test_the_doc_config_is_valid_as_written() -> None:
    """The block an operator copies parses (its addresses and CA file are only placeholders there)."""
    with tempfile.TemporaryDirectory() as tmp:
        config = Path(tmp) / "haproxy.cfg"
        ca = Path(tmp) / "ca.pem"
        subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj",
                        "/CN=ca", "-keyout", str(Path(tmp) / "k"), "-out", str(ca)], check=True,
                       capture_output=True)  # fmt: skip
        config.write_text(doc_config().replace("/etc/haproxy/sandbox-gateway-ca.pem", str(ca)))
        check = subprocess.run(
            ["haproxy", "-c", "-f", str(config)], capture_output=True, text=True, check=False
        )
        assert check.returncode == 0, check.stdout + check.stderr


def test_ready_answers_on_each_replica_without_a_key(front: Front) -> None:
    for gw in front.gws.values():
        resp = gw.request("GET", "/v1/ready")
        assert resp.status == 200 and resp.json() == {"status": "ready"}, resp.body


async def test_clients_through_haproxy_create_run_get_and_attach(front: Front) -> None:
    lb = front.lb
    made_key = lb.request("POST", "/v1/admin/keys", {"user": "ann", "scopes": list(ALL)}, key=front.admin)
    assert made_key.status == 201, made_key.body
    key = made_key.json()["secret"]
    for _ in range(3):  # each request a new connection: spread over the replicas by HAProxy
        made = lb.request("POST", "/v1/sandboxes", {}, key=key)
        assert made.status == 201, made.body
        sid = made.json()["id"]
        run = lb.request("POST", f"/v1/sandboxes/{sid}/run", {"argv": ["echo", "hi"]}, key=key)
        assert run.status == 200 and run.json()["exit_code"] == 0, run.body
        assert lb.request("GET", f"/v1/sandboxes/{sid}", key=key).json()["id"] == sid
    started = lb.request("POST", f"/v1/sandboxes/{sid}/processes", {"argv": ["cat"]}, key=key)
    assert started.status == 201, started.body
    path = f"/v1/sandboxes/{sid}/processes/{started.json()['pid']}/attach/websocket"
    async with await WsAttach.connect(f"http://127.0.0.1:{lb.port}", path, token=key) as client:
        await client.send((frames.STDIN, b"through haproxy\n"))
        seen = await client.read(until=b"through haproxy\n")
        assert b"through haproxy\n" in seen.out
    # SSH through the balancer's SSH frontend reaches a replica's SSH server.
    with socket.create_connection(("127.0.0.1", lb.ssh_port), timeout=30) as s:
        assert s.recv(64).startswith(b"SSH-2.0-")


class Load:
    """Client threads sending GETs of one sandbox through HAProxy until stopped; counts answers and failures."""

    def __init__(self, lb: HaProxy, key: str, sid: str, threads: int = 4) -> None:
        self.lb, self.key, self.sid = lb, key, sid
        self.ok = 0
        self.failed: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                resp = self.lb.request("GET", f"/v1/sandboxes/{self.sid}", key=self.key, timeout=30)
                good, what = resp.status == 200, f"{resp.status} {resp.body[:200]!r}"
            except OSError as exc:
                good, what = False, repr(exc)
            with self._lock:
                if good:
                    self.ok += 1
                else:
                    self.failed.append(what)

    def __enter__(self) -> Self:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def count(self) -> int:
        with self._lock:
            return self.ok

    def wait_answers(self, more: int, timeout: float = 60) -> None:
        """Wait until ``more`` requests more than now were answered."""
        before = self.count()
        wait_for(lambda: self.count() >= before + more, timeout)


def _sandbox(front: Front, user: str) -> tuple[str, str]:
    made_key = front.lb.request(
        "POST", "/v1/admin/keys", {"user": user, "scopes": list(ALL)}, key=front.admin
    )
    assert made_key.status == 201, made_key.body
    key = made_key.json()["secret"]
    made = front.lb.request("POST", "/v1/sandboxes", {}, key=key)
    assert made.status == 201, made.body
    return key, made.json()["id"]


def test_a_killed_replica_is_taken_out_and_clients_keep_working(front: Front) -> None:
    lb, victim = front.lb, front.gws["gw3"]
    key, sid = _sandbox(front, "bob")
    with Load(lb, key, sid) as load:
        load.wait_answers(50)
        assert victim.proc is not None
        victim.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        wait_for(lambda: lb.states()["gw3"].startswith("DOWN"), 30)
        down_after = time.monotonic() - killed
        load.wait_answers(100)
    print(f"HAProxy marked the SIGKILLed replica down after {down_after:.2f} s; requests: {load.ok} answered, "
          f"{len(load.failed)} failed: {load.failed}")  # fmt: skip
    # Only what was in flight on the killed replica may fail: one request per client thread at most.
    assert len(load.failed) <= len(load._threads), load.failed
    victim.proc.wait(10)
    victim.start()
    wait_for(lambda: lb.states()["gw3"] == "UP", 30)


def test_a_draining_replica_is_taken_out_while_it_serves_and_no_request_fails(front: Front) -> None:
    lb, leaving = front.lb, front.gws["gw2"]
    key, sid = _sandbox(front, "cem")
    with Load(lb, key, sid) as load:
        load.wait_answers(50)
        assert leaving.proc is not None
        leaving.proc.send_signal(signal.SIGTERM)
        wait_for(lambda: leaving.request("GET", "/v1/ready").status == 503, 10)
        assert leaving.request("GET", "/v1/ready").json()["error"]["message"] == (
            "this gateway is not ready: it is stopping"
        )
        wait_for(lambda: lb.states()["gw2"].startswith("DOWN"), 30)
        assert leaving.proc.poll() is None, "the replica stopped before HAProxy took it out: raise --drain"
        assert leaving.request("GET", f"/v1/sandboxes/{sid}", key=key).status == 200  # still serving
        leaving.proc.wait(60)
        load.wait_answers(100)
    print(f"drain: {load.ok} answered, {len(load.failed)} failed: {load.failed}")
    assert load.failed == []
    assert "draining: not ready, serving on" in leaving.log_text()
    leaving.start()
    wait_for(lambda: lb.states()["gw2"] == "UP", 30)


def test_a_drain_serves_on_and_a_second_sigterm_or_a_sigint_stops_at_once(tmp_path: Path) -> None:
    """SQLite, no balancer: at SIGTERM with a long drain the gateway answers /v1/ready 503 and /v1/health 200 (it
    still serves); a second SIGTERM stops it without waiting out the drain, as a SIGINT does at once."""
    for second in (signal.SIGTERM, signal.SIGINT):
        workdir = tmp_path / second.name
        workdir.mkdir()
        gw = GatewayProcess(workdir, [], ["--drain", "10m"]).start()
        try:
            assert gw.request("GET", "/v1/ready").json() == {"status": "ready"}
            assert gw.proc is not None
            if second == signal.SIGTERM:
                gw.proc.send_signal(signal.SIGTERM)
                wait_for(lambda g=gw: g.request("GET", "/v1/ready").status == 503, 20)
                assert gw.request("GET", "/v1/health").json() == {"status": "ok"}
            gw.proc.send_signal(second)
            assert gw.proc.wait(60) == 0
        finally:
            gw.stop()

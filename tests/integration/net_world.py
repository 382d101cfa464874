"""A small internet for network policy tests: a network namespace of "outside hosts" and a DNS zone.

- The namespace ``sbxw-<tag>`` is joined to the host by a veth (host end ``198.51.100.1/24``); it holds the
  addresses of the zone's hosts and runs HTTP and HTTPS servers on all of them (net_world_server.py), with a
  certificate for every zone name signed by a CA made for the run (:attr:`World.ca_pem`).
- The DNS zone server (dnslib, on 127.0.0.1, a free port) answers A, AAAA and TXT for the zone below and
  counts the names it was asked, so a test can check that a query never left the host.

Documentation addresses (198.51.100.0/24) are used: never routed on the internet, "public" to the policy.
Everything made is removed by :meth:`World.close`, which tests call from a finalizer.
"""

from __future__ import annotations

import ipaddress
import os
import random
import secrets
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dnslib import AAAA, QTYPE, RR, TXT, A
from dnslib.server import BaseResolver, DNSServer
from sandboxd_harness import MAX_WORKERS, worker_index

HOST_END = "198.51.100.1"
ZONE: dict[str, str] = {
    "allowed.test": "198.51.100.10",
    "denied.test": "198.51.100.20",
    "sub.allowed.test": "198.51.100.30",
    "other.test": "198.51.100.40",
    "private.test": "10.123.45.67",
    "metadata.test": "169.254.169.254",
    "loopback.test": "127.0.0.1",
}
SERVER_SCRIPT = Path(__file__).with_name("net_world_server.py")


class _Zone(BaseResolver):  # type: ignore[misc]
    def __init__(self) -> None:
        self.asked: Counter[str] = Counter()
        self.lock = threading.Lock()

    def resolve(self, request: Any, handler: Any) -> Any:
        reply = request.reply()
        qname = str(request.q.qname).rstrip(".").lower()
        with self.lock:
            self.asked[qname] += 1
        address = ZONE.get(qname)
        if address is None:
            reply.header.rcode = 3  # NXDOMAIN
            return reply
        if request.q.qtype == QTYPE.A:
            reply.add_answer(RR(request.q.qname, QTYPE.A, rdata=A(address), ttl=60))
        elif request.q.qtype == QTYPE.AAAA:
            reply.add_answer(RR(request.q.qname, QTYPE.AAAA, rdata=AAAA("2001:db8::1"), ttl=60))
        elif request.q.qtype == QTYPE.TXT:
            reply.add_answer(RR(request.q.qname, QTYPE.TXT, rdata=TXT("zone-secret"), ttl=60))
        return reply


def _run(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


class World:
    """See the module docstring."""

    def __init__(self) -> None:
        self.tag = secrets.token_hex(3)
        self.netns = f"sbxw-{self.tag}"
        self.host_if = f"sbxwh{self.tag}"
        self.dir = Path(tempfile.mkdtemp(prefix="sbx-world-", dir="/var/tmp"))
        self.zone = _Zone()
        self.dns: DNSServer | None = None
        self.dns_port = 0
        self.server: subprocess.Popen[bytes] | None = None
        self.ca_pem = ""

    def start(self) -> World:
        try:
            self._certificates()
            _run("ip", "netns", "add", self.netns)
            _run(
                "ip", "link", "add", self.host_if, "type", "veth", "peer", "name", "eth0", "netns", self.netns
            )
            _run("ip", "addr", "add", f"{HOST_END}/24", "dev", self.host_if)
            _run("ip", "link", "set", self.host_if, "up")
            _run("ip", "-n", self.netns, "link", "set", "lo", "up")
            _run("ip", "-n", self.netns, "link", "set", "eth0", "up")
            for address in {a for a in ZONE.values() if a.startswith("198.51.100.")}:
                _run("ip", "-n", self.netns, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", self.netns, "route", "add", "default", "via", HOST_END)
            ready = self.dir / "ready"
            self.server = subprocess.Popen(
                ["ip", "netns", "exec", self.netns, sys.executable, str(SERVER_SCRIPT),
                 str(self.dir / "server.pem"), str(self.dir / "server.key"), str(ready)],
                stdout=subprocess.DEVNULL, stderr=open(self.dir / "server.log", "wb"),  # noqa: SIM115
            )  # fmt: skip
            deadline = time.monotonic() + 10
            while not ready.exists():
                if self.server.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the test internet's servers did not start: " + self._server_log())
                time.sleep(0.02)
            self.dns = DNSServer(self.zone, port=0, address="127.0.0.1")
            self.dns.start_thread()
            self.dns_port = self.dns.server.server_address[1]
        except BaseException:
            self.close()
            raise
        return self

    def _server_log(self) -> str:
        path = self.dir / "server.log"
        return path.read_text(errors="replace")[-2000:] if path.exists() else ""

    def _certificates(self) -> None:
        d = self.dir
        _run("openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
             "-subj", "/CN=sbx test CA", "-keyout", str(d / "ca.key"), "-out", str(d / "ca.pem"))  # fmt: skip
        _run("openssl", "req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=allowed.test",
             "-keyout", str(d / "server.key"), "-out", str(d / "server.csr"))  # fmt: skip
        names = ",".join(f"DNS:{n}" for n in ZONE)
        (d / "ext.cnf").write_text(f"subjectAltName={names}\n")
        _run("openssl", "x509", "-req", "-in", str(d / "server.csr"), "-CA", str(d / "ca.pem"),
             "-CAkey", str(d / "ca.key"), "-CAcreateserial", "-days", "2", "-extfile", str(d / "ext.cnf"),
             "-out", str(d / "server.pem"))  # fmt: skip
        self.ca_pem = (d / "ca.pem").read_text()

    def asked(self, name: str) -> int:
        """How many queries for ``name`` reached the zone server."""
        with self.zone.lock:
            return self.zone.asked[name.lower()]

    def close(self) -> None:
        if self.dns is not None:
            self.dns.stop()
        if self.server is not None and self.server.poll() is None:
            self.server.kill()
            self.server.wait()
        subprocess.run(["ip", "link", "del", self.host_if], capture_output=True, check=False)
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True, check=False)
        shutil.rmtree(self.dir, ignore_errors=True)


def leftovers(prefixes: tuple[str, ...]) -> list[str]:
    """Network namespaces, links and nftables tables whose names start with one of ``prefixes``."""
    found = (
        [n for n in os.listdir("/var/run/netns") if n.startswith(prefixes)]
        if Path("/var/run/netns").is_dir()
        else []
    )
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True, check=False).stdout
    for line in links.splitlines():
        name = line.split(":", 2)[1].strip().split("@", 1)[0]
        if name.startswith(prefixes):
            found.append(name)
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True, check=False).stdout
    found += [t.split()[-1] for t in tables.splitlines() if t.split()[-1].startswith(prefixes)]
    return found


def free_subnet() -> str:
    """A /20 in 10.64.0.0/10 that no route of this host overlaps (tests run beside other sandboxd) and that holds
    no address of ``ZONE`` (private.test's 10.123.45.67 inside the sandbox subnet would be refused at the SYN,
    as the sandboxes' own addresses are, not by the proxy as a private address). Each pytest-xdist worker draws
    from its own share of the /20s, so two workers asking at once never both take one before either routes it."""
    routes = subprocess.run(
        ["ip", "-4", "route", "show", "table", "all"], capture_output=True, text=True, check=True
    ).stdout
    used = [ipaddress.ip_network(r.split()[0], strict=False) for r in routes.splitlines()
            if r.split() and r.split()[0][0].isdigit()]  # fmt: skip
    zone = [ipaddress.ip_address(a) for a in ZONE.values()]
    mine = [n for i, n in enumerate(ipaddress.ip_network("10.64.0.0/10").subnets(new_prefix=20))
            if i % MAX_WORKERS == worker_index() and not any(a in n for a in zone)]  # fmt: skip
    random.shuffle(mine)
    for candidate in mine:
        if not any(candidate.overlaps(u) for u in used if u.prefixlen > 0):
            return str(candidate)
    raise RuntimeError("no free /20 for the sandbox subnet")

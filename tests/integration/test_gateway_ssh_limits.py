"""The SSH login limits against hostile clients, with Debian's OpenSSH client and a real gateway in front of a real
sandboxd: one connection may try 6 credentials, a source address that keeps failing is slowed then refused, while
logins from other addresses (and from the same one after the window) go on; counted in the metrics.

Each test attacks from an address of its own on the loopback network (127.0.0.0/8 is all loopback on Linux), so
the per-source counts of one test never reach another's."""

from __future__ import annotations

import re
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from gateway_harness import FAST_ARGS, GatewayProcess, wait_for
from sandboxd_harness import Sandboxd, free_port
from ssh_client import SshClient, keygen, public_line

ALL = ("sandbox:read", "sandbox:create", "sandbox:delete", "sandbox:ssh")
STRANGERS = 41


@dataclass
class World:
    workdir: Path
    node: Sandboxd
    gw: GatewayProcess
    ssh: SshClient
    metrics_port: int
    alice: Path
    strangers: list[Path]

    def metric(self, series: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        found = re.search(rf"^{re.escape(series)} (\S+)$", text, re.MULTILINE)
        assert found, (series, text[-3000:])
        return float(found.group(1))

    def login(
        self, source: str, *identities: Path, verbose: bool = False
    ) -> tuple[subprocess.CompletedProcess[bytes], float]:
        """``ssh box 'echo in'`` from ``source`` offering ``identities`` (and only them): the result and how long
        it took."""
        extra = ["-b", source, *(["-v"] if verbose else [])]
        for identity in identities[1:]:
            extra += ["-i", str(identity)]
        started = time.monotonic()
        done = self.ssh.ssh("box", "echo in", identity=identities[0], extra=extra, timeout=120)
        return done, time.monotonic() - started


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    workdir = Path(tempfile.mkdtemp(prefix="sbxsshl-", dir="/var/tmp"))
    for sub in ("n1", "gw", "keys"):
        (workdir / sub).mkdir()
    node = Sandboxd(workdir / "n1").start()
    ssh_port, metrics_port = free_port(), free_port()
    gw = GatewayProcess(workdir / "gw", [("n1", node)], [
        *FAST_ARGS, "--ssh-listen", f"127.0.0.1:{ssh_port}", "--metrics-listen", f"127.0.0.1:{metrics_port}",
    ])  # fmt: skip
    key = gw.create_key("alice", *ALL, tenant="acme")
    gw.start()
    try:
        info = gw.request("GET", "/v1/ssh", key=key).json()
        client = SshClient(workdir, "127.0.0.1", info["port"], info["host_keys"])
        alice = keygen(workdir / "keys", "alice", "ed25519")
        strangers = [keygen(workdir / "keys", f"stranger{i}", "ed25519") for i in range(STRANGERS)]
        gw.create(key, name="box")
        resp = gw.request("POST", "/v1/ssh-keys", {"key": public_line(alice)}, key=key)
        assert resp.status == 201, resp.body
        yield World(workdir, node, gw, client, metrics_port, alice, strangers)
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def test_one_connection_offering_41_unknown_keys_gets_6_tried(world: World) -> None:
    refused = world.metric('sandbox_gateway_ssh_credentials_refused_total{reason="unknown_key"}')
    too_many = world.metric('sandbox_gateway_ssh_login_limits_total{action="too_many_tries"}')
    done, _ = world.login("127.0.0.11", *world.strangers, verbose=True)
    assert done.returncode == 255 and done.stdout == b""
    assert b"Too many authentication failures" in done.stderr, done.stderr[-2000:]
    offered = re.findall(rb"Offering public key: \S+stranger(\d+) ", done.stderr)
    assert offered == [str(i).encode() for i in range(6)], offered  # the first six, then the disconnect
    assert world.metric('sandbox_gateway_ssh_credentials_refused_total{reason="unknown_key"}') - refused == 6
    assert world.metric('sandbox_gateway_ssh_login_limits_total{action="too_many_tries"}') - too_many == 1
    # Six keys, the sixth the right one, still log in (as with sshd); from the same address, right after.
    done, _ = world.login("127.0.0.11", *world.strangers[:5], world.alice)
    assert (done.returncode, done.stdout) == (0, b"in\n"), done.stderr[-2000:]


def test_50_wrong_key_logins_in_a_row_are_slowed_then_refused_and_others_still_log_in(world: World) -> None:
    source = "127.0.0.12"
    delayed = world.metric('sandbox_gateway_ssh_login_limits_total{action="delayed"}')
    refused = world.metric('sandbox_gateway_ssh_login_limits_total{action="source_refused"}')
    results = [world.login(source, world.strangers[i % STRANGERS]) for i in range(50)]
    assert all(done.returncode == 255 and done.stdout == b"" for done, _ in results)
    # The first 19 were refused key by key; ten at once, then each later one answered late (0.5, 1, 2, then 4 s).
    assert all(b"Permission denied (publickey)" in done.stderr for done, _ in results[:19]), results[18][
        0
    ].stderr
    assert sum(took for _, took in results[10:19]) >= 0.5 + 1 + 2 + 4 * 6
    assert world.metric('sandbox_gateway_ssh_login_limits_total{action="delayed"}') - delayed == 9
    # The 20th failure refused the address: that connection was closed, and every one after it at its first try.
    # "in N minutes": what is left of the 10-minute window after the first of the 20 failures, rounded up.
    words = re.compile(
        rf"too many failed logins from {re.escape(source)}: try again in (\d+) minutes".encode()
    )

    def refused_in(stderr: bytes) -> bool:
        found = words.search(stderr)
        return found is not None and 5 <= int(found.group(1)) <= 10

    assert all(refused_in(done.stderr) for done, _ in results[19:]), [
        d.stderr[-300:] for d, _ in results[19:] if not refused_in(d.stderr)
    ]
    assert world.metric('sandbox_gateway_ssh_login_limits_total{action="source_refused"}') - refused == 31
    assert world.metric("sandbox_gateway_ssh_sources_refused") >= 1
    # The right key from that address is refused too, for now...
    done, _ = world.login(source, world.alice)
    assert done.returncode == 255 and refused_in(done.stderr)
    # ...but a login from another address works at once.
    done, _ = world.login("127.0.0.13", world.alice)
    assert (done.returncode, done.stdout) == (0, b"in\n"), done.stderr[-2000:]


def test_a_success_is_never_slowed_by_its_address_failures(world: World) -> None:
    source = "127.0.0.14"
    for i in range(12):  # past the ten answered at once: this address is being slowed
        assert world.login(source, world.strangers[i])[0].returncode == 255
    delayed = world.metric('sandbox_gateway_ssh_login_limits_total{action="delayed"}')
    done, _ = world.login(source, world.alice)
    assert (done.returncode, done.stdout) == (0, b"in\n"), done.stderr[-2000:]
    assert world.metric('sandbox_gateway_ssh_login_limits_total{action="delayed"}') == delayed


def test_one_address_flooding_idle_connections_does_not_close_another_addresses(world: World) -> None:
    def connect(source: str) -> socket.socket:
        return socket.create_connection(("127.0.0.1", world.ssh.port), timeout=10, source_address=(source, 0))

    def closed(sock: socket.socket) -> bool:
        sock.settimeout(5)
        try:
            while sock.recv(4096):
                pass
            return True
        except TimeoutError:
            return False
        except OSError:
            return True

    others = [connect("127.0.0.15") for _ in range(10)]
    flood = [connect("127.0.0.16") for _ in range(24)]
    try:
        time.sleep(1)
        assert [closed(s) for s in flood[:8]] == [True] * 8  # that address keeps its 16 newest
        assert [closed(s) for s in others[:3]] == [False] * 3
    finally:
        for sock in others + flood:
            sock.close()


def test_after_the_window_the_same_address_logs_in_again(world: World) -> None:
    """The gateway restarted with 4 failures per 20 s: refused, then let in once the window has passed."""
    world.gw.stop()
    world.gw.args += ["--ssh-source-failures", "4", "--ssh-source-window", "20s"]
    world.gw.start()
    source = "127.0.0.17"
    for i in range(4):
        assert world.login(source, world.strangers[i])[0].returncode == 255
    last_failure = time.monotonic()
    done, _ = world.login(source, world.alice)
    assert done.returncode == 255 and b"too many failed logins from 127.0.0.17: try again in " in done.stderr

    def logged_in() -> bool:
        done, _ = world.login(source, world.alice)
        return done.returncode == 0 and done.stdout == b"in\n"

    wait_for(logged_in, 90, 1.0)
    assert (
        time.monotonic() - last_failure >= 15
    )  # not before the window (20 s after the first failure) passed

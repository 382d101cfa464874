"""Benchmark SSH into a sandbox through the gateway, in one run on one machine (a real sandboxd, a sandbox-gateway
with --ssh-listen in front, Debian's OpenSSH client):

    sudo .venv/bin/python bench/bench_ssh.py [--logins 20] [--transfers 5] [--mib 50]

- login to first prompt: ``ssh -tt box@gateway`` on a pseudo-terminal until the shell's prompt appears, vs the
  API path through the same gateway (``POST .../processes`` of the same login shell on a terminal, then the
  attach upgrade, until the prompt appears: what ``sandbox-cli shell`` does), alternating; and ``ssh box true``
  (log in, run, exit);
- scp throughput, both ways, of a ``--mib`` MiB file (uploads make a new file): ``scp`` (its sftp mode) and
  ``scp -O`` (the legacy protocol) vs the files API through the same gateway (``PUT``/``GET .../files``),
  alternating, MB/s.

Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import pty
import select
import shutil
import socket
import struct
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import pct
from gateway_harness import GatewayProcess
from sandboxd_harness import Sandboxd, free_port, missing_requirements
from ssh_client import SshClient, keygen, public_line

from sbx.api.processes import LOGIN_SHELL

PROMPT = b"$ "


def read_until(fd: int, pattern: bytes, timeout_secs: float = 30) -> bytes:
    seen = b""
    deadline = time.monotonic() + timeout_secs
    while pattern not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, deadline - time.monotonic()))
        if not ready:
            raise TimeoutError(f"{pattern!r} not seen: {seen[-200:]!r}")
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError(seen[-200:])
        seen += chunk
    return seen


def ssh_prompt(client: SshClient, identity: Path) -> float:
    """Seconds from starting ``ssh -tt`` to the shell's prompt."""
    master, slave = pty.openpty()
    start = time.perf_counter()
    proc = client.popen("box", identity=identity, extra=["-tt"], stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        read_until(master, PROMPT)
        took = time.perf_counter() - start
        os.write(master, b"exit\n")
        proc.wait(timeout=30)
        return took
    finally:
        if proc.poll() is None:
            proc.kill()
        os.close(master)


def api_prompt(gw: GatewayProcess, key: str) -> float:
    """Seconds from ``POST .../processes`` (the login shell on a terminal) through the attach upgrade to the
    prompt, over the gateway's HTTP API."""
    start = time.perf_counter()
    resp = gw.request(
        "POST", "/v1/sandboxes/box/processes", {"argv": list(LOGIN_SHELL), "tty": True}, key=key
    )
    pid = resp.json()["pid"]
    sock = socket.create_connection(("127.0.0.1", gw.port))
    sock.sendall(f"GET /v1/sandboxes/box/processes/{pid}/attach HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Authorization: Bearer {key}\r\nConnection: Upgrade\r\nUpgrade: sbx-stream/1\r\n\r\n".encode())  # fmt: skip
    seen = b""
    while PROMPT not in seen:
        chunk = sock.recv(65536)
        if not chunk:
            raise EOFError(seen[-200:])
        seen += chunk
    took = time.perf_counter() - start
    payload = b"exit\n"
    sock.sendall(b"i" + struct.pack(">I", len(payload)) + payload)
    while sock.recv(65536):
        pass
    sock.close()
    return took


def files_put(gw: GatewayProcess, key: str, data: bytes) -> float:
    start = time.perf_counter()
    resp = gw.request("PUT", "/v1/sandboxes/box/files?path=/tmp/api.bin", body=data, key=key)
    assert resp.status == 204, resp.body
    return time.perf_counter() - start


def files_get(gw: GatewayProcess, key: str, size: int) -> float:
    start = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", gw.port, timeout=300)
    conn.request(
        "GET", "/v1/sandboxes/box/files?path=/tmp/api.bin", headers={"Authorization": f"Bearer {key}"}
    )
    resp = conn.getresponse()
    got = 0
    while chunk := resp.read(1 << 20):
        got += len(chunk)
    conn.close()
    assert got == size, got
    return time.perf_counter() - start


def rate(size: int, secs: list[float]) -> str:
    """MB/s at the p50 and p95 times."""
    return f"{size / (pct(secs, 50) / 1000) / 1e6:7.1f} MB/s (p50)  {size / (pct(secs, 95) / 1000) / 1e6:7.1f} MB/s (p95)"


def alternate(rounds: int, *fns: Callable[[], float]) -> list[list[float]]:
    """Each function ``rounds`` times, taking turns (so a noisy moment hits them alike)."""
    results: list[list[float]] = [[] for _ in fns]
    for _ in range(rounds):
        for fn, out in zip(fns, results, strict=True):
            out.append(fn())
    return results


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--logins", type=int, default=20)
    parser.add_argument("--transfers", type=int, default=5)
    parser.add_argument("--mib", type=int, default=50)
    args = parser.parse_args()
    problem = missing_requirements() or (None if shutil.which("scp") else "OpenSSH's scp is not installed")
    if problem:
        sys.exit(f"bench_ssh: {problem}")
    workdir = Path(tempfile.mkdtemp(prefix="sbxbench-ssh-", dir="/var/tmp"))
    (workdir / "n1").mkdir()
    (workdir / "gw").mkdir()
    node = Sandboxd(workdir / "n1").start()
    gw = GatewayProcess(workdir / "gw", [("n1", node)], ["--ssh-listen", f"127.0.0.1:{free_port()}"])
    key = gw.create_key("bench", "sandbox:read", "sandbox:create", "sandbox:delete", "sandbox:ssh")
    gw.start()
    try:
        gw.create(key, name="box")
        info = gw.request("GET", "/v1/ssh", key=key).json()
        client = SshClient(workdir, "127.0.0.1", info["port"], info["host_keys"])
        identity = keygen(workdir, "bench", "ed25519")
        assert gw.request("POST", "/v1/ssh-keys", {"key": public_line(identity)}, key=key).status == 201
        ssh_prompt(client, identity)  # warm both paths once
        api_prompt(gw, key)
        via_ssh, via_api, true = alternate(
            args.logins, lambda: ssh_prompt(client, identity), lambda: api_prompt(gw, key),
            lambda: _timed(lambda: client.ssh("box", "true", identity=identity)),
        )  # fmt: skip
        print(f"login to first prompt, {args.logins} each, alternating:")
        print(
            f"  ssh -tt through the gateway     p50 {pct(via_ssh, 50):7.1f} ms  p95 {pct(via_ssh, 95):7.1f} ms"
        )
        print(
            f"  API process + attach (gateway)  p50 {pct(via_api, 50):7.1f} ms  p95 {pct(via_api, 95):7.1f} ms"
        )
        print(f"  ratio ssh / API at p50          {pct(via_ssh, 50) / pct(via_api, 50):7.2f}")
        print(f"  ssh box true (login, run, exit) p50 {pct(true, 50):7.1f} ms  p95 {pct(true, 95):7.1f} ms")

        size = args.mib * 1024 * 1024
        data = os.urandom(size)
        local = workdir / "data.bin"
        local.write_bytes(data)
        back = workdir / "back.bin"

        def scp_up(legacy: bool) -> float:
            # A new file each time (what an upload usually makes): one PUT; scp over an existing file writes in
            # place through dd instead (docs/ssh.md).
            gw.request("DELETE", "/v1/sandboxes/box/files?path=/tmp/scp.bin", key=key)
            return _timed(
                lambda: _ok(client.scp(str(local), "box@:/tmp/scp.bin", identity=identity, legacy=legacy))
            )

        def scp_down(legacy: bool) -> float:
            return _timed(
                lambda: _ok(client.scp("box@:/tmp/scp.bin", str(back), identity=identity, legacy=legacy))
            )

        ups = alternate(
            args.transfers, lambda: scp_up(False), lambda: scp_up(True), lambda: files_put(gw, key, data)
        )
        downs = alternate(args.transfers, lambda: scp_down(False), lambda: scp_down(True),
                          lambda: files_get(gw, key, size))  # fmt: skip
        print(f"\n{args.mib} MiB transfers, {args.transfers} each way, alternating:")
        for name, secs in zip(("scp (sftp) upload", "scp -O upload", "files API PUT"), ups, strict=True):
            print(f"  {name:<22} {rate(size, secs)}")
        for name, secs in zip(
            ("scp (sftp) download", "scp -O download", "files API GET"), downs, strict=True
        ):
            print(f"  {name:<22} {rate(size, secs)}")
        print(f"  ratio scp / files API at p50: upload {pct(ups[2], 50) / pct(ups[0], 50):.2f}, "
              f"download {pct(downs[2], 50) / pct(downs[0], 50):.2f}")  # fmt: skip
        print(json.dumps({"login_ms": [pct(via_ssh, 50), pct(via_api, 50)], "mib": args.mib}))
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _ok(done: object) -> None:
    assert getattr(done, "returncode", 1) == 0, getattr(done, "stderr", done)


if __name__ == "__main__":
    main()

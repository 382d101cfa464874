"""Benchmark tunnels and attach, measured in one run on the same machine.

    sudo .venv/bin/python bench/bench_interactive.py [--mib 200] [--keys 200]

- tunnel throughput: a guest server on 127.0.0.1 streams N MiB through `GET .../tunnel` (sbx-tunnel/1) vs the
  same server program on the host streaming over a direct loopback TCP connection, for raw tunnels and framed
  ones (an agent before protocol version 4), with the CPU seconds per GiB of the sandbox's cgroup, sandboxd and
  this client (the best of three runs each);
- attach echo latency: a keystroke sent as an `i` frame to a terminal process until its echo comes back as an
  `o` frame (p50/p95).
Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import base64
import os
import resource
import socket
import struct
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import bench_node, pct
from sandboxd_harness import Sandboxd

SERVER = r"""
import socket, sys
port, size = int(sys.argv[1]), int(sys.argv[2])
block = b"x" * (1 << 20)
srv = socket.socket(); srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
srv.bind(("127.0.0.1", port)); srv.listen(4)
print("listening", flush=True)
while True:
    c, _ = srv.accept()
    left = size
    while left:
        n = min(left, len(block)); c.sendall(block[:n]); left -= n
    c.close()
"""


def drain(sock: socket.socket, already: int = 0) -> int:
    total = already
    while chunk := sock.recv(1 << 20):
        total += len(chunk)
    return total


def upgraded(server: Sandboxd, path: str, protocol: str) -> tuple[socket.socket, bytes]:
    sock = socket.socket(socket.AF_UNIX)
    sock.connect(str(server.socket_path))
    sock.sendall(
        f"GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade\r\nUpgrade: {protocol}\r\n\r\n".encode()
    )
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    status, rest = head.split(b"\r\n\r\n", 1)
    assert status.startswith(b"HTTP/1.1 101"), status
    return sock, rest


def _cpu_secs(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _sandbox_cpu_secs(sandbox_id: str) -> float:
    """CPU seconds of everything in the sandbox's cgroup (sentry, gofer, guest processes) so far."""
    for usage in Path("/sys/fs/cgroup").glob(f"**/sandboxd/{sandbox_id}/cpuacct.usage"):
        return int(usage.read_text()) / 1e9
    for stat in Path("/sys/fs/cgroup").glob(f"**/sandboxd/{sandbox_id}/cpu.stat"):  # cgroup v2
        return int(stat.read_text().split()[1]) / 1e6
    raise RuntimeError(f"no cgroup of sandbox {sandbox_id}")


def _own_cpu_secs() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _tunnel_runs(server: Sandboxd, sandbox_id: str, mib: int) -> tuple[float, tuple[float, float, float]]:
    """Best MiB/s of three tunnels of ``mib`` MiB, and (sandbox, sandboxd, client) CPU seconds per GiB in it."""
    assert server.proc is not None
    best = 0.0
    cpu = (0.0, 0.0, 0.0)
    for _ in range(3):
        before = (_sandbox_cpu_secs(sandbox_id), _cpu_secs(server.proc.pid), _own_cpu_secs())
        started = time.monotonic()
        sock, rest = upgraded(server, f"/v1/sandboxes/{sandbox_id}/tunnel?port=8000", "sbx-tunnel/1")
        assert drain(sock, len(rest)) == mib << 20
        sock.close()
        rate = mib / (time.monotonic() - started)
        client = _own_cpu_secs() - before[2]
        time.sleep(0.3)  # the server side finishes its part of the close
        parts = (_sandbox_cpu_secs(sandbox_id) - before[0], _cpu_secs(server.proc.pid) - before[1], client)
        if rate > best:
            per_gib = 1024 / mib
            best, cpu = rate, (parts[0] * per_gib, parts[1] * per_gib, parts[2] * per_gib)
    return best, cpu


def _start_guest_server(server: Sandboxd, sandbox_id: str, size: int) -> None:
    proc = server.request(
        "POST",
        f"/v1/sandboxes/{sandbox_id}/processes",
        {"argv": ["python3", "-c", SERVER, "8000", str(size)]},
    ).json()
    first = next(server.follow(sandbox_id, proc["pid"]))
    assert b"listening" in base64.b64decode(first["data"])


def tunnel_throughput(server: Sandboxd, sandbox_id: str, mib: int) -> None:
    """Raw tunnels (the agent's tunnel socket, spliced) and framed ones (a second sandbox whose tunnel socket is
    removed, as for an agent older than protocol version 4), against direct loopback on the host."""
    size = mib << 20
    _start_guest_server(server, sandbox_id, size)
    framed_id = server.create()["id"]
    (server.state_dir / "gvisor" / framed_id / "ctl" / "tunnel.sock").unlink()
    _start_guest_server(server, framed_id, size)
    host_server = subprocess.Popen(
        [sys.executable, "-c", SERVER, "18000", str(size)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert host_server.stdout is not None and b"listening" in host_server.stdout.readline()
        direct = []
        for _ in range(3):
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", 18000)) as sock:
                assert drain(sock) == size
            direct.append(mib / (time.monotonic() - started))
        raw, raw_cpu = _tunnel_runs(server, sandbox_id, mib)
        framed, framed_cpu = _tunnel_runs(server, framed_id, mib)
    finally:
        host_server.kill()
        server.request("DELETE", f"/v1/sandboxes/{framed_id}")
    best_direct = max(direct)
    print(f"{'direct loopback TCP (host)':<40} {best_direct:8.0f} MiB/s (best of 3, {mib} MiB)")
    for name, rate, (in_sandbox, sandboxd, client) in (
        ("tunnel to guest loopback (raw)", raw, raw_cpu),
        ("tunnel, framed (agent before v4)", framed, framed_cpu),
    ):
        print(
            f"{name:<40} {rate:8.0f} MiB/s   ratio {rate / best_direct:5.2f}x   CPU s per GiB: sandbox "
            f"{in_sandbox:.2f}, sandboxd {sandboxd:.2f}, client {client:.2f}"
        )


def echo_latency(server: Sandboxd, sandbox_id: str, keys: int) -> None:
    proc = server.request(
        "POST",
        f"/v1/sandboxes/{sandbox_id}/processes",
        {"argv": ["cat"], "tty": True, "rows": 24, "cols": 80},
    ).json()
    sock, buffered = upgraded(
        server, f"/v1/sandboxes/{sandbox_id}/processes/{proc['pid']}/attach", "sbx-stream/1"
    )
    latencies = []
    for i in range(keys):
        key = bytes([ord("a") + i % 26])
        started = time.monotonic()
        sock.sendall(b"i" + struct.pack(">I", 1) + key)
        seen = b""
        while key not in seen:
            while len(buffered) < 5 or len(buffered) < 5 + struct.unpack(">I", buffered[1:5])[0]:
                buffered += sock.recv(65536)
            length = struct.unpack(">I", buffered[1:5])[0]
            kind, payload, buffered = buffered[:1], buffered[5 : 5 + length], buffered[5 + length :]
            if kind == b"o":
                seen += payload
        latencies.append(time.monotonic() - started)
    sock.close()
    print(
        f"{'attach echo latency (keystroke to echo)':<40} p50 {pct(latencies, 50):6.2f} ms   "
        f"p95 {pct(latencies, 95):6.2f} ms over {keys}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--mib", type=int, default=200)
    parser.add_argument("--keys", type=int, default=200)
    args = parser.parse_args()
    with bench_node("sbx-bench-") as (server, _):
        sandbox = server.create()
        print(f"# tunnels and attach, {time.strftime('%Y-%m-%d %H:%M')} UTC")
        tunnel_throughput(server, sandbox["id"], args.mib)
        echo_latency(server, sandbox["id"], args.keys)


if __name__ == "__main__":
    main()

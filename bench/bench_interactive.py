"""Benchmark tunnels and attach, measured in one run on the same machine.

    sudo .venv/bin/python bench/bench_interactive.py [--mib 200] [--keys 200]

- tunnel throughput: a guest server on 127.0.0.1 streams N MiB through `GET .../tunnel` (sbx-tunnel/1) vs the
  same server program on the host streaming over a direct loopback TCP connection;
- attach echo latency: a keystroke sent as an `i` frame to a terminal process until its echo comes back as an
  `o` frame (p50/p95).
Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import base64
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


def tunnel_throughput(server: Sandboxd, sandbox_id: str, mib: int) -> None:
    size = mib << 20
    proc = server.request(
        "POST",
        f"/v1/sandboxes/{sandbox_id}/processes",
        {"argv": ["python3", "-c", SERVER, "8000", str(size)]},
    ).json()
    first = next(server.follow(sandbox_id, proc["pid"]))
    assert b"listening" in base64.b64decode(first["data"])
    host_server = subprocess.Popen(
        [sys.executable, "-c", SERVER, "18000", str(size)], stdout=subprocess.PIPE, stdin=subprocess.DEVNULL
    )
    try:
        assert host_server.stdout is not None and b"listening" in host_server.stdout.readline()
        ours, direct = [], []
        for _ in range(3):
            started = time.monotonic()
            sock, rest = upgraded(server, f"/v1/sandboxes/{sandbox_id}/tunnel?port=8000", "sbx-tunnel/1")
            assert drain(sock, len(rest)) == size
            sock.close()
            ours.append(mib / (time.monotonic() - started))
            started = time.monotonic()
            with socket.create_connection(("127.0.0.1", 18000)) as sock:
                assert drain(sock) == size
            direct.append(mib / (time.monotonic() - started))
    finally:
        host_server.kill()
    best_ours, best_direct = max(ours), max(direct)
    print(f"{'direct loopback TCP (host)':<40} {best_direct:8.0f} MiB/s (best of 3, {mib} MiB)")
    print(f"{'tunnel to guest loopback':<40} {best_ours:8.0f} MiB/s   ratio {best_ours / best_direct:5.2f}x")


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

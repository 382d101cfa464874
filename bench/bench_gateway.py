"""Benchmark the gateway's overhead, in one run on one machine: a real sandboxd and a sandbox-gateway in front.

    sudo .venv/bin/python bench/bench_gateway.py [--creates 30] [--runs 200] [--clients 200] [--secs 60]

- create round trip p50/p95 through the gateway vs straight to the node (same node, same run, alternating);
- GET of a sandbox and run (`true`) round trips the same way, each over one kept-alive connection;
- load: N concurrent clients for S seconds through the gateway (each loops: GET a sandbox four times, then a
  `run` of `true`), reporting requests, rate, latency percentiles and errors (target: none).

Target (issue 7): under 3 ms added at p50. Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import pct
from gateway_harness import GatewayProcess
from sandboxd_harness import Sandboxd, UnixHTTPConnection, missing_requirements


def timed(fn: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - start)
    return out


def call(
    conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None, headers: dict[str, str]
) -> None:
    conn.request(method, path, body=body, headers=headers)
    resp = conn.getresponse()
    resp.read()
    assert resp.status == 200, resp.status


def line(name: str, direct: list[float], through: list[float]) -> str:
    return (f"{name:<10} direct p50 {pct(direct, 50):7.2f} ms p95 {pct(direct, 95):7.2f} ms   "
            f"gateway p50 {pct(through, 50):7.2f} ms p95 {pct(through, 95):7.2f} ms   "
            f"added p50 {pct(through, 50) - pct(direct, 50):6.2f} ms")  # fmt: skip


async def load(gw: GatewayProcess, key: str, ids: list[str], clients: int, secs: float) -> None:
    latencies: list[float] = []
    errors: dict[str, int] = {}
    headers = {"Authorization": f"Bearer {key}"}
    deadline = time.monotonic() + secs
    base = f"http://127.0.0.1:{gw.port}"

    async def client(n: int, session: aiohttp.ClientSession) -> None:
        i = 0
        while time.monotonic() < deadline:
            sandbox = ids[(n + i) % len(ids)]
            start = time.perf_counter()
            try:
                if i % 5 == 4:
                    resp = await session.post(f"{base}/v1/sandboxes/{sandbox}/run", json={"argv": ["true"]},
                                              headers=headers)  # fmt: skip
                else:
                    resp = await session.get(f"{base}/v1/sandboxes/{sandbox}", headers=headers)
                await resp.read()
                if resp.status != 200:
                    errors[str(resp.status)] = errors.get(str(resp.status), 0) + 1
            except aiohttp.ClientError as exc:
                errors[type(exc).__name__] = errors.get(type(exc).__name__, 0) + 1
            latencies.append(time.perf_counter() - start)
            i += 1

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector) as session:
        started = time.monotonic()
        await asyncio.gather(*(client(n, session) for n in range(clients)))
        elapsed = time.monotonic() - started
    print(f"load: {clients} clients for {elapsed:.0f} s: {len(latencies)} requests ({len(latencies) / elapsed:.0f}/s), "
          f"p50 {pct(latencies, 50):.1f} ms p95 {pct(latencies, 95):.1f} ms p99 {pct(latencies, 99):.1f} ms, "
          f"errors {sum(errors.values())} {errors or ''}")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=30)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--secs", type=float, default=60)
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        sys.exit(f"cannot benchmark: {missing}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-gw-", dir="/var/tmp"))
    (workdir / "node").mkdir()
    (workdir / "gw").mkdir()
    node = Sandboxd(workdir / "node", args=["--node-id", "b"]).start()
    gw = GatewayProcess(workdir / "gw", [("n1", node)], ["--audit-log", str(workdir / "gw" / "audit.jsonl")])
    key = gw.create_key("bench", "sandbox:read", "sandbox:create", "sandbox:delete")
    gw.start()
    try:
        made: list[str] = []

        def direct_create() -> None:
            made.append(node.create()["id"])

        def gateway_create() -> None:
            made.append(gw.create(key)["id"])

        direct_c: list[float] = []
        through_c: list[float] = []
        for _ in range(args.creates):  # alternate, so drift on the machine hits both alike
            direct_c += timed(direct_create, 1)
            through_c += timed(gateway_create, 1)
            for sandbox_id in made[-2:]:
                node.request("DELETE", f"/v1/sandboxes/{sandbox_id}")
        print(line("create", direct_c, through_c))

        target = gw.create(key)["id"]
        # One kept-alive connection each way, so connection set-up is not counted on either side.
        direct_conn = UnixHTTPConnection(node.socket_path)
        gw_conn = gw.connection()
        gw_conn.connect()
        # http.client writes the head and the body in two sends: without TCP_NODELAY, Nagle holds the body
        # until the head is acknowledged (a unix socket, as used directly, has no such delay).
        assert gw_conn.sock is not None
        gw_conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        auth = {"Authorization": f"Bearer {key}", "Content-Type": "application/json"}
        plain = {"Content-Type": "application/json"}
        run_body = json.dumps({"argv": ["true"]}).encode()
        cases = [
            ("get", "GET", f"/v1/sandboxes/{target}", None),
            ("run", "POST", f"/v1/sandboxes/{target}/run", run_body),
        ]
        for name, method, path, body in cases:
            direct_t: list[float] = []
            through_t: list[float] = []
            for _ in range(args.runs):
                direct_t += timed(lambda m=method, p=path, b=body: call(direct_conn, m, p, b, plain), 1)
                through_t += timed(lambda m=method, p=path, b=body: call(gw_conn, m, p, b, auth), 1)
            print(line(name, direct_t, through_t))

        ids = [target, *(gw.create(key)["id"] for _ in range(3))]
        asyncio.run(load(gw, key, ids, args.clients, args.secs))
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

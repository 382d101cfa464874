"""Benchmark the gateway's overhead, in one run on one machine: a real sandboxd and a sandbox-gateway in front.

    sudo .venv/bin/python bench/bench_gateway.py [--creates 30] [--runs 200] [--clients 200] [--secs 60]
        [--compare-src DIR] [--postgres] [--idle-ms 0]

- create round trip p50/p95 through the gateway vs straight to the node (same node, same run, alternating);
- GET of a sandbox and run (`true`) round trips the same way, each over one kept-alive connection, with the
  gateway process's CPU time per request (user + system, from /proc: steadier than latency on a busy machine);
- ``--compare-src DIR``: a second gateway run from another checkout's ``src`` (e.g. ``git archive REV src | tar
  -x -C DIR``), called in turn with the first, so a change is measured before/after in one run;
- ``--postgres``: another gateway keeping its state in PostgreSQL (a private, durable cluster of Debian's
  PostgreSQL 15 on a unix socket: tests/support/pg_cluster.py), called in turn with the SQLite one the same way;
- ``--idle-ms N``: sleep N ms before each GET/run call, so every process wakes from idle as the gateway does
  while a run executes (a back-to-back GET loop keeps caches and CPUs warm); 0 or omitted: back to back;
- ``--creates 0`` or ``--secs 0`` skip the create rows or the load;
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
from collections.abc import Callable
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "tests" / "support"))

from bench_sandboxd import cpu_secs, pct
from gateway_harness import GatewayProcess
from pg_cluster import PgCluster
from sandboxd_harness import Sandboxd, UnixHTTPConnection, missing_requirements


def start_gateway(
    workdir: Path, node: Sandboxd, src: Path | None, cluster: PgCluster | None = None
) -> tuple[GatewayProcess, str]:
    """A gateway in front of ``node`` (from ``src`` when given; on a new database of ``cluster`` when given) and
    a key for it."""
    workdir.mkdir()
    database = cluster.create_database() if cluster is not None else None
    # SQLite audits to a file; on PostgreSQL the audit log is the database's shared table (a file is refused).
    audit = ["--audit-log", str(workdir / "audit.jsonl")] if database is None else []
    gw = GatewayProcess(workdir, [("n1", node)], audit, database=database,
                        database_env=cluster.env() if cluster is not None else None)  # fmt: skip
    key = gw.create_key("bench", "sandbox:read", "sandbox:create", "sandbox:delete")
    gw.start(env={"PYTHONPATH": str(src.resolve() / "src")} if src is not None else None)
    return gw, key


def timed(fn: Callable[[], object]) -> float:
    """Seconds one call of ``fn`` takes."""
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


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
    parser.add_argument("--idle-ms", type=float, default=0.0, help="sleep before each GET/run call (ms)")
    parser.add_argument("--compare-src", type=Path, help="a checkout whose src/ runs a second gateway")
    parser.add_argument(
        "--postgres", action="store_true", help="also a gateway on PostgreSQL, called in turn"
    )
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        sys.exit(f"cannot benchmark: {missing}")
    workdir = Path(tempfile.mkdtemp(prefix="bench-gw-", dir="/var/tmp"))
    (workdir / "node").mkdir()
    node = Sandboxd(workdir / "node", args=["--node-id", "b"]).start()
    cluster = PgCluster.start(durable=True) if args.postgres else None
    gw, key = start_gateway(workdir / "gw", node, None)
    other = start_gateway(workdir / "gw-compare", node, args.compare_src) if args.compare_src else None
    on_pg = start_gateway(workdir / "gw-pg", node, None, cluster) if cluster is not None else None
    # Every gateway measured, in turn: (label, process, key).
    labelled = [("gateway", gw, key)]
    if other is not None:
        labelled.append((f"gateway from {args.compare_src}", *other))
    if on_pg is not None:
        labelled.append(("gateway on PostgreSQL", *on_pg))
    try:
        made: list[str] = []

        def direct_create() -> None:
            made.append(node.create()["id"])

        direct_c: list[float] = []
        through_c: dict[str, list[float]] = {label: [] for label, *_ in labelled}
        for _ in range(args.creates):  # alternate, so drift on the machine hits each alike
            direct_c.append(timed(direct_create))
            for label, g, k in labelled:
                through_c[label].append(timed(lambda g=g, k=k: made.append(g.create(k)["id"])))
            for sandbox_id in made[-1 - len(labelled) :]:
                node.request("DELETE", f"/v1/sandboxes/{sandbox_id}")
        if args.creates:
            for label, *_ in labelled:
                print(
                    line("create", direct_c, through_c[label])
                    + (f"   ({label})" if len(labelled) > 1 else "")
                )

        target = gw.create(key)["id"]
        # One kept-alive connection each way, so connection set-up is not counted on either side.
        direct_conn = UnixHTTPConnection(node.socket_path)
        gateways = [("gateway", gw, key, target)]
        gateways += [(label, g, k, g.create(k)["id"]) for label, g, k in labelled[1:]]
        conns = {}
        for label, g, _, _ in gateways:
            conn = g.connection()
            conn.connect()
            # http.client writes the head and the body in two sends: without TCP_NODELAY, Nagle holds the body
            # until the head is acknowledged (a unix socket, as used directly, has no such delay).
            assert conn.sock is not None
            conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conns[label] = conn
        plain = {"Content-Type": "application/json"}
        run_body = json.dumps({"argv": ["true"]}).encode()
        for name, method, tail, body in [("get", "GET", "", None), ("run", "POST", "/run", run_body)]:
            direct_t: list[float] = []
            through: dict[str, list[float]] = {label: [] for label, *_ in gateways}
            cpu_before = {label: cpu_secs(g.proc.pid) for label, g, *_ in gateways if g.proc is not None}
            for _ in range(args.runs):  # in turn, so drift on the machine hits each alike
                time.sleep(args.idle_ms / 1000)
                direct_t.append(timed(lambda m=method, p=f"/v1/sandboxes/{target}{tail}", b=body:
                                      call(direct_conn, m, p, b, plain)))  # fmt: skip
                for label, _, k, sandbox in gateways:
                    time.sleep(args.idle_ms / 1000)
                    auth = {"Authorization": f"Bearer {k}", "Content-Type": "application/json"}
                    path = f"/v1/sandboxes/{sandbox}{tail}"
                    through[label].append(timed(lambda c=conns[label], m=method, p=path, b=body, a=auth:
                                                call(c, m, p, b, a)))  # fmt: skip
            for label, g, *_ in gateways:
                assert g.proc is not None
                used = (cpu_secs(g.proc.pid) - cpu_before[label]) / args.runs * 1000
                print(line(name, direct_t, through[label]) + f"   gateway CPU {used:.2f} ms/request"
                      + (f"   ({label})" if len(gateways) > 1 else ""))  # fmt: skip

        if args.secs:
            ids = [target, *(gw.create(key)["id"] for _ in range(3))]
            asyncio.run(load(gw, key, ids, args.clients, args.secs))
    finally:
        for _, g, _ in labelled:
            g.stop()
        node.teardown()
        if cluster is not None:
            cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

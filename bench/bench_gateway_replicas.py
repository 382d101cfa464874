"""Benchmark the gateway on SQLite, on one PostgreSQL replica, and two and three replicas behind HAProxy, in one
run on one machine before one real sandboxd (issue 23; docs/benchmarks.md has the results):

    sudo .venv/bin/python bench/bench_gateway_replicas.py [--creates 20] [--gets 300] [--clients 32] [--secs 15]
        [--cycles 24] [--cycle-clients 4] [--lone-rounds 0] [--lone-secs 3]

For each set-up, through its front (the gateway itself; HAProxy with docs/ha.md's configuration for the
replicas, started as tests/integration/test_gateway_haproxy.py does):

- create, and create + first run (`true`), one at a time: p50/p95;
- GET of a sandbox, one at a time over a new connection each (as a client through a TCP balancer): p50/p95;
- GET at saturation: ``--clients`` concurrent clients, each over its own kept-alive connection, for ``--secs``:
  requests per second, and the gateways' CPU seconds per request (the replicas' utime + stime from /proc over
  the run, summed, divided by the requests); and the same with one client (nothing to share between requests:
  what each GET costs alone);
- create + run + delete cycles at ``--cycle-clients`` at once: cycles per second and CPU seconds per request;
- ``--lone-rounds R``: R rounds of one client's GETs (``--lone-secs`` each) on every set-up in turn, so the
  machine's drift hits them alike: the median CPU per GET of each against the SQLite gateway's (a read that comes
  alone pays its whole catch-up: docs/ha.md);
- ``--compare-src DIR``: one and two more replica set-ups whose gateways run another tree's code (``DIR``, its
  ``src``), measured in turn with the rest: a change's cost in one run;
- with several replicas: the takeover time after a SIGKILL of the leader (until another replica logs that it
  leads; the sandbox_gateway_leader gauge turns 1 at the same moment).

PostgreSQL is a private cluster (tests/support/pg_cluster.py) started durable (fsync on), on a unix socket.
The machine has 2 cores: requests per second cannot scale with replicas here; CPU per request is the figure.
Targets: a PostgreSQL replica adds at most 2 ms p50 to a create over SQLite; CPU seconds per request with two
and three replicas within 1.25x of the SQLite gateway's.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import shutil
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "tests" / "support"))

from bench_sandboxd import cpu_secs, pct
from gateway_harness import GatewayProcess, wait_for
from pg_cluster import PgCluster
from sandboxd_harness import Sandboxd, free_port, missing_requirements, send
from test_gateway_haproxy import HaProxy

SCOPES = ("sandbox:read", "sandbox:create", "sandbox:delete")


@dataclass
class SetUp:
    name: str
    gws: list[GatewayProcess]
    port: int
    key: str
    lb: HaProxy | None = None
    rows: dict[str, str] = field(default_factory=dict)

    def request(self, method: str, path: str, body: object = None) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=120)
        resp = send(conn, method, path, body, None, {"Authorization": f"Bearer {self.key}"})
        return resp.status, resp.body

    def cpu(self) -> float:
        return sum(cpu_secs(gw.proc.pid) for gw in self.gws if gw.proc is not None and gw.proc.poll() is None)


def start(
    name: str, workdir: Path, node: Sandboxd, cluster: PgCluster | None, replicas: int, src: str | None = None
) -> SetUp:
    """``src``: the gateways run the code of that ``src`` directory (another tree's) instead of this one's."""
    database = cluster.create_database() if cluster is not None else None
    env = {**(cluster.env() if cluster is not None else {}), **({"PYTHONPATH": src} if src else {})}
    gws = []
    for i in range(replicas):
        d = workdir / f"{name}-{i}"
        d.mkdir()
        # SQLite audits to a file; replicas on PostgreSQL to the database's shared table (they refuse a file).
        audit = ["--audit-log", str(d / "audit.jsonl")] if database is None else []
        gws.append(GatewayProcess(d, [("n1", node)], audit, database=database, database_env=env))
    key = gws[0].create_key("bench", *SCOPES)
    for gw in gws:
        gw.start()
    lb = None
    port = gws[0].port
    if replicas > 1:
        (workdir / name).mkdir()
        lb = HaProxy(workdir / name, {f"gw{i + 1}": (gw.port, free_port()) for i, gw in enumerate(gws)})
        wait_for(lambda: set(lb.states().values()) == {"UP"} and len(lb.states()) == replicas, 30)
        port = lb.port
    return SetUp(name, gws, port, key, lb)


def one_at_a_time(setups: list[SetUp], creates: int, gets: int) -> None:
    """Creates (and their first run), then GETs, one at a time, taking the set-ups in turn at each step so the
    node's and the machine's ups and downs fall on all of them alike."""
    create: dict[str, list[float]] = {s.name: [] for s in setups}
    create_run: dict[str, list[float]] = {s.name: [] for s in setups}
    get: dict[str, list[float]] = {s.name: [] for s in setups}
    ids: dict[str, list[str]] = {s.name: [] for s in setups}
    for _ in range(creates):
        for s in setups:
            t0 = time.perf_counter()
            status, body = s.request("POST", "/v1/sandboxes", {})
            t1 = time.perf_counter()
            assert status == 201, body
            sid = json.loads(body)["id"]
            status, body = s.request("POST", f"/v1/sandboxes/{sid}/run", {"argv": ["true"]})
            t2 = time.perf_counter()
            assert status == 200, body
            create[s.name].append(t1 - t0)
            create_run[s.name].append(t2 - t0)
            if ids[s.name]:  # one kept for the GETs: the node's capacity holds a few at once
                s.request("DELETE", f"/v1/sandboxes/{sid}")
            else:
                ids[s.name].append(sid)
    for _ in range(gets):
        for s in setups:
            t0 = time.perf_counter()
            status, body = s.request("GET", f"/v1/sandboxes/{ids[s.name][0]}")
            get[s.name].append(time.perf_counter() - t0)
            assert status == 200, body
    for s in setups:
        for sid in ids[s.name]:
            s.request("DELETE", f"/v1/sandboxes/{sid}")
        c, cr, g = create[s.name], create_run[s.name], get[s.name]
        s.rows["one"] = (f"create p50 {pct(c, 50):.1f} ms p95 {pct(c, 95):.1f}; "
                         f"create+run p50 {pct(cr, 50):.1f} ms p95 {pct(cr, 95):.1f}; "
                         f"GET (new connection) p50 {pct(g, 50):.2f} ms p95 {pct(g, 95):.2f}")  # fmt: skip


async def idle_cpu(s: SetUp, secs: float) -> str:
    cpu0 = s.cpu()
    await asyncio.sleep(secs)
    return f"idle: {(s.cpu() - cpu0) / secs * 1000:.1f} ms CPU per second (all its replicas)"


async def get_load(s: SetUp, sid: str, clients: int, secs: float, direct: bool = False) -> tuple[str, float]:
    """The row, and the CPU seconds per request. ``direct``: client i talks to replica i mod n, not through
    HAProxy (what the balancer itself costs)."""
    done = errors = 0
    latencies: list[float] = []
    deadline = time.monotonic() + secs
    headers = {"Authorization": f"Bearer {s.key}"}

    async def client(i: int) -> None:
        nonlocal done, errors
        port = s.gws[i % len(s.gws)].port if direct else s.port
        async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=1)) as session:
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                async with session.get(f"http://127.0.0.1:{port}/v1/sandboxes/{sid}", headers=headers) as r:
                    await r.read()
                    if r.status == 200:
                        done += 1
                        latencies.append(time.perf_counter() - t0)
                    else:
                        errors += 1

    cpu0, t0 = s.cpu(), time.monotonic()
    await asyncio.gather(*(client(i) for i in range(clients)))
    cpu, elapsed = s.cpu() - cpu0, time.monotonic() - t0
    per_request = cpu / max(done, 1)
    return (f"GET x{clients} clients{' straight to the replicas' if direct else ''}: {done / elapsed:.0f} req/s, p50 {pct(latencies, 50):.1f} ms "
            f"p95 {pct(latencies, 95):.1f}, {errors} errors, CPU {per_request * 1000:.3f} ms/request"), per_request  # fmt: skip


async def lone_rounds(setups: list[SetUp], rounds: int, secs: float) -> None:
    """``rounds`` runs of one client's GETs for ``secs`` on each set-up in turn (so the machine's drift hits all
    alike): the median CPU per GET of each, and its ratio to the SQLite gateway's."""
    cpu: dict[str, list[float]] = {s.name: [] for s in setups}
    sids = {s.name: json.loads(s.request("POST", "/v1/sandboxes", {})[1])["id"] for s in setups}
    for _ in range(rounds):
        for s in setups:
            cpu[s.name].append((await get_load(s, sids[s.name], 1, secs))[1])
    for s in setups:
        s.request("DELETE", f"/v1/sandboxes/{sids[s.name]}")
    base = statistics.median(cpu[setups[0].name])
    print(
        f"one client, {rounds} rounds of {secs:.0f} s in turn: median CPU per GET (range), against {setups[0].name}'s"
    )
    for s in setups:
        median = statistics.median(cpu[s.name])
        print(f"  {s.name:<13} {median * 1000:.3f} ms ({min(cpu[s.name]) * 1000:.3f}-{max(cpu[s.name]) * 1000:.3f})"
              f"  {median / base:.2f}x")  # fmt: skip


async def cycle_load(s: SetUp, cycles: int, clients: int) -> str:
    headers = {"Authorization": f"Bearer {s.key}"}
    base = f"http://127.0.0.1:{s.port}"
    left = cycles
    requests = errors = 0

    async def client() -> None:
        nonlocal left, requests, errors
        async with aiohttp.ClientSession(headers=headers) as session:
            while left > 0:
                left -= 1
                async with session.post(base + "/v1/sandboxes", json={}) as r:
                    body = await r.json()
                    requests += 1
                    if r.status != 201:
                        errors += 1
                        continue
                sid = body["id"]
                async with session.post(base + f"/v1/sandboxes/{sid}/run", json={"argv": ["true"]}) as r:
                    await r.read()
                    requests += 1
                    errors += r.status != 200
                async with session.delete(base + f"/v1/sandboxes/{sid}") as r:
                    await r.read()
                    requests += 1

    cpu0, t0 = s.cpu(), time.monotonic()
    await asyncio.gather(*(client() for _ in range(clients)))
    cpu, elapsed = s.cpu() - cpu0, time.monotonic() - t0
    return (f"create+run+delete x{clients}: {cycles / elapsed:.2f} cycles/s, {errors} errors, "
            f"CPU {cpu / max(requests, 1) * 1000:.3f} ms/request")  # fmt: skip


def takeover(s: SetUp) -> str:
    leader = next(gw for gw in s.gws if "this replica leads" in gw.log_text())
    others = [gw for gw in s.gws if gw is not leader]
    assert leader.proc is not None
    leader.proc.send_signal(signal.SIGKILL)
    killed = time.monotonic()
    wait_for(lambda: any("this replica leads" in gw.log_text() for gw in others), 30, 0.02)
    return f"takeover after SIGKILL of the leader: {time.monotonic() - killed:.2f} s"


async def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--creates", type=int, default=20)
    parser.add_argument("--gets", type=int, default=300)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--secs", type=float, default=15)
    parser.add_argument("--cycles", type=int, default=40)
    parser.add_argument("--cycle-clients", type=int, default=4)
    parser.add_argument(
        "--lone-rounds",
        type=int,
        default=0,
        help="then this many rounds of one client's GETs on each set-up in turn (0: none)",
    )
    parser.add_argument("--lone-secs", type=float, default=3, help="each of those rounds' length")
    parser.add_argument(
        "--compare-src",
        metavar="DIR",
        help="also one and two replicas running the code of DIR (another tree's src), in turn",
    )
    args = parser.parse_args()
    if problem := missing_requirements():
        sys.exit(f"cannot benchmark: {problem}")
    if shutil.which("haproxy") is None:
        sys.exit("cannot benchmark: haproxy is not installed (scripts/install.sh --test-deps)")
    workdir = Path(tempfile.mkdtemp(prefix="sbx-bench-ha-", dir="/var/tmp"))
    (workdir / "n1").mkdir()
    node = Sandboxd(workdir / "n1", args=["--node-id", "bench"]).start()
    cluster = PgCluster.start(durable=True)
    setups: list[SetUp] = []
    try:
        for name, pg, replicas in (("sqlite", False, 1), ("pg-1", True, 1), ("pg-2-haproxy", True, 2),
                                   ("pg-3-haproxy", True, 3)):  # fmt: skip
            setups.append(start(name, workdir, node, cluster if pg else None, replicas))
        if args.compare_src:
            for name, replicas in (("pg-1 other", 1), ("pg-2 other", 2)):
                setups.append(
                    start(name.replace(" ", "-"), workdir, node, cluster, replicas, args.compare_src)
                )
        one_at_a_time(setups, args.creates, args.gets)
        for s in setups:
            s.rows["idle"] = await idle_cpu(s, 5)
            _, body = s.request("POST", "/v1/sandboxes", {})
            sid = json.loads(body)["id"]
            s.rows["get"] = (await get_load(s, sid, args.clients, args.secs))[0]
            s.rows["get one"] = (await get_load(s, sid, 1, args.secs))[0]
            if s.lb is not None:
                s.rows["get direct"] = (await get_load(s, sid, args.clients, args.secs, direct=True))[0]
            s.request("DELETE", f"/v1/sandboxes/{sid}")
            s.rows["cycle"] = await cycle_load(s, args.cycles, args.cycle_clients)
        if args.lone_rounds:
            await lone_rounds(setups, args.lone_rounds, args.lone_secs)
        for s in setups:
            if len(s.gws) > 1:
                s.rows["takeover"] = takeover(s)
        print(f"2 cores; {args.creates} creates each, one at a time, set-ups in turn; {args.clients} GET clients "
              f"for {args.secs:.0f} s; {args.cycles} cycles at {args.cycle_clients} at once")  # fmt: skip
        for s in setups:
            print(f"{s.name}:\n  " + "\n  ".join(s.rows.values()), flush=True)
    finally:
        for s in setups:
            if s.lb is not None:
                s.lb.stop()
            for gw in s.gws:
                gw.stop()
        node.teardown()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    asyncio.run(main())

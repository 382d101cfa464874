"""Benchmark the gateway's store: what one write costs on SQLite and on PostgreSQL, in one run, in turn.

    sudo .venv/bin/python bench/bench_store.py [--writes 500]

For each store: ``put_sandbox`` (the ownership record a create writes: ``full=False``, not waiting for the disk)
and ``add_key`` (a key: ``full=True``, durable), p50/p95 in ms, with the calling process's CPU per write. SQLite:
a state file on /var/tmp. PostgreSQL: a private, durable (fsync on) cluster of Debian's PostgreSQL 15 on a unix
socket on the same machine (tests/support/pg_cluster.py), so the numbers hold the protocol and the server's own
work, without a network. Results go in docs/benchmarks.md.

``--audit N``: the audit log's cost, the file (``GatewayAudit``, a SQLite gateway's) against the PostgreSQL table
(``StoreAudit``, the replicas'): N entries recorded inside an event loop in bursts of 50 (a turn of a busy loop),
each burst's turn timed as the loop sees it (the records, and for the file its write in the next turn), then the
time until all are durable-in-store (written / committed), with the process's CPU per entry (the writer thread's
included).

``--catch-ups N``: what a read's catch-up costs on a PostgreSQL replica (docs/ha.md, read-your-writes), N of them
one at a time inside an event loop, the two ways in turn: the blocking ``caught_up`` behind ``asyncio.to_thread``
(how the gateway asked before 2026-12-02), ``caught_up_on_loop`` (its query asked on the loop through libpq's
non-blocking calls) and that through ``CatchUp`` (how the gateway asks now, one caller at a time: what a read that
comes alone pays): p50/p95 and the process's CPU per catch-up.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import resource
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "support"))

from pg_cluster import PgCluster

from sbx.gateway import keys
from sbx.gateway.audit import GatewayAudit, StoreAudit
from sbx.gateway.catchup import CatchUp
from sbx.gateway.state import SandboxRecord
from sbx.gateway.store import Store, StoreLocation, open_store


def pct(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * p / 100))] * 1000


def cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--writes", type=int, default=500)
    parser.add_argument("--audit", type=int, default=20000, help="audit entries per log (0: skip)")
    parser.add_argument("--audit-rate", type=int, default=5000, help="audit entries recorded per second")
    parser.add_argument("--catch-ups", type=int, default=0, help="catch-ups each way (0: skip)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="bench-store-", dir="/var/tmp"))
    cluster = PgCluster.start(durable=True)
    os.environ.update(cluster.env())
    stores: dict[str, Store] = {
        "sqlite": open_store(StoreLocation(state=workdir / "gw.db")),
        "postgres": open_store(StoreLocation(database=cluster.create_database())),
    }
    try:
        n = 0

        def sandbox(store: Store) -> None:
            nonlocal n
            n += 1
            store.put_sandbox(
                SandboxRecord(f"sbx_{n}", "bench", "", "n1", None, 1, 512, "2026-01-01T00:00:00Z")
            )

        def key(store: Store) -> None:
            store.add_key(keys.new_key("bench", "", {"sandbox:read"})[0])

        operations: list[tuple[str, Callable[[Store], None]]] = [("put_sandbox", sandbox), ("add_key", key)]
        for name, operation in operations:
            times: dict[str, list[float]] = {label: [] for label in stores}
            cpu_used = dict.fromkeys(stores, 0.0)
            for _ in range(args.writes):  # in turn, so drift on the machine hits both alike
                for label, store in stores.items():
                    before_cpu, start = cpu(), time.perf_counter()
                    operation(store)
                    times[label].append(time.perf_counter() - start)
                    cpu_used[label] += cpu() - before_cpu
            for label in stores:
                print(f"{name:<12} {label:<9} p50 {pct(times[label], 50):6.2f} ms  p95 {pct(times[label], 95):6.2f} ms"
                      f"  client CPU {cpu_used[label] / args.writes * 1000:5.2f} ms/write")  # fmt: skip
        if args.audit:
            bench_audit(args.audit, args.audit_rate, workdir, stores["postgres"])
        if args.catch_ups:
            asyncio.run(bench_catch_up(args.catch_ups, stores["postgres"]))
    finally:
        for store in stores.values():
            store.close()
        cluster.stop()
        shutil.rmtree(workdir, ignore_errors=True)


async def bench_catch_up(count: int, pg: Store) -> None:
    pg.listen(pg.refresh)
    pg.add_key(keys.new_key("bench", "", {"sandbox:read"})[0])  # a counter to read
    assert pg.caught_up(10)

    async def thread() -> bool:
        return await asyncio.to_thread(pg.caught_up, 2)

    shared = CatchUp(lambda: pg.caught_up_on_loop(2), 2)  # as the gateway asks it: the calls shared
    ways: dict[str, Callable[[], Any]] = {
        "thread": thread, "on the loop": lambda: pg.caught_up_on_loop(2), "CatchUp": shared,
    }  # fmt: skip
    times: dict[str, list[float]] = {label: [] for label in ways}
    cpu_used = dict.fromkeys(ways, 0.0)
    for _ in range(count):  # in turn
        for label, way in ways.items():
            before_cpu, start = cpu(), time.perf_counter()
            assert await way()
            times[label].append(time.perf_counter() - start)
            cpu_used[label] += cpu() - before_cpu
    for label in ways:
        print(f"catch-up {label:<12} p50 {pct(times[label], 50) * 1000:4.0f} us  p95 {pct(times[label], 95) * 1000:4.0f} us"
              f"  CPU {cpu_used[label] / count * 1e6:4.0f} us")  # fmt: skip
    print(f"  CPU on the loop / thread: {cpu_used['on the loop'] / cpu_used['thread']:.2f}x")


def bench_audit(entries: int, rate: int, workdir: Path, pg: Store) -> None:
    burst = 50
    logs: dict[str, GatewayAudit | StoreAudit] = {
        "file": GatewayAudit(workdir / "audit" / "gateway.jsonl"),
        "postgres": StoreAudit(pg),
    }
    for label, log in logs.items():

        async def run(log: GatewayAudit | StoreAudit = log) -> list[float]:
            turns = []
            for b in range(entries // burst):
                start = time.perf_counter()
                for i in range(burst):
                    log.record(kind="api", type="api.request", key_id="key_0123456789abcdef", user="bench",
                               method="GET", route="/v1/sandboxes/{ref}", status=200, target=f"sbx_{b}_{i}")  # fmt: skip
                await asyncio.sleep(0)  # the file's write runs in this turn
                turns.append(time.perf_counter() - start)
                await asyncio.sleep(max(0.0, burst / rate - (time.perf_counter() - start)))
            return turns

        before_cpu, start = cpu(), time.perf_counter()
        turns = asyncio.run(run())
        recorded = time.perf_counter() - start
        log.flush()
        lag = time.perf_counter() - start - recorded
        used = cpu() - before_cpu
        stored = len(log.read(None, 10 * entries)[0])
        print(f"audit        {label:<9} {rate}/s, loop per burst of {burst}: p50 {pct(turns, 50):6.3f} ms  "
              f"p95 {pct(turns, 95):6.3f} ms  stored {stored}/{entries}, the last {lag * 1000:6.1f} ms after "
              f"recorded  CPU {used / entries * 1e6:5.1f} us/entry")  # fmt: skip
        log.close()


if __name__ == "__main__":
    main()

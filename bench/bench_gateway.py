"""Benchmark the gateway's overhead, in one run on one machine: a real sandboxd and a sandbox-gateway in front.

    sudo .venv/bin/python bench/bench_gateway.py [--creates 30] [--runs 200] [--clients 200] [--secs 60]

- create round trip p50/p95 through the gateway vs straight to the node (same node, same run, alternating);
- run (`true`) round trip p50/p95 the same way;
- load: N concurrent clients for S seconds through the gateway (each loops: GET a sandbox four times, then a
  `run` of `true`), reporting requests, rate, latency percentiles and errors (target: none).

Target (issue 7): under 3 ms added at p50. Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import sys
import tempfile
import time
from pathlib import Path

import aiohttp

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import pct
from gateway_harness import GatewayProcess
from sandboxd_harness import Sandboxd, missing_requirements


def timed(fn: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        start = time.perf_counter()
        fn()  # type: ignore[operator]
        out.append(time.perf_counter() - start)
    return out


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
        direct_r: list[float] = []
        through_r: list[float] = []
        for _ in range(args.runs):
            direct_r += timed(
                lambda: node.request("POST", f"/v1/sandboxes/{target}/run", {"argv": ["true"]}), 1
            )
            through_r += timed(lambda: gw.request("POST", f"/v1/sandboxes/{target}/run", {"argv": ["true"]},
                                                  key=key), 1)  # fmt: skip
        print(line("run", direct_r, through_r))

        ids = [target, *(gw.create(key)["id"] for _ in range(3))]
        asyncio.run(load(gw, key, ids, args.clients, args.secs))
    finally:
        gw.stop()
        node.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

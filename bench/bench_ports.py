"""Benchmark exposed ports (issue 33) through a real gateway in front of two real sandboxd nodes, against a
service and a raw tunnel to the same kind of guest server in the same run.

    sudo .venv/bin/python bench/bench_ports.py [--requests 500] [--wakes 5]

- **GET**: a small GET at a time over one kept-alive connection, interleaved: through a port URL
  (``<port>-<sandbox>.ports.test``, the owner's key), through a service's address (``/svc/...``) and over a raw
  tunnel (``sbx-tunnel/1``) to the same sandbox's port; p50 and requests per second, ratios to the tunnel;
- **WebSocket**: the round trip of a 32-byte text message through a port URL, p50;
- **wake**: a persistent sandbox suspended, then one GET through its port URL: the time to its answer.

Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import os
import shutil
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

import aiohttp
from bench_sandboxd import pct
from bench_services import HEALTH, ready, tunnel, until
from sandboxd_harness import missing_requirements
from services_world import SERVE, World, start_world
from test_gateway_ports import DOMAIN, label, start_guest


def bench_get(w: World, requests: int) -> None:
    made = w.ok("POST", "/v1/sandboxes", {}, status=201)["id"]
    start_guest(w, made, 8080)
    w.ok("POST", "/v1/services", {"name": "lat", "command": SERVE, "port": 8080, "replicas": 1, "health": HEALTH},
         status=201)  # fmt: skip
    until(lambda: ready(w, "lat", 1))
    key = {"Authorization": f"Bearer {w.keys['alice']}"}
    port_conn = http.client.HTTPConnection("127.0.0.1", w.gw.port, timeout=30)
    svc_conn = http.client.HTTPConnection("127.0.0.1", w.gw.port, timeout=30)
    raw = http.client.HTTPConnection("127.0.0.1", 0, timeout=30)
    raw.sock = tunnel(w, made)
    ways = {
        "port URL": (port_conn, "/", {"Host": label(made, 8080), **key}),
        "service": (svc_conn, "/svc/lat--acme/", key),
        "raw tunnel": (raw, "/", {}),
    }
    times: dict[str, list[float]] = {name: [] for name in ways}
    for i in range(requests + 20):
        for name, (conn, path, headers) in ways.items():
            started = time.perf_counter()
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, (name, resp.status)
            if i >= 20:
                times[name].append(time.perf_counter() - started)
    base = pct(times["raw tunnel"], 50)
    for name, got in times.items():
        p50 = pct(got, 50)
        print(f"| small GET, {name} | {p50:.2f} ms | {len(got) / sum(got):.0f} req/s | {p50 / base:.2f}x the "
              "tunnel's p50 |", flush=True)  # fmt: skip
    w.ok("DELETE", "/v1/services/lat", status=204)

    async def echo() -> list[float]:
        out = []
        async with aiohttp.ClientSession() as session, session.ws_connect(
            f"http://127.0.0.1:{w.gw.port}/ws", headers={"Host": label(made, 8080), **key}
        ) as ws:
            for i in range(requests + 20):
                started = time.perf_counter()
                await ws.send_str("x" * 32)
                await ws.receive(timeout=30)
                if i >= 20:
                    out.append(time.perf_counter() - started)
        return out

    rtt = asyncio.run(echo())
    print(f"| WebSocket echo round trip, port URL | {pct(rtt, 50):.2f} ms | p95 {pct(rtt, 95):.2f} ms | |",
          flush=True)  # fmt: skip
    w.ok("DELETE", f"/v1/sandboxes/{made}", status=204)


def bench_wake(w: World, wakes: int) -> None:
    made = w.ok("POST", "/v1/sandboxes", {"name": "sleeper", "persistent": True}, status=201)["id"]
    start_guest(w, made, 8080)
    host = label(made, 8080)
    key = {"Authorization": f"Bearer {w.keys['alice']}", "Host": host}
    got = []
    for _ in range(wakes):
        w.ok("POST", f"/v1/sandboxes/{made}/suspend", {})
        conn = http.client.HTTPConnection("127.0.0.1", w.gw.port, timeout=120)
        started = time.perf_counter()
        conn.request("GET", "/", headers=key)
        resp = conn.getresponse()
        resp.read()
        got.append(time.perf_counter() - started)
        assert resp.status == 200, resp.status
        conn.close()
        time.sleep(6)  # the kept-alive connection closes (5 s), so the next suspend finds no tunnel open
    print(f"| wake on traffic of a suspended persistent sandbox (GET to its answer) | {pct(got, 50):.0f} ms | "
          f"worst {max(got) * 1000:.0f} ms | |", flush=True)  # fmt: skip
    w.ok("DELETE", f"/v1/sandboxes/{made}", status=204)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=500)
    parser.add_argument("--wakes", type=int, default=5)
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        sys.exit(f"cannot run: {missing}")
    w, nodes = start_world(["--ports-domain", DOMAIN], prefix="sbxbench-")
    try:
        print(f"load average {os.getloadavg()[0]:.2f}\n| What | p50 | throughput | ratio |\n|---|---|---|---|",
              flush=True)  # fmt: skip
        bench_get(w, args.requests)
        bench_wake(w, args.wakes)
    finally:
        w.gw.stop()
        for node in nodes:
            node.teardown()
        shutil.rmtree(w.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

"""Benchmark services and jobs through a real gateway in front of two real sandboxd nodes, each against the same
work done by hand through the gateway's sandbox API in the same run.

    sudo .venv/bin/python bench/bench_services.py [--repeats 5] [--jobs 20] [--requests 300]

- **healthy**: POST of a service of 3 replicas (an HTTP server, `health.http` every second) to all 3 healthy, vs
  by hand: 3 sandboxes made at once, the server started in each, each polled through a tunnel until it answers;
- **rollout**: PUT of a changed env to the rollout done with 3 healthy replicas of the new revision, vs by hand
  one replica made and answering, 3 times in a row (a rollout replaces one replica at a time by design);
- **jobs**: N jobs of `true` submitted at once to all succeeded, in runs per minute, vs by hand N (create, run
  `true`, delete) cycles at once;
- **proxy**: one request at a time over one kept-alive connection to the service's address, vs over a tunnel to
  the same replica through the gateway (`sbx-tunnel/1`), p50/p95 and the added latency.

Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import http.client
import shutil
import socket
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import pct
from sandboxd_harness import missing_requirements
from services_world import SERVE, World, start_world

HEALTH = {"http": "/", "every_secs": 1, "failures": 3}


def until(predicate: Callable[[], Any], timeout_secs: float = 120.0, every_secs: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every_secs)
    raise AssertionError("condition not met")


def ready(w: World, name: str, count: int, revision: int | None = None) -> bool:
    svc = w.service(name)
    healthy = [r for r in svc["replicas"] if r["state"] == "healthy"]
    settled = svc.get("rollout", {}).get("state", "done") != "in_progress"
    return bool(len(healthy) == count == len(svc["replicas"]) and settled
                and (revision is None or all(r["revision"] == revision for r in healthy)))  # fmt: skip


def tunnel(w: World, sandbox: str, port: int = 8080) -> socket.socket:
    """A socket switched to a TCP stream to the guest's ``port`` through the gateway."""
    sock = socket.create_connection(("127.0.0.1", w.gw.port), timeout=30)
    sock.sendall(f"GET /v1/sandboxes/{sandbox}/tunnel?port={port} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                 f"Connection: Upgrade\r\nUpgrade: sbx-tunnel/1\r\nAuthorization: Bearer {w.keys['alice']}\r\n\r\n"
                 .encode())  # fmt: skip
    head = b""
    while b"\r\n\r\n" not in head:
        head += sock.recv(4096)
    if not head.startswith(b"HTTP/1.1 101"):
        raise ConnectionError(head[:100])
    return sock


def answers_through_tunnel(w: World, sandbox: str) -> bool:
    try:
        sock = tunnel(w, sandbox)
    except (OSError, ConnectionError):
        return False
    try:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        return sock.recv(12).startswith(b"HTTP/1.")
    except OSError:
        return False
    finally:
        sock.close()


def by_hand(w: World, count: int) -> float:
    """Seconds to make ``count`` sandboxes at once, start the server in each, and see each answer."""
    started = time.monotonic()
    made: list[str] = []

    def one() -> None:
        sandbox = w.ok("POST", "/v1/sandboxes", {}, status=201)["id"]
        made.append(sandbox)
        w.ok("POST", f"/v1/sandboxes/{sandbox}/processes", {"argv": SERVE}, status=201)
        until(lambda: answers_through_tunnel(w, sandbox), every_secs=0.05)

    threads = [threading.Thread(target=one) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    elapsed = time.monotonic() - started
    for sandbox in made:
        w.call("DELETE", f"/v1/sandboxes/{sandbox}")
    return elapsed


def bench_healthy_and_rollout(w: World, repeats: int) -> None:
    healthy, manual, rollout, manual_seq = [], [], [], []
    for i in range(repeats):
        name = f"b{i}"
        started = time.monotonic()
        w.ok("POST", "/v1/services", {"name": name, "command": SERVE, "port": 8080, "replicas": 3,
                                      "health": HEALTH, "env": {"GREETING": "a"}}, status=201)  # fmt: skip
        until(lambda n=name: ready(w, n, 3))
        healthy.append(time.monotonic() - started)
        manual.append(by_hand(w, 3))
        started = time.monotonic()
        w.ok("PUT", f"/v1/services/{name}", {"name": name, "command": SERVE, "port": 8080, "replicas": 3,
                                              "health": HEALTH, "env": {"GREETING": "b"}})  # fmt: skip
        until(lambda n=name: ready(w, n, 3, revision=2))
        rollout.append(time.monotonic() - started)
        manual_seq.append(sum(by_hand(w, 1) for _ in range(3)))
        w.ok("DELETE", f"/v1/services/{name}", status=204)
    row("POST to 3 healthy", healthy, manual)
    row("rollout of 3", rollout, manual_seq)


def row(name: str, measured: list[float], baseline: list[float]) -> None:
    m50, m95 = pct(measured, 50), pct(measured, 95)  # pct: seconds in, milliseconds out
    b50, b95 = pct(baseline, 50), pct(baseline, 95)
    print(f"| {name} | {m50:.0f} ms | {m95:.0f} ms | by hand {b50:.0f} / {b95:.0f} ms | {m50 / b50:.2f}x p50 |",
          flush=True)  # fmt: skip


def bench_jobs(w: World, count: int) -> None:
    started = time.monotonic()
    ids = [w.ok("POST", "/v1/jobs", {"command": ["true"]}, status=201)["id"] for _ in range(count)]
    for job_id in ids:
        until(lambda j=job_id: w.job(j)["state"] in ("succeeded", "failed"), every_secs=0.1)
        assert w.job(job_id)["state"] == "succeeded"
    jobs_secs = time.monotonic() - started

    def cycle() -> None:
        while (made := w.call("POST", "/v1/sandboxes", {})).status == 503:
            time.sleep(0.1)  # no room now: as a queued job waits
        assert made.status == 201, made.body
        sandbox = made.json()["id"]
        w.ok("POST", f"/v1/sandboxes/{sandbox}/run", {"argv": ["true"]})
        w.call("DELETE", f"/v1/sandboxes/{sandbox}")

    started = time.monotonic()
    threads = [threading.Thread(target=cycle) for _ in range(count)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    hand_secs = time.monotonic() - started
    print(f"| {count} jobs of `true` | {60 * count / jobs_secs:.0f} runs/min ({jobs_secs:.1f} s) | by hand "
          f"{60 * count / hand_secs:.0f} cycles/min ({hand_secs:.1f} s) | {hand_secs / jobs_secs:.2f}x throughput |",
          flush=True)  # fmt: skip


def bench_proxy(w: World, requests: int) -> None:
    w.ok("POST", "/v1/services", {"name": "lat", "command": SERVE, "port": 8080, "replicas": 1, "health": HEALTH},
         status=201)  # fmt: skip
    until(lambda: ready(w, "lat", 1))
    sandbox = w.service("lat")["replicas"][0]["sandbox"]
    proxy = http.client.HTTPConnection("127.0.0.1", w.gw.port, timeout=30)
    direct = http.client.HTTPConnection("127.0.0.1", 0, timeout=30)
    direct.sock = tunnel(w, sandbox)
    headers = {"Authorization": f"Bearer {w.keys['alice']}"}
    via_proxy: list[float] = []
    via_tunnel: list[float] = []
    for i in range(requests + 20):
        for conn, path, into in ((proxy, "/svc/lat--acme/", via_proxy), (direct, "/", via_tunnel)):
            started = time.perf_counter()
            conn.request("GET", path, headers=headers)
            resp = conn.getresponse()
            resp.read()
            assert resp.status == 200, resp.status
            if i >= 20:  # warm-up left out
                into.append(time.perf_counter() - started)
    p50, t50 = pct(via_proxy, 50), pct(via_tunnel, 50)
    print(f"| GET through the service address | {p50:.2f} ms | {pct(via_proxy, 95):.2f} ms | tunnel {t50:.2f} / "
          f"{pct(via_tunnel, 95):.2f} ms | added {p50 - t50:.2f} ms p50 ({p50 / t50:.2f}x) |", flush=True)  # fmt: skip
    w.ok("DELETE", "/v1/services/lat", status=204)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--jobs", type=int, default=20)
    parser.add_argument("--requests", type=int, default=300)
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        sys.exit(f"cannot run: {missing}")
    w, nodes = start_world(prefix="sbxbench-")
    try:
        print("| What | p50 | p95 | baseline (same run) | ratio |\n|---|---|---|---|---|", flush=True)
        bench_healthy_and_rollout(w, args.repeats)
        bench_jobs(w, args.jobs)
        bench_proxy(w, args.requests)
    finally:
        w.gw.stop()
        for node in nodes:
            node.teardown()
        shutil.rmtree(w.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

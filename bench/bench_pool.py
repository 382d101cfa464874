"""Benchmark creates from a warm pool against raw runsc, measured in one run on the same machine.

    sudo .venv/bin/python bench/bench_pool.py [--sandboxes 30] [--pool 2]

Starts sandboxd with a pool of the default image, then for each sample waits until the pool is full and
times create-to-first-run-result (POST /v1/sandboxes, then POST .../run of `true`, over one keep-alive
connection, as a client would), and the same for `runsc run` of `true` on the same image root. Prints
p50/p95 of both and checks the targets: pooled p50 at most 60 ms and at most a third of `runsc run`'s.
Exit status 1 when a target is missed.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench"))

from bench_sandboxd import RawRunsc, pct, summary
from sandboxd_harness import AGENT_PATH, IMAGES_DIR, Sandboxd, UnixHTTPConnection, missing_requirements

from sbx.images.store import ImageStore

#: The targets of the images issue.
TARGET_P50_MS = 60.0
TARGET_RATIO = 1 / 3


def wait_full(server: Sandboxd, size: int, timeout_secs: float = 120) -> None:
    deadline = time.monotonic() + timeout_secs
    while time.monotonic() < deadline:
        if server.request("GET", "/v1/node").json()["pooled"].get("default") == size:
            return
        time.sleep(0.02)
    raise RuntimeError("the pool did not fill")


def pooled_creates(server: Sandboxd, count: int, size: int) -> list[float]:
    conn = UnixHTTPConnection(server.socket_path)
    headers = {"Content-Type": "application/json"}

    def call(method: str, path: str, body: object = None) -> dict[str, object]:
        conn.request(method, path, body=None if body is None else json.dumps(body).encode(), headers=headers)
        response = conn.getresponse()
        data = response.read()
        assert response.status in (200, 201, 204), (response.status, data)
        return json.loads(data) if data else {}

    durations = []
    try:
        for _ in range(count):
            wait_full(server, size)
            started = time.monotonic()
            created = call("POST", "/v1/sandboxes", {})
            result = call("POST", f"/v1/sandboxes/{created['id']}/run", {"argv": ["true"]})
            durations.append(time.monotonic() - started)
            assert result["exit_code"] == 0
            events = server.request("GET", f"/v1/sandboxes/{created['id']}/events").json()["events"]
            assert events[0].get("reason") == "pool", "the create did not come from the pool"
            call("DELETE", f"/v1/sandboxes/{created['id']}")
            # Teardown finishes in the background; let it end so it does not weigh on the next sample
            # (runsc run's cleanup is outside its timing too).
            while (server.state_dir / "gvisor" / str(created["id"])).exists():
                time.sleep(0.02)
    finally:
        conn.close()
    return durations


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sandboxes", type=int, default=30)
    parser.add_argument("--pool", type=int, default=2)
    args = parser.parse_args()
    missing = missing_requirements()
    if missing:
        sys.exit(f"cannot benchmark: {missing}")
    image = ImageStore(IMAGES_DIR).get("default")
    assert image is not None and AGENT_PATH.exists()
    workdir = Path(tempfile.mkdtemp(prefix="sbx-bench-pool-", dir="/var/tmp"))
    (workdir / "node").mkdir()
    server = Sandboxd(workdir / "node", f'[[pools]]\nimage = "default"\nsize = {args.pool}\n')
    raw = RawRunsc(workdir / "raw", image.rootfs)
    try:
        server.start()
        print(f"# warm pool vs runsc run, {time.strftime('%Y-%m-%d %H:%M')} UTC, pool of {args.pool}")
        raw.write_spec(["true"])
        raw_runs = []
        for i in range(args.sandboxes):
            raw_runs.append(raw.run(f"raw-run-{i}"))
            raw.cleanup(f"raw-run-{i}")
        ours = pooled_creates(server, args.sandboxes, args.pool)
        print(summary("runsc run (true)", raw_runs))
        print(summary("pooled create + first run (true)", ours, raw_runs))
        p50, raw_p50 = pct(ours, 50), pct(raw_runs, 50)
        ok = p50 <= TARGET_P50_MS and p50 <= raw_p50 * TARGET_RATIO
        print(
            f"targets: p50 <= {TARGET_P50_MS:.0f} ms and <= 1/3 of runsc run ({raw_p50 * TARGET_RATIO:.1f} ms): "
            + ("met" if ok else "MISSED")
        )
        if not ok:
            sys.exit(1)
    finally:
        server.teardown()
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()

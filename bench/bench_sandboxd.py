"""Benchmark sandboxd against raw runsc, measured in one run on the same machine.

    sudo .venv/bin/python bench/bench_sandboxd.py [--sandboxes 50] [--runs 200] [--concurrent 20]

Prints p50/p95 (and p99 for concurrent creates) with ratios against the raw tool:
- create-to-first-run-result (POST /v1/sandboxes, then POST .../run of `true`) vs `runsc run` of `true`
  in a bundle on the same image root, one of each in turn;
- run round trip of `true` vs `runsc exec` of `true` into a running raw sandbox;
- N concurrent creates;
- idle memory per sandbox (its cgroup's usage, and the host's MemAvailable drop per sandbox);
- sandboxd's CPU per run of `true` as one sandbox's history grows (``--history-runs``, default 10,000; read
  from /proc/<pid>/stat of sandboxd over a window of runs at 30, 1,000, 3,000 and 10,000 runs): per-request
  work must not grow with what the sandbox has done. ``--history-only`` measures only this (no raw runsc).
Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from sandboxd_harness import AGENT_PATH, IMAGES_DIR, Sandboxd, UnixHTTPConnection, missing_requirements

from sbx.api.node import Defaults
from sbx.backends.gvisor import CGROUP_PARENT
from sbx.backends.runsc import DEFAULT_RUNSC, PLATFORMS, choose_platform, inspect_runsc, release_roots_under
from sbx.client import AsyncClient
from sbx.images.store import ImageStore


def cpu_secs(pid: int) -> float:
    """User plus system CPU time of process ``pid`` so far, in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(values: list[float], q: float) -> float:
    """The q-th percentile (0-100) by nearest rank, in milliseconds."""
    ordered = sorted(values)
    index = min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[index] * 1000


def summary(name: str, values: list[float], raw: list[float] | None = None, p99: bool = False) -> str:
    line = f"{name:<42} p50 {pct(values, 50):8.1f} ms   p95 {pct(values, 95):8.1f} ms"
    if p99:
        line += f"   p99 {pct(values, 99):8.1f} ms"
    if raw:
        line += f"   ratio p50 {pct(values, 50) / pct(raw, 50):5.2f}x   p95 {pct(values, 95) / pct(raw, 95):5.2f}x"
    return line


class RawRunsc:
    """runsc used directly on a bundle whose root is the image root (read-only), for comparison, with the
    flags sandboxd gives it (runsc.py) on ``platform`` (None: the one sandboxd would choose here) and the CPU
    quota of a default sandbox (``Defaults().cpus`` cores)."""

    def __init__(self, workdir: Path, image_root: Path, platform: str | None = None) -> None:
        self.root = workdir / "runsc-root"
        self.bundle = workdir / "bundle"
        self.bundle.mkdir(parents=True)
        self.image_root = image_root
        self.info = inspect_runsc(os.environ.get("SBX_RUNSC", DEFAULT_RUNSC))
        self.platform = platform or choose_platform(self.info, "auto", AGENT_PATH, workdir / "probe")[0]

    def write_spec(self, args: list[str]) -> None:
        spec = {
            "ociVersion": "1.0.0",
            "process": {"user": {"uid": 1000, "gid": 1000}, "args": args, "cwd": "/",
                        "env": ["PATH=/usr/local/bin:/usr/bin:/bin"]},
            "root": {"path": str(self.image_root), "readonly": True},
            "hostname": "raw",
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                       {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"}],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                      "resources": {"memory": {"limit": 512 * 1024 * 1024},
                                    "cpu": {"quota": Defaults().cpus * 100000, "period": 100000}}},
        }  # fmt: skip
        (self.bundle / "config.json").write_text(json.dumps(spec))

    def argv(self, *args: str) -> list[str]:
        return [
            self.info.path,
            "--root",
            str(self.root),
            *self.info.start_flags(self.platform),
            "--network=none",
            *args,
        ]

    def run(self, name: str) -> float:
        started = time.monotonic()
        subprocess.run(self.argv("run", "--bundle", str(self.bundle), name), check=True,
                       stdout=subprocess.DEVNULL, stdin=subprocess.DEVNULL)  # fmt: skip
        return time.monotonic() - started

    def run_samples(self, count: int) -> list[float]:
        """Seconds of each of ``count`` `runsc run` of `true`; cleaning up is outside the timing."""
        self.write_spec(["true"])
        durations = []
        for i in range(count):
            durations.append(self.run(f"raw-run-{i}"))
            self.cleanup(f"raw-run-{i}")
        return durations

    def exec(self, name: str) -> float:
        started = time.monotonic()
        subprocess.run(self.argv("exec", name, "true"), check=True, stdout=subprocess.DEVNULL)
        return time.monotonic() - started

    def exec_samples(self, count: int) -> list[float]:
        """Seconds of each of ``count`` `runsc exec` of `true` into a raw sandbox running `sleep`."""
        self.write_spec(["sleep", "3600"])
        subprocess.run(self.argv("run", "--detach", "--bundle", str(self.bundle), "raw-exec"), check=True,
                       stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
        try:
            self.exec("raw-exec")
            return [self.exec("raw-exec") for _ in range(count)]
        finally:
            self.cleanup("raw-exec")

    def cleanup(self, name: str) -> None:
        for args in (("kill", name, "KILL"), ("delete", "-force", name)):
            subprocess.run(self.argv(*args), capture_output=True, check=False)


async def timed(fn: Callable[[], Awaitable[Any]]) -> float:
    started = time.monotonic()
    await fn()
    return time.monotonic() - started


class KeepAlive:
    """One keep-alive HTTP/1.1 connection to a server, as a client would use: no SDK overhead."""

    def __init__(self, server: Sandboxd) -> None:
        self.conn = UnixHTTPConnection(server.socket_path)

    def call(self, method: str, path: str, body: object = None) -> dict[str, Any]:
        """Send ``body`` as JSON; the decoded answer (``{}`` when empty). Any non-2xx answer fails the run."""
        data = None if body is None else json.dumps(body).encode()
        self.conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        response = self.conn.getresponse()
        raw = response.read()
        assert response.status in (200, 201, 204), (response.status, raw)
        return json.loads(raw) if raw else {}

    def timed(self, method: str, path: str, body: object = None) -> tuple[float, dict[str, Any]]:
        """``call``, with the seconds it took."""
        started = time.monotonic()
        result = self.call(method, path, body)
        return time.monotonic() - started, result

    def close(self) -> None:
        self.conn.close()


def http_runs(server: Sandboxd, sandbox_id: str, count: int) -> list[float]:
    """Run round trips over one keep-alive connection: the server's share without SDK overhead."""
    client = KeepAlive(server)
    try:
        return [
            client.timed("POST", f"/v1/sandboxes/{sandbox_id}/run", {"argv": ["true"]})[0]
            for _ in range(count)
        ]
    finally:
        client.close()


#: History sizes (runs already made in the sandbox) at which sandboxd's CPU per run is measured.
HISTORY_POINTS = (30, 1000, 3000, 10000)


def history_cpu(
    server: Sandboxd, sandbox_id: str, total_runs: int, window: int
) -> Iterator[tuple[int, float]]:
    """sandboxd's CPU seconds per run of `true` over ``window`` runs starting at each of HISTORY_POINTS (and at
    ``total_runs`` when it is not one) that is at most ``total_runs``, as (runs before the window, seconds),
    each as soon as it is measured.

    The runs between windows are made as fast as one keep-alive connection allows. sandboxd's CPU is read from
    /proc (user plus system, all its threads), at a clock tick's resolution: ``window`` runs keep that below
    one percent of what a window measures.
    """
    assert server.proc is not None
    pid = server.proc.pid
    points = sorted({p for p in HISTORY_POINTS if p <= total_runs} | {total_runs})
    client = KeepAlive(server)
    done = 0
    try:
        for point in points:
            while done < point:
                client.call("POST", f"/v1/sandboxes/{sandbox_id}/run", {"argv": ["true"]})
                done += 1
            before = cpu_secs(pid)
            for _ in range(window):
                client.call("POST", f"/v1/sandboxes/{sandbox_id}/run", {"argv": ["true"]})
            yield point, (cpu_secs(pid) - before) / window
            done += window
    finally:
        client.close()


def print_history_cpu(server: Sandboxd, total_runs: int, window: int) -> None:
    """Create a sandbox, measure :func:`history_cpu` in it, print one row per point, delete it."""
    sandbox_id = server.create()["id"]
    first = None
    try:
        for point, secs in history_cpu(server, sandbox_id, total_runs, window):
            first = first or secs
            name = f"sandboxd CPU per run (true) after {point:,} runs"
            print(f"{name:<42} {secs * 1000:8.2f} ms   ratio to the first {secs / first:5.2f}x   ({window} runs)",
                  flush=True)  # fmt: skip
    finally:
        server.request("DELETE", f"/v1/sandboxes/{sandbox_id}")


def wait_torn_down(server: Sandboxd, sandbox_id: str) -> None:
    """Wait until a deleted sandbox's background teardown ended, so it does not weigh on the next sample."""
    while (server.state_dir / "gvisor" / sandbox_id).exists():
        time.sleep(0.02)


def default_rootfs() -> Path:
    """The default image's root (what `RawRunsc` runs on); fails when the image or the agent is missing."""
    image = ImageStore(IMAGES_DIR).get("default")
    assert image is not None and AGENT_PATH.exists(), "run scripts/install.sh first"
    return image.rootfs


@contextmanager
def bench_node(prefix: str, config_text: str = "") -> Iterator[tuple[Sandboxd, Path]]:
    """A started sandboxd (node config ``config_text``) and a fresh work directory under /var/tmp.

    Exits the program when this host cannot run sandboxes; on leaving, tears the server down and
    removes the work directory.
    """
    missing = missing_requirements()
    if missing:
        sys.exit(f"cannot benchmark: {missing}")
    workdir = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    (workdir / "node").mkdir()
    server = Sandboxd(workdir / "node", config_text)
    try:
        server.start()
        yield server, workdir
    finally:
        server.teardown()
        release_roots_under(workdir)  # the raw runsc's roots
        shutil.rmtree(workdir, ignore_errors=True)


def mem_available_kib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1])
    raise RuntimeError("no MemAvailable in /proc/meminfo")


async def bench(args: argparse.Namespace, server: Sandboxd, raw: RawRunsc) -> None:
    client = AsyncClient(f"unix://{server.socket_path}")
    runtime = server.request("GET", "/v1/node").json()["runtime"]
    print(f"# sandboxd vs runsc, {time.strftime('%Y-%m-%d %H:%M')} UTC, {os.cpu_count()} cores, "
          f"runsc {runtime['runsc_version']}, sandboxd on {runtime['platform']}, raw runsc run on {raw.platform}")  # fmt: skip

    # 1. create-to-first-run-result vs runsc run of the same command, one of each in turn: a busy moment of this
    # shared machine then weighs on both alike
    raw_runs, ours = [], []
    for _ in range(args.sandboxes):
        raw_runs += await asyncio.to_thread(raw.run_samples, 1)
        started = time.monotonic()
        created = await client.sandboxes.create()
        result = await created.run(["true"])
        ours.append(time.monotonic() - started)
        assert result.exit_code == 0
        await created.delete()
    print(summary("runsc run (true)", raw_runs))
    print(summary("create + first run (true)", ours, raw_runs))

    # 2. run round trip vs runsc exec, on every platform this runsc has: the faster one is the baseline
    execs_by_platform = {}
    for platform in (p for p in PLATFORMS if p in raw.info.platforms):
        other = RawRunsc(raw.bundle.parent / f"exec-{platform}", raw.image_root, platform)
        execs_by_platform[platform] = await asyncio.to_thread(other.exec_samples, min(args.runs, 100))
    fastest = min(execs_by_platform, key=lambda p: pct(execs_by_platform[p], 50))
    raw_execs = execs_by_platform[fastest]
    sandbox = await client.sandboxes.create()
    await sandbox.run(["true"])
    runs = [await timed(lambda: sandbox.run(["true"])) for _ in range(args.runs)]
    raw_http = await asyncio.to_thread(http_runs, server, sandbox.id, args.runs)
    for platform, samples in execs_by_platform.items():
        print(summary(f"runsc exec (true), {platform}", samples))
    print(summary(f"run round trip (true), SDK, vs {fastest}", runs, raw_execs))
    print(summary(f"run round trip (true), HTTP keep-alive, vs {fastest}", raw_http, raw_execs))

    # 3. idle memory per sandbox
    idle_count = 10
    before = mem_available_kib()
    idle = [await client.sandboxes.create() for _ in range(idle_count)]
    await asyncio.sleep(5)
    after = mem_available_kib()
    usages = []
    for s in idle + [sandbox]:
        usage_file = Path("/sys/fs/cgroup/memory") / CGROUP_PARENT.strip("/") / s.id / "memory.usage_in_bytes"
        if usage_file.exists():
            usages.append(int(usage_file.read_text()) / 2**20)
    print(f"{'idle memory per sandbox (cgroup usage)':<42} mean {statistics.mean(usages):6.1f} MiB   "
          f"max {max(usages):6.1f} MiB over {len(usages)}")  # fmt: skip
    print(f"{'idle memory per sandbox (MemAvailable)':<42} {(before - after) / 1024 / idle_count:6.1f} MiB each "
          f"over {idle_count}")  # fmt: skip
    for s in idle + [sandbox]:
        await s.delete()
    await asyncio.sleep(3)

    # 4. concurrent creates
    async def create_one() -> tuple[float, str]:
        started = time.monotonic()
        created = await client.sandboxes.create()
        return time.monotonic() - started, created.id

    results = await asyncio.gather(*(create_one() for _ in range(args.concurrent)))
    print(summary(f"{args.concurrent} concurrent creates", [r[0] for r in results], p99=True))
    for _, sandbox_id in results:
        await client.sandboxes.delete(sandbox_id)
    await client.aclose()

    # 5. sandboxd's CPU per run as the sandbox's history grows
    if args.history_runs:
        await asyncio.to_thread(print_history_cpu, server, args.history_runs, args.history_window)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--sandboxes", type=int, default=50)
    parser.add_argument("--runs", type=int, default=200)
    parser.add_argument("--concurrent", type=int, default=20)
    parser.add_argument(
        "--history-runs",
        type=int,
        default=10000,
        help="runs in one sandbox for sandboxd's CPU per run as its history grows (0: skip)",
    )
    parser.add_argument("--history-window", type=int, default=300, help="runs measured at each point")
    parser.add_argument("--history-only", action="store_true", help="measure only the CPU per run by history")
    args = parser.parse_args()
    # Room for the concurrent creates whatever this host's measured capacity (2 cores x 8 here).
    capacity = f"[capacity]\ncpus = {max(64, args.concurrent * 2)}\n"
    with bench_node("sbx-bench-", capacity) as (server, workdir):
        if args.history_only:
            print(f"# sandboxd CPU per run by history, {time.strftime('%Y-%m-%d %H:%M')} UTC, "
                  f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}")  # fmt: skip
            print_history_cpu(server, args.history_runs, args.history_window)
        else:
            asyncio.run(bench(args, server, RawRunsc(workdir / "raw", default_rootfs())))


if __name__ == "__main__":
    main()

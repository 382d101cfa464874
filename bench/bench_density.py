"""Density: how many idle sandboxes one node holds, and what they cost at rest (issue 22).

    sudo .venv/bin/python bench/bench_density.py --counts 100,500,1000 [--rest-secs 30] [--park-after 10]

Starts its own sandboxd (capacity overcommitted so that only the host's limits stop it, idle timeout off,
``[parking] park_after_secs`` from ``--park-after``), measures the empty node, then fills it step by step to
each count in ``--counts``: every sandbox is created, given one ``true``, then left alone. At each step, once
all of them are parked:

- host CPU at rest: the busy share of both cores from /proc/stat over ``--rest-secs`` (other work on the machine
  included: the empty node's figure, measured the same way first, is that baseline), the CPU the sandboxes'
  cgroups used meanwhile (theirs alone), and sandboxd's own CPU;
- memory per sandbox: the host's MemAvailable drop since the empty node, divided by the count, and the mean of
  the sandboxes' cgroup usage; host tasks and sandboxd descriptors per sandbox;
- the time the step's fill took;
- create + first run p50 and run round trip p50 (a fresh awake sandbox, keep-alive HTTP), against the empty
  node's, beside a raw ``runsc run`` of ``true`` timed at the same moment (what the host itself gives: the
  machine is shared, so a slower create next to an equally slower raw runsc is the host's load, not the node);
  and the first request to a parked sandbox (p50/p95);
- the processes that used the host's CPU during the rest (top five, by name), so that the host figure can be
  told apart from other work on the machine.

First, unless ``--wake-cycles 0``, two one-sandbox nodes (parking on, and off) compare the first run after the
same idle time: what a wake-up itself adds.

Stops a fill early, saying why, when MemAvailable falls below ``--min-available-mb`` or the node refuses a create
(503: it names the limit that binds). Every sandbox and mount it made is torn down at the end, on Ctrl-C or
SIGTERM too. ``--raise-pid-max`` sets kernel.pid_max to 4194304 first, as scripts/install.sh does (the default
32768 holds about 1,000 idle sandboxes with nothing else on the host). Results go in docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench"))

from bench_sandboxd import KeepAlive, RawRunsc, bench_node, default_rootfs, mem_available_kib, pct
from sandboxd_harness import Sandboxd

from sbx.backends.freezer import CgroupFreezer
from sbx.backends.gvisor import CGROUP_PARENT
from sbx.backends.host_counters import CGROUP_ROOT, read_usage
from sbx.node.capacity import INSTALLED_PID_MAX

FREEZER = CgroupFreezer(CGROUP_PARENT)
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


class Stop(Exception):
    """SIGTERM: leave through the teardown, as Ctrl-C does."""


def cpu_times() -> tuple[int, int]:
    """(busy, total) jiffies of all CPUs from /proc/stat (idle and iowait are not busy)."""
    fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    idle = fields[3] + fields[4]
    return sum(fields) - idle, sum(fields)


def process_cpu_secs(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def load_average() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def p50_ms(values: list[float]) -> float:
    return pct(values, 50)  # bench_sandboxd's pct answers milliseconds


@dataclass
class Step:
    """What one fill step measured."""

    count: int
    fill_secs: float
    host_busy_pct: float
    sandboxes_cpu_pct: float
    sandboxd_cpu_pct: float
    load: str
    mem_drop_mib_each: float
    cgroup_mib_each: float
    tasks_each: float
    fds_each: float
    create_run_ms: float
    round_trip_ms: float
    woken_p50_ms: float
    woken_p95_ms: float
    parked: int
    raw_run_ms: float = 0.0
    top: str = ""
    stopped: str = ""


class Node:
    """The benchmark's sandboxd and the sandboxes it filled, with the teardown of all of them."""

    def __init__(self, server: Sandboxd, concurrency: int, network: str = "none") -> None:
        self.server = server
        self.concurrency = concurrency
        self.body: dict[str, Any] = {} if network == "none" else {"network": {"mode": network}}
        self.made: list[str] = []
        self.lock = threading.Lock()

    def pid(self) -> int:
        assert self.server.proc is not None
        return self.server.proc.pid

    def status(self) -> dict[str, Any]:
        return self.server.request("GET", "/v1/node").json()  # type: ignore[no-any-return]

    def create_and_run(self) -> tuple[float, str | None, str]:
        """(seconds, id or None, why not) for one create + first run of ``true``."""
        client = KeepAlive(self.server)
        try:
            started = time.monotonic()
            resp = self.server.request("POST", "/v1/sandboxes", self.body)
            if resp.status != 201:
                return 0.0, None, f"{resp.status} {resp.body.decode(errors='replace')[:300]}"
            sandbox_id = resp.json()["id"]
            with self.lock:
                self.made.append(sandbox_id)
            client.call("POST", f"/v1/sandboxes/{sandbox_id}/run", {"argv": ["true"]})
            return time.monotonic() - started, sandbox_id, ""
        finally:
            client.close()

    def fill(self, count: int, min_available_mb: int) -> tuple[float, str]:
        """Create sandboxes until ``count`` (``concurrency`` at a time); (seconds, why it stopped early)."""
        started = time.monotonic()
        why = ""
        with ThreadPoolExecutor(self.concurrency) as pool:
            while len(self.made) < count and not why:
                if mem_available_kib() // 1024 < min_available_mb:
                    why = f"MemAvailable below {min_available_mb} MiB"
                    break
                batch = min(self.concurrency * 4, count - len(self.made))
                for _, sandbox_id, refused in pool.map(lambda _: self.create_and_run(), range(batch)):
                    if sandbox_id is None:
                        why = f"create refused: {refused}"
                if len(self.made) % 100 < batch:
                    print(f"    {len(self.made)} sandboxes, {time.monotonic() - started:.0f} s, "
                          f"MemAvailable {mem_available_kib() // 1024} MiB, load {load_average()}", flush=True)  # fmt: skip
        return time.monotonic() - started, why

    def wait_parked(self, timeout_secs: float) -> int:
        deadline = time.monotonic() + timeout_secs
        while time.monotonic() < deadline:
            parked = sum(1 for s in self.made if FREEZER.state(s) == "frozen")
            if parked >= len(self.made):
                return parked
            time.sleep(1)
        return sum(1 for s in self.made if FREEZER.state(s) == "frozen")

    def latencies(self, samples: int) -> tuple[float, float]:
        """(create + first run p50, run round trip p50) in ms, on sandboxes made and deleted for it."""
        creates = []
        for _ in range(samples):
            secs, sandbox_id, why = self.create_and_run()
            assert sandbox_id is not None, why
            creates.append(secs)
            self.delete([sandbox_id])
        _, sandbox_id, why = self.create_and_run()
        assert sandbox_id is not None, why
        client = KeepAlive(self.server)
        try:
            trips = [client.timed("POST", f"/v1/sandboxes/{sandbox_id}/run", {"argv": ["true"]})[0]
                     for _ in range(samples * 5)]  # fmt: skip
        finally:
            client.close()
        self.delete([sandbox_id])
        return p50_ms(creates), p50_ms(trips)

    def woken(self, samples: int) -> list[float]:
        """First run on parked sandboxes, each timed once."""
        chosen = [s for s in self.made if FREEZER.state(s) == "frozen"][:samples]
        client = KeepAlive(self.server)
        try:
            return [client.timed("POST", f"/v1/sandboxes/{s}/run", {"argv": ["true"]})[0] for s in chosen]
        finally:
            client.close()

    def delete(self, ids: list[str]) -> None:
        def one(sandbox_id: str) -> None:
            self.server.request("DELETE", f"/v1/sandboxes/{sandbox_id}")

        with ThreadPoolExecutor(self.concurrency) as pool:
            list(pool.map(one, ids))
        with self.lock:
            gone = set(ids)
            self.made = [s for s in self.made if s not in gone]
        deadline = time.monotonic() + 120 + len(ids)
        while (
            any((self.server.state_dir / "gvisor" / s).exists() for s in ids) and time.monotonic() < deadline
        ):
            time.sleep(0.5)

    def teardown_all(self) -> None:
        print(f"tearing down {len(self.made)} sandboxes", flush=True)
        if self.made:
            self.delete(list(self.made))


def cgroup_figures(ids: list[str]) -> tuple[float, float, int]:
    """(mean cgroup memory usage in MiB, mean host tasks, summed CPU ns) of the sandboxes' cgroups."""
    memory, tasks, cpu = [], [], 0
    for sandbox_id in ids:
        usage_file = CGROUP_ROOT / "memory" / CGROUP_PARENT.strip("/") / sandbox_id / "memory.usage_in_bytes"
        if usage_file.exists():
            memory.append(int(usage_file.read_text()) / 2**20)
        tasks_file = CGROUP_ROOT / "pids" / CGROUP_PARENT.strip("/") / sandbox_id / "tasks"
        if tasks_file.exists():
            tasks.append(len(tasks_file.read_text().split()))
        usage = read_usage(f"{CGROUP_PARENT}/{sandbox_id}")
        cpu += usage.cpu_ns if usage is not None else 0
    return (statistics.mean(memory) if memory else 0.0, statistics.mean(tasks) if tasks else 0.0, cpu)


def process_ticks() -> dict[int, tuple[str, int]]:
    """(name, user+system ticks) of every process on the host, kernel threads included."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            text = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        name = text[text.index("(") + 1 : text.rindex(")")]
        fields = text.rsplit(")", 1)[1].split()
        found[int(entry)] = (name, int(fields[11]) + int(fields[12]))
    return found


def top_consumers(before: dict[int, tuple[str, int]], after: dict[int, tuple[str, int]], secs: float) -> str:
    """The five process names that used the most CPU between the two readings, as % of one core."""
    by_name: dict[str, int] = {}
    for pid, (name, ticks) in after.items():
        used = ticks - before.get(pid, (name, 0))[1] if pid in before else 0
        by_name[name] = by_name.get(name, 0) + max(0, used)
    top = sorted(by_name.items(), key=lambda item: -item[1])[:5]
    return ", ".join(f"{name} {100 * ticks / CLOCK_TICKS / secs:.0f} %" for name, ticks in top if ticks)


def at_rest(node: Node, secs: float) -> tuple[float, float, float, str, str]:
    """(host busy %, sandboxes' cgroups % of the host's CPUs, sandboxd % of one core, load, top consumers)
    over ``secs``."""
    busy0, total0 = cpu_times()
    d0 = process_cpu_secs(node.pid())
    _, _, c0 = cgroup_figures(node.made)
    ticks0 = process_ticks()
    started = time.monotonic()
    time.sleep(secs)
    elapsed = time.monotonic() - started
    busy1, total1 = cpu_times()
    d1 = process_cpu_secs(node.pid())
    _, _, c1 = cgroup_figures(node.made)
    ticks1 = process_ticks()
    cores = os.cpu_count() or 1
    host = 100 * (busy1 - busy0) / max(1, total1 - total0)
    sandboxes = 100 * (c1 - c0) / 1e9 / elapsed / cores
    top = top_consumers(ticks0, ticks1, elapsed)
    return host, sandboxes, 100 * (d1 - d0) / elapsed, load_average(), top


def measure(
    node: Node,
    count: int,
    fill_secs: float,
    why: str,
    baseline_kib: int,
    args: argparse.Namespace,
    raw: RawRunsc,
) -> Step:
    parked = node.wait_parked(args.park_after + 60 + len(node.made) * 0.05)
    host, sandboxes, sandboxd, load, top = at_rest(node, args.rest_secs)
    n = max(1, len(node.made))
    cgroup_mib, tasks, _ = cgroup_figures(node.made)
    fds = len(os.listdir(f"/proc/{node.pid()}/fd"))
    drop = (baseline_kib - mem_available_kib()) / 1024 / n
    woken = node.woken(args.samples)
    create_ms, trip_ms = node.latencies(args.samples)
    raw_ms = pct(raw.run_samples(args.samples), 50)
    return Step(
        count=len(node.made), fill_secs=fill_secs, host_busy_pct=host, sandboxes_cpu_pct=sandboxes,
        sandboxd_cpu_pct=sandboxd, load=load, mem_drop_mib_each=drop, cgroup_mib_each=cgroup_mib,
        tasks_each=tasks, fds_each=fds / n, create_run_ms=create_ms, round_trip_ms=trip_ms,
        woken_p50_ms=p50_ms(woken) if woken else 0.0, woken_p95_ms=pct(woken, 95) if woken else 0.0,
        parked=parked, raw_run_ms=raw_ms, top=top, stopped=why,
    )  # fmt: skip


def report(empty: Step, steps: list[Step], args: argparse.Namespace) -> None:
    print()
    print(f"# density, {time.strftime('%Y-%m-%d %H:%M')} UTC, {os.cpu_count()} cores, park_after_secs "
          f"{args.park_after}, network {args.network}, at rest over {args.rest_secs:g} s")  # fmt: skip
    print("| Idle sandboxes | fill | host CPU at rest | their cgroups | sandboxd | load avg | MemAvailable drop "
          "per sandbox | cgroup memory | host tasks | sandboxd fds | create + first run p50 | raw runsc run p50 | "
          "run round trip p50 | first run after park p50 / p95 |")  # fmt: skip
    print("|" + "---|" * 14)
    for step in [empty, *steps]:
        ratio_create = step.create_run_ms / empty.create_run_ms if empty.create_run_ms else 0
        ratio_trip = step.round_trip_ms / empty.round_trip_ms if empty.round_trip_ms else 0
        print(
            f"| {step.count}{' (' + step.stopped + ')' if step.stopped else ''} | {step.fill_secs:.0f} s | "
            f"{step.host_busy_pct:.1f} % | {step.sandboxes_cpu_pct:.3f} % | {step.sandboxd_cpu_pct:.2f} % of a core | "
            f"{step.load} | {step.mem_drop_mib_each:.1f} MiB | {step.cgroup_mib_each:.1f} MiB | "
            f"{step.tasks_each:.1f} | {step.fds_each:.2f} | {step.create_run_ms:.0f} ms ({ratio_create:.2f}x) | "
            f"{step.raw_run_ms:.0f} ms ({step.raw_run_ms / empty.raw_run_ms if empty.raw_run_ms else 0:.2f}x) | "
            f"{step.round_trip_ms:.1f} ms ({ratio_trip:.2f}x) | "
            + (f"{step.woken_p50_ms:.1f} / {step.woken_p95_ms:.1f} ms |" if step.count else "- |")
        )  # fmt: skip
    print()
    for step in [empty, *steps]:
        print(f"CPU at rest with {step.count}, top processes: {step.top or 'none'}")


@contextmanager
def sigterm_as_interrupt() -> Any:
    def handler(signum: int, frame: object) -> None:
        raise Stop()

    previous = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--counts", default="100,500,1000", help="idle sandboxes at each step, ascending")
    parser.add_argument("--rest-secs", type=float, default=30.0, help="length of each at-rest measurement")
    parser.add_argument("--park-after", type=int, default=10, help="[parking] park_after_secs of the node")
    parser.add_argument("--samples", type=int, default=10, help="creates (and 5x runs) timed per step")
    parser.add_argument("--concurrency", type=int, default=4, help="creates at once while filling")
    parser.add_argument(
        "--min-available-mb", type=int, default=3072, help="stop a fill below this MemAvailable"
    )
    parser.add_argument(
        "--raise-pid-max", action="store_true", help=f"set kernel.pid_max to {INSTALLED_PID_MAX}"
    )
    parser.add_argument(
        "--network", choices=("none", "open"), default="none", help="the sandboxes' network mode"
    )
    parser.add_argument(
        "--wake-cycles", type=int, default=8, help="parks timed by the wake-up comparison (0: skip)"
    )
    args = parser.parse_args()
    counts = sorted(int(c) for c in args.counts.split(","))
    if args.raise_pid_max and int(Path("/proc/sys/kernel/pid_max").read_text()) < INSTALLED_PID_MAX:
        Path("/proc/sys/kernel/pid_max").write_text(str(INSTALLED_PID_MAX))
    config = (
        f"[capacity]\ncpu_overcommit = 1000\nmemory_overcommit = 100\ndisk_overcommit = 100\n"
        f"[limits]\nmax_idle_timeout_secs = 0\n[defaults]\nidle_timeout_secs = 0\n"
        f"[parking]\npark_after_secs = {args.park_after}\n"
        '[network]\nceiling = "open"\n'
    )
    print(f"MemAvailable {mem_available_kib() // 1024} MiB, kernel.pid_max "
          f"{Path('/proc/sys/kernel/pid_max').read_text().strip()}, load {load_average()}", flush=True)  # fmt: skip
    with sigterm_as_interrupt():
        if args.wake_cycles:
            wake_comparison(args.wake_cycles)
        with bench_node("sbx-density-", config) as (server, workdir):
            fill_node(server, RawRunsc(workdir / "raw", default_rootfs()), counts, args)


def wake_comparison(cycles: int, idle_secs: float = 6.0) -> None:
    """The first run after ``idle_secs`` without a request, on a node that parks (after 2 s) and on one that
    does not: what a wake-up adds, apart from the sandbox having been idle."""
    for park_after in (2, 0):
        with bench_node("sbx-wake-", f"[parking]\npark_after_secs = {park_after}\n") as (server, _):
            client = KeepAlive(server)
            try:
                sandbox_id = client.call("POST", "/v1/sandboxes", {})["id"]
                path = f"/v1/sandboxes/{sandbox_id}/run"
                client.call("POST", path, {"argv": ["true"]})
                firsts, nexts = [], []
                for _ in range(cycles):
                    time.sleep(idle_secs)
                    assert (FREEZER.state(sandbox_id) == "frozen") == (park_after > 0)
                    firsts.append(client.timed("POST", path, {"argv": ["true"]})[0])
                    nexts.append(client.timed("POST", path, {"argv": ["true"]})[0])
            finally:
                client.close()
        print(f"wake-up: parking {'on ' if park_after else 'off'}, first run after {idle_secs:g} s idle p50 "
              f"{pct(firsts, 50):.1f} ms (p95 {pct(firsts, 95):.1f}), the next {pct(nexts, 50):.1f} ms, "
              f"load {load_average()}", flush=True)  # fmt: skip


def fill_node(server: Sandboxd, raw: RawRunsc, counts: list[int], args: argparse.Namespace) -> None:
    """The empty node, then each fill step; everything made is torn down, on an interrupt too."""
    node = Node(server, args.concurrency, args.network)
    try:
        print("empty node", flush=True)
        baseline_kib = mem_available_kib()
        host, _, sandboxd, load, top = at_rest(node, args.rest_secs)
        create_ms, trip_ms = node.latencies(args.samples)
        empty = Step(
            count=0, fill_secs=0.0, host_busy_pct=host, sandboxes_cpu_pct=0.0, sandboxd_cpu_pct=sandboxd,
            load=load, mem_drop_mib_each=0.0, cgroup_mib_each=0.0, tasks_each=0.0, fds_each=0.0,
            create_run_ms=create_ms, round_trip_ms=trip_ms, woken_p50_ms=0.0, woken_p95_ms=0.0, parked=0,
            raw_run_ms=pct(raw.run_samples(args.samples), 50), top=top,
        )  # fmt: skip
        steps = []
        for count in counts:
            print(f"filling to {count}", flush=True)
            fill_secs, why = node.fill(count, args.min_available_mb)
            steps.append(measure(node, count, fill_secs, why, baseline_kib, args, raw))
            report(empty, steps, args)
            if why:
                print(f"stopped at {len(node.made)}: {why}", flush=True)
                break
        capacity = node.status().get("sandbox_capacity", {})
        print(f"sandbox_capacity: limited by {capacity.get('limited_by')} at {capacity.get('max_sandboxes')}")
    except (KeyboardInterrupt, Stop):
        print("interrupted: tearing everything down", flush=True)
    finally:
        node.teardown_all()


if __name__ == "__main__":
    main()

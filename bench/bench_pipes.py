"""What a pipe's capacity does to bulk data under gVisor, against the host in one run; and process output.

    sudo .venv/bin/python bench/bench_pipes.py [--rounds 5] [--mib 256]

Under gVisor a writer that fills a pipe blocks, and the reader's wakeup, its read and the writer's wakeup
are each a round trip between two tasks through the sentry, which costs about the same whatever the size
moved. So the pipe's capacity sets how much each round trip carries. Linux's default is 64 KiB; a program
may ask up to ``fs.pipe-max-size`` (1 MiB) with ``F_SETPIPE_SZ``, as sbx-agent does for the stdin, stdout
and stderr of every process it spawns.

Part 1, the pipe alone: a Python program forks a writer that writes ``--mib`` MiB in chunks of 8 KiB (what
``head``, ``cat`` and most C programs write) or 1 MiB, through a pipe of 64 KiB or 1 MiB, to a reader
reading 1 MiB at a time. On the host and in raw ``runsc run`` of the default image's root (systrap, 2 CPUs
of quota, sandboxd's flags), interleaved round by round. MiB/s, p50 and p95 over the rounds, and the
sandbox's p50 against the host's.

Part 2, a process's output through sandboxd: ``head -c`` (8 KiB writes) and ``dd bs=1M`` of ``--mib`` MiB
to a process's stdout (the agent's pipe, the agent protocol, the node's output log, whose cap drops the
rest), from the POST that starts it until its record says exited, against the same command writing to
/dev/null in the same sandbox. Needs root and scripts/install.sh's default image.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench"))

from bench_sandboxd import bench_node, default_rootfs
from bench_spawn import Runsc, raw_work
from sandboxd_harness import Sandboxd

PIPE = r"""
import fcntl, os, sys, time
capacity, chunk, total = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]) << 20
r, w = os.pipe()
fcntl.fcntl(w, 1031, capacity)  # F_SETPIPE_SZ
start = time.monotonic()
pid = os.fork()
if pid == 0:
    os.close(r)
    buf, sent = b"\0" * chunk, 0
    while sent < total:
        sent += os.write(w, buf)
    os._exit(0)
os.close(w)
while os.read(r, 1 << 20):
    pass
os.waitpid(pid, 0)
print(f"pipe {capacity} {chunk} {total / (time.monotonic() - start) / 2**20:.1f}")
"""
CASES = [(64 << 10, 8 << 10), (1 << 20, 8 << 10), (64 << 10, 1 << 20), (1 << 20, 1 << 20)]


def pipe_script(path: str, mib: int) -> str:
    return "; ".join(f"python3 {path} {capacity} {chunk} {mib}" for capacity, chunk in CASES)


def parse(output: str) -> dict[tuple[int, int], float]:
    found = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 4 and parts[0] == "pipe":
            found[(int(parts[1]), int(parts[2]))] = float(parts[3])
    if set(found) != set(CASES):
        raise RuntimeError(f"a pipe run failed: {output!r}")
    return found


def nearest_rank(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * len(ordered) + 0.5) - 1))]


def size(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def pipes(work: Path, rounds: int, mib: int) -> None:
    bin_dir = work / "bin"
    bin_dir.mkdir()
    (bin_dir / "pipe.py").write_text(PIPE)
    runsc = Runsc(work, default_rootfs(), bin_dir)
    results: dict[str, dict[tuple[int, int], list[float]]] = {
        "host": defaultdict(list),
        "sandbox": defaultdict(list),
    }
    print(f"# pipes, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, runsc {runsc.info.version}, {os.cpu_count()} cores, "
          f"load {os.getloadavg()[0]:.2f}, {mib} MiB x {rounds} rounds")  # fmt: skip
    for _ in range(rounds):
        host = os.popen(pipe_script(str(bin_dir / "pipe.py"), mib)).read()
        for case, rate in parse(host).items():
            results["host"][case].append(rate)
        for case, rate in parse(runsc.run("systrap", 2, pipe_script("/xb/pipe.py", mib))).items():
            results["sandbox"][case].append(rate)
    print(
        "\n| pipe | writes of | host MiB/s p50 | p95 (slowest) | sandbox MiB/s p50 | p95 (slowest) | sandbox / host |"
    )
    print("|---|---|---|---|---|---|---|")
    for case in CASES:
        h, s = results["host"][case], results["sandbox"][case]
        print(f"| {size(case[0])} | {size(case[1])} | {statistics.median(h):.0f} | {nearest_rank(h, 5):.0f} | "
              f"{statistics.median(s):.0f} | {nearest_rank(s, 5):.0f} | {statistics.median(s) / statistics.median(h):.2f}x |")  # fmt: skip


def timed(server: Sandboxd, box: str, command: str) -> float:
    """Seconds from the POST that starts ``command`` until its record says exited."""
    start = time.monotonic()
    resp = server.request("POST", f"/v1/sandboxes/{box}/processes", {"argv": ["sh", "-c", command]})
    pid = resp.json()["pid"]
    while server.request("GET", f"/v1/sandboxes/{box}/processes/{pid}").json()["state"] != "exited":
        time.sleep(0.01)
    return time.monotonic() - start


def output(rounds: int, mib: int) -> None:
    commands = {
        "head -c (8 KiB writes)": f"head -c {mib << 20} /dev/zero",
        "dd bs=1M": f"dd if=/dev/zero bs=1M count={mib} status=none",
    }
    with bench_node("sbx-bench-pipes-") as (server, _):
        box = server.create()["id"]
        print(
            f"\n# process output through sandboxd, load {os.getloadavg()[0]:.2f}, {mib} MiB x {rounds} rounds"
        )
        rates: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in commands}
        for _ in range(rounds):
            for name, command in commands.items():
                rates[name]["stdout"].append(mib / timed(server, box, command))
                rates[name]["null"].append(mib / timed(server, box, command + " > /dev/null"))
        print("\n| writer | to stdout MiB/s p50 | p95 (slowest) | to /dev/null MiB/s p50 | stdout / null |")
        print("|---|---|---|---|---|")
        for name in commands:
            out, null = rates[name]["stdout"], rates[name]["null"]
            print(f"| {name} | {statistics.median(out):.0f} | {nearest_rank(out, 5):.0f} | "
                  f"{statistics.median(null):.0f} | {statistics.median(out) / statistics.median(null):.2f}x |")  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--mib", type=int, default=256)
    args = parser.parse_args()
    with raw_work("sbx-bench-pipes-") as work:
        pipes(work, args.rounds, args.mib)
    output(args.rounds, args.mib)
    print(f"\nload at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""What one system call costs in a sandbox, by the form of its call site, against the host in one run.

    sudo .venv/bin/python bench/bench_syscalls.py [--rounds 5] [--calls 400000]

systrap (gVisor's platform here) handles a guest system call one of two ways. The first time a call site
runs, the call traps: a SIGSYS signal (syscall user dispatch, or seccomp on older runsc) delivered to
systrap's handler in the guest's stub process, which hands the call to the sentry. If the site is exactly
``mov $imm32, %eax; syscall`` (``b8 xx xx xx xx 0f 05``), systrap then rewrites those 7 bytes into a jump
to its trap table (``PatchSyscall``, pkg/sentry/platform/systrap/usertrap/usertrap_amd64.go), and from
then on the site reaches the sentry through shared memory, with no signal. Any other form traps every time.
glibc's ``read`` is ``xor %eax,%eax; syscall`` (the number 0 needs no 5-byte ``mov``), and so is every
call through ``syscall(2)`` (``mov %rdi,%rax``): these are never patched. ``write`` is ``mov $1,%eax;
syscall`` and is patched. ``dd bs=1`` alternates the two.

A static C loop makes ``--calls`` calls of each kind, and prints microseconds per call:

- ``patched``: ``getpid`` as ``mov $39,%eax; syscall``, the form systrap patches;
- ``unpatched``: the same ``getpid`` as ``movq $39,%rax; syscall`` (``48 c7 c0 ...``), which it does not;
- ``read``: glibc's ``read`` of one byte from /dev/zero (unpatched, as above);
- ``write``: glibc's ``write`` of one byte to /dev/null (patched);
- ``dd``: the image's ``dd if=/dev/zero of=/dev/null bs=1``, per system call (a read and a write a byte);
- ``signal``: a signal sent to itself and handled (``tgkill`` + the handler's return). On the host this is
  the price of the signal an unpatched call takes in the sandbox; in the sandbox the sentry emulates it.

Environments, interleaved round by round: the host (the same static binary; the host's dd, Debian 12's as
in the image), and raw ``runsc run`` of the default image's root with sandboxd's flags on systrap with 2
CPUs of quota (sandboxd's default ``cpus``). Prints p50 and p95 over the rounds and the ratio to the host
at p50. Needs root, gcc and scripts/install.sh's default image.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from collections import defaultdict
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench"))

from bench_sandboxd import default_rootfs, pct
from bench_spawn import Runsc, raw_work

LOOP = r"""
#include <fcntl.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

/* getpid in the form systrap patches: b8 27 00 00 00 0f 05. */
static inline long patched(void) {
    long r;
    __asm__ volatile("mov $39, %%eax\n\tsyscall" : "=a"(r) : : "rcx", "r11", "memory");
    return r;
}
/* The same call, but the number loaded by a 7-byte movq (48 c7 c0 27 00 00 00): never patched. */
static inline long unpatched(void) {
    long r;
    __asm__ volatile("movq $39, %%rax\n\tsyscall" : "=a"(r) : : "rcx", "r11", "memory");
    return r;
}
static void handler(int s) { (void)s; }
static double now(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1e6 + t.tv_nsec / 1e3;
}
int main(int argc, char **argv) {
    const char *kind = argv[1];
    long n = atol(argv[2]);
    char byte = 0;
    int zero = open("/dev/zero", O_RDONLY), null = open("/dev/null", O_WRONLY);
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = handler;
    sigaction(SIGUSR1, &sa, NULL);
    pid_t self = getpid();
    double start = now();
    for (long i = 0; i < n; i++) {
        if (!strcmp(kind, "patched")) patched();
        else if (!strcmp(kind, "unpatched")) unpatched();
        else if (!strcmp(kind, "read")) { if (read(zero, &byte, 1) != 1) return 1; }
        else if (!strcmp(kind, "write")) { if (write(null, &byte, 1) != 1) return 1; }
        else if (!strcmp(kind, "signal")) syscall(SYS_tgkill, self, self, SIGUSR1);
        else return 2;
    }
    printf("%s %.4f\n", kind, (now() - start) / n);
    return 0;
}
"""
KINDS = ("patched", "unpatched", "read", "write", "dd", "signal")


def build(directory: Path) -> None:
    """The static loop in ``directory`` (mounted at /xb in sandboxes); checks the two getpid forms."""
    (directory / "loop.c").write_text(LOOP)
    subprocess.run(["gcc", "-O2", "-static", "-o", "loop", "loop.c"], cwd=directory, check=True)
    code = subprocess.run(
        ["objdump", "-d", "loop"], cwd=directory, capture_output=True, text=True, check=True
    ).stdout
    # The compiler must have kept both forms as written, or the two kinds would measure the same thing.
    if "b8 27 00 00 00" not in code or "48 c7 c0 27 00 00 00" not in code:
        raise RuntimeError("gcc did not emit the two getpid forms the benchmark compares")


def script(bin_dir: str, calls: int) -> str:
    """Prints "<kind> <us per call>" for each kind."""
    loops = "; ".join(f"{bin_dir}/loop {k} {calls}" for k in KINDS if k != "dd")
    # dd makes two calls a byte (a read and a write), so the byte count is half the calls.
    return (
        f"{loops}; s=$(date +%s%N); dd if=/dev/zero of=/dev/null bs=1 count={calls // 2} 2>/dev/null; "
        f'e=$(date +%s%N); echo dd $(awk "BEGIN {{print ($e - $s) / 1e3 / {calls}}}")'
    )


def parse(output: str) -> dict[str, float]:
    found = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in KINDS:
            found[parts[0]] = float(parts[1])
    if set(found) != set(KINDS):
        raise RuntimeError(f"a system call loop failed: {output!r}")
    return found


def nearest_rank(values: list[float], q: float) -> float:
    """The q-th percentile by nearest rank, in the values' own unit (``pct`` scales seconds to ms)."""
    return pct(values, q) / 1000


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--calls", type=int, default=400_000)
    args = parser.parse_args()
    with raw_work("sbx-bench-syscalls-") as work:
        bin_dir = work / "bin"
        bin_dir.mkdir()
        build(bin_dir)
        runsc = Runsc(work, default_rootfs(), bin_dir)
        results: dict[str, dict[str, list[float]]] = {"host": defaultdict(list), "sandbox": defaultdict(list)}
        print(f"# system calls, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, runsc {runsc.info.version}, "
              f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, {args.calls} calls x {args.rounds} rounds")  # fmt: skip
        for _ in range(args.rounds):
            host = subprocess.run(["sh", "-c", script(str(bin_dir), args.calls)],
                                  capture_output=True, text=True, check=True).stdout  # fmt: skip
            for kind, us in parse(host).items():
                results["host"][kind].append(us)
            for kind, us in parse(runsc.run("systrap", 2, script("/xb", args.calls))).items():
                results["sandbox"][kind].append(us)
        print(
            "\n| us per call | host p50 | host p95 | sandbox p50 | sandbox p95 | ratio p50 |\n|---|---|---|---|---|---|"
        )
        for kind in KINDS:
            h, s = results["host"][kind], results["sandbox"][kind]
            ratio = statistics.median(s) / statistics.median(h)
            print(f"| {kind} | {nearest_rank(h, 50):.3f} | {nearest_rank(h, 95):.3f} | "
                  f"{nearest_rank(s, 50):.3f} | {nearest_rank(s, 95):.3f} | {ratio:.1f}x |")  # fmt: skip
        print(f"\nload at end {os.getloadavg()[0]:.2f}")


if __name__ == "__main__":
    main()

"""Where a process creation goes in a sandbox: fork+exec under gVisor against the host, measured in one run.

    sudo .venv/bin/python bench/bench_spawn.py [--rounds 5] [--spawns 200] [--no-phases]

Three programs are spawned ``--spawns`` times each by a static C loop (``posix_spawn`` + ``waitpid``, which
is vfork + exec as the sandbox agent spawns), and a shell loop forks and execs ``/bin/true`` (what a
script or ``make`` does):

- ``tiny``: a static program without libc (one page of code; it only exits): the cost of a new address space,
  an exec and an exit, nothing else;
- ``static``: ``int main(){return 0;}`` linked statically with glibc (760 KB): adds libc's start-up;
- ``dynamic``: the image's ``/bin/true`` (coreutils, dynamically linked): adds the loader, libc.so and its
  relocations, what nearly every program pays;
- ``shell``: ``sh -c 'while ...; do /bin/true; done'``: dash forks (a copy of its address space) then execs.

Environments, interleaved round by round: the host (the same binaries, the host's /bin/true and sh, which
are Debian 12's as in the default image), and raw ``runsc run`` of the default image's root (read-only,
the test binaries bind-mounted) with sandboxd's flags on systrap with 1 and 2 CPUs of quota and on ptrace
with 2. Each environment prints milliseconds per spawn (p50 of the rounds).

Then, unless ``--no-phases``, one more systrap run with runsc's ``--strace --debug`` log splits a ``static``
spawn into its phases from the log's timestamps (the log itself slows every step, so read the shares, not the
milliseconds): the ``execve`` call, from its return to the new program's first system call (the switch to a
new address space and the first page faults), the program's own run (its system calls, and systrap patching
each new system call site of the program into a jump to its trap table: a copy-on-write of the code page
each time), and from ``exit_group`` to the parent's ``wait4`` return (tearing the address space down). Needs
root, gcc and scripts/install.sh's default image.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import default_rootfs

from sbx.backends.runsc import DEFAULT_RUNSC, inspect_runsc, release_roots_under

SPAWN_LOOP = r"""
#include <spawn.h>
#include <stdio.h>
#include <stdlib.h>
#include <sys/wait.h>
#include <time.h>
extern char **environ;
int main(int argc, char **argv) {
    int n = atoi(argv[2]);
    struct timespec a, b;
    clock_gettime(CLOCK_MONOTONIC, &a);
    for (int i = 0; i < n; i++) {
        pid_t pid;
        char *av[] = {argv[1], NULL};
        int status;
        if (posix_spawn(&pid, argv[1], NULL, NULL, av, environ) != 0 || waitpid(pid, &status, 0) != pid)
            return 1;
    }
    clock_gettime(CLOCK_MONOTONIC, &b);
    printf("%.4f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / 1e6 / n);
    return 0;
}
"""
TINY = ".globl _start\n_start:\n mov $60, %eax\n xor %edi, %edi\n syscall\n"
STATIC = "int main(void) { return 0; }\n"
KINDS = ("tiny", "static", "dynamic", "shell")


def build(directory: Path) -> None:
    """The spawn loop and the two test programs, static, in ``directory`` (mounted at /xb in sandboxes)."""
    (directory / "loop.c").write_text(SPAWN_LOOP)
    (directory / "tiny.s").write_text(TINY)
    (directory / "static.c").write_text(STATIC)
    for argv in (["gcc", "-O2", "-static", "-o", "loop", "loop.c"], ["gcc", "-nostdlib", "-static", "-o", "tiny", "tiny.s"],
                 ["gcc", "-O2", "-static", "-o", "static", "static.c"]):  # fmt: skip
        subprocess.run(argv, cwd=directory, check=True)


def script(bin_dir: str, spawns: int) -> str:
    """Prints "<kind> <ms per spawn>" for each kind."""
    shell_loop = f"i=0; while [ $i -lt {spawns} ]; do /bin/true; i=$((i+1)); done"
    return (
        f"for k in tiny static; do echo $k $({bin_dir}/loop {bin_dir}/$k {spawns}); done; "
        f"echo dynamic $({bin_dir}/loop /bin/true {spawns}); "
        f"s=$(date +%s%N); sh -c '{shell_loop}'; e=$(date +%s%N); "
        f'echo shell $(awk "BEGIN {{print ($e - $s) / 1e6 / {spawns}}}")'
    )


def parse(output: str) -> dict[str, float]:
    found = {}
    for line in output.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] in KINDS:
            found[parts[0]] = float(parts[1])
    if set(found) != set(KINDS):
        raise RuntimeError(f"a spawn loop failed: {output!r}")
    return found


@contextmanager
def raw_work(prefix: str) -> Iterator[Path]:
    """A work directory under /var/tmp for :class:`Runsc`; on leaving, the runsc roots under it released, the
    directory removed and the benchmarks' parent cgroup (``sbx-bench-spawn``) removed from every controller."""
    work = Path(tempfile.mkdtemp(prefix=prefix, dir="/var/tmp"))
    try:
        yield work
    finally:
        release_roots_under(work)
        shutil.rmtree(work, ignore_errors=True)
        for controller in Path("/sys/fs/cgroup").iterdir():
            group = controller / "sbx-bench-spawn"
            if group.is_dir():
                group.rmdir()


class Runsc:
    """Raw runsc on the default image's root, read-only, with the test programs at /xb."""

    def __init__(self, work: Path, image_root: Path, bin_dir: Path) -> None:
        self.work = work
        self.image_root = image_root
        self.bin_dir = bin_dir
        self.info = inspect_runsc(os.environ.get("SBX_RUNSC", DEFAULT_RUNSC))
        self.counter = 0

    def run(self, platform: str, cpus: int, command: str, extra: tuple[str, ...] = ()) -> str:
        self.counter += 1
        name = f"spawn-{os.getpid()}-{self.counter}"
        bundle = self.work / name
        bundle.mkdir()
        spec = {
            "ociVersion": "1.0.0",
            "process": {"user": {"uid": 1000, "gid": 1000}, "args": ["/bin/sh", "-c", command], "cwd": "/",
                        "env": ["PATH=/usr/local/bin:/usr/bin:/bin"]},
            "root": {"path": str(self.image_root), "readonly": True},
            "hostname": "spawn",
            "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"},
                       {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs"},
                       {"destination": "/xb", "type": "bind", "source": str(self.bin_dir), "options": ["rbind", "ro"]}],
            "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                      "cgroupsPath": f"/sbx-bench-spawn/{name}",
                      "resources": {"memory": {"limit": 512 << 20}, "cpu": {"quota": cpus * 100000, "period": 100000}}},
        }  # fmt: skip
        (bundle / "config.json").write_text(json.dumps(spec))
        argv = [self.info.path, "--root", str(self.work / "state"), *self.info.start_flags(platform), "--network=none",
                "--cpu-num-from-quota", *extra, "run", "--bundle", str(bundle), name]  # fmt: skip
        try:
            done = subprocess.run(argv, capture_output=True, text=True, check=False, stdin=subprocess.DEVNULL)
        finally:
            subprocess.run([self.info.path, "--root", str(self.work / "state"), "delete", "-force", name],
                           capture_output=True, check=False)  # fmt: skip
            shutil.rmtree(bundle, ignore_errors=True)
            for controller in Path("/sys/fs/cgroup").iterdir():
                leftover = controller / "sbx-bench-spawn" / name
                if leftover.is_dir():
                    leftover.rmdir()
        if done.returncode != 0:
            raise RuntimeError(f"runsc failed: {done.stderr[-800:]}")
        return done.stdout


_LINE = re.compile(r"^[IDWE](\d{4}) (\d\d):(\d\d):(\d\d\.\d+)\s+\d+ \S+\] \[\s*(\d+):\s*(\d+)\] (\S+) (.*)$")


def phases(log_text: str) -> dict[str, float]:
    """Mean milliseconds per ``static`` spawn for each phase, and patches per spawn, from runsc's strace log."""

    def secs(m: re.Match[str]) -> float:
        return int(m.group(2)) * 3600 + int(m.group(3)) * 60 + float(m.group(4))

    samples: dict[str, list[float]] = defaultdict(list)
    exec_start: dict[str, float] = {}
    exec_done: dict[str, float] = {}
    first_call: dict[str, float] = {}
    exited: dict[str, float] = {}
    patches: dict[str, int] = defaultdict(int)
    for line in log_text.splitlines():
        m = _LINE.match(line)
        if m is None:
            continue
        tid, comm, rest, t = m.group(6), m.group(7), m.group(8), secs(m)
        if rest.startswith("E execve(") and "/xb/static" in rest:
            exec_start[tid] = t
        elif rest.startswith("X execve(") and tid in exec_start and "/xb/static" in rest:
            exec_done[tid] = t
        elif comm == "static" and rest.startswith("E ") and tid in exec_done and tid not in first_call:
            first_call[tid] = t
        elif "Apply the binary patch" in line and tid in exec_done:  # a debug line: no program name in it
            patches[tid] += 1
        elif comm == "static" and rest.startswith("E exit_group("):
            exited[tid] = t
        elif rest.startswith("X wait4(") and "static" not in comm:
            child = re.search(r"= (\d+) \(", rest)
            key = child.group(1) if child else ""
            if key in exited and key in first_call:
                samples["execve"].append(exec_done[key] - exec_start[key])
                samples["to first syscall"].append(first_call[key] - exec_done[key])
                samples["program (its syscalls, patches, faults)"].append(exited[key] - first_call[key])
                samples["exit to wait4 return"].append(t - exited[key])
                samples["patches"].append(patches[key])
                for table in (exec_start, exec_done, first_call, exited, patches):
                    table.pop(key, None)
    if not samples:
        raise RuntimeError("no static spawn found in runsc's strace log")
    return {k: statistics.mean(v) * (1 if k == "patches" else 1000) for k, v in samples.items()}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--spawns", type=int, default=200)
    parser.add_argument("--no-phases", action="store_true")
    args = parser.parse_args()
    with raw_work("sbx-bench-spawn-") as work:
        bin_dir = work / "bin"
        bin_dir.mkdir()
        build(bin_dir)
        runsc = Runsc(work, default_rootfs(), bin_dir)
        envs = {"host": None, "systrap, 1 CPU": ("systrap", 1), "systrap, 2 CPUs": ("systrap", 2),
                "ptrace, 2 CPUs": ("ptrace", 2)}  # fmt: skip
        results: dict[str, dict[str, list[float]]] = {e: defaultdict(list) for e in envs}
        print(f"# fork+exec, {datetime.now(UTC):%Y-%m-%d %H:%M} UTC, runsc {runsc.info.version}, "
              f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, {args.spawns} spawns x {args.rounds} rounds")  # fmt: skip
        for _ in range(args.rounds):
            for env, where in envs.items():
                if where is None:
                    out = subprocess.run(["sh", "-c", script(str(bin_dir), args.spawns)],
                                         capture_output=True, text=True, check=True).stdout  # fmt: skip
                else:
                    out = runsc.run(where[0], where[1], script("/xb", args.spawns))
                for kind, ms in parse(out).items():
                    results[env][kind].append(ms)
        host = {k: statistics.median(v) for k, v in results["host"].items()}
        print(f"\n| ms per spawn (p50) | {' | '.join(envs)} |\n|---|" + "---|" * len(envs))
        for kind in KINDS:
            cells = []
            for env in envs:
                value = statistics.median(results[env][kind])
                cells.append(f"{value:.2f}" + ("" if env == "host" else f" ({value / host[kind]:.1f}x)"))
            print(f"| {kind} | {' | '.join(cells)} |")
        print(f"\nload at end {os.getloadavg()[0]:.2f}")
        if not args.no_phases:
            logs = work / "log"
            logs.mkdir()
            runsc.run("systrap", 2, f"/xb/loop /xb/static 20 > /dev/null; /xb/loop /xb/static {min(args.spawns, 50)}",
                      ("--debug", f"--debug-log={logs}/", "--strace"))  # fmt: skip
            boot = next(logs.glob("*boot*"))
            split = phases(boot.read_text(errors="replace"))
            print(
                "\nOne `static` spawn on systrap, 2 CPUs, from runsc's --strace --debug log (slowed by it):\n"
            )
            print("| phase | ms (mean) |\n|---|---|")
            for name, value in split.items():
                print(
                    f"| {name} | {value:.2f} |"
                    if name != "patches"
                    else f"| system call sites patched | {value:.1f} |"
                )


if __name__ == "__main__":
    main()

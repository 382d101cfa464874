"""Benchmark real work inside a sandbox against the same work on the host, measured in one run.

    .venv/bin/python bench/bench_guest.py [--rounds 5] [--platforms systrap,ptrace] [--cpus 1,2]

The same script, with the same programs (the default image's: its bash, python3, pip, git, gcc), runs
(a) on the host, in a chroot of an overlay of the default image's root (the host's kernel, no gVisor), and
(b) in sandboxes of a sandboxd per platform, one per ``--cpus`` value. Rounds alternate between them, so load
from elsewhere weighs on every side alike. Workloads, each timed inside (``date +%s%N`` around it):

- syscalls: ``dd bs=1 count=200000`` (400,000 one-byte reads and writes);
- python: ``python3 -c pass`` (interpreter start-up);
- pip: ``pip install --no-index`` of 10 local pure-Python wheels (pytest, pygments, click, ...) into a new
  target directory;
- git clone: ``git clone`` of a local repository of 5,000 files in 50 directories;
- gcc: ``make -j2`` of a C project of 40 files (about 100 lines each) from clean.

Prints p50/p95 per side and the ratio of each sandbox to the host at p50. Needs root (chroot, sandboxd) and
scripts/install.sh's default image; the wheels come from PyPI (pip download) once per run. Results go in
docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import defaultdict
from contextlib import ExitStack
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import bench_node, default_rootfs, pct
from sandboxd_harness import Sandboxd

WORKLOADS = ("syscalls", "python", "pip", "git clone", "gcc")
WHEELS = ("pytest", "pygments", "click", "iniconfig", "pluggy", "packaging", "idna", "attrs", "prometheus-client",
          "dnslib")  # fmt: skip
HOME = "/sandbox/home"

# One round: every workload once, each line "<name>\t<microseconds>". Runs as the sandbox user in HOME/bench.
ROUND = r"""
set -u
cd "$HOME/bench"
t() { local name=$1; shift; local s e; s=$(date +%s%N); if "$@" >/dev/null 2>&1; then e=$(date +%s%N);
      printf '%s\t%s\n' "$name" $(( (e - s) / 1000 )); else printf '%s\tFAIL\n' "$name"; fi; }
n=$(date +%s%N)
t syscalls dd if=/dev/zero of=/dev/null bs=1 count=200000
t python python3 -c pass
t pip python3 -m pip install -q --no-index --find-links wheels --target "pip-$n" WHEEL_NAMES
t "git clone" git clone -q repo "clone-$n"
t gcc sh -c 'make -s -C cproj clean && make -s -j2 -C cproj'
rm -rf "pip-$n" "clone-$n"
"""


def make_git_repo(repo: Path) -> None:
    """A git repository of 5,000 small text files in 50 directories, one commit (what the clone workloads
    clone)."""
    for i in range(5000):
        path = repo / f"dir{i % 50:02d}" / f"file{i:04d}.txt"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(f"line {i}\n" * (i % 40 + 1))
    git = ["git", "-C", str(repo), "-c", "user.name=bench", "-c", "user.email=bench@example.invalid"]
    subprocess.run([*git, "init", "-q"], check=True)
    subprocess.run([*git, "add", "."], check=True)
    subprocess.run([*git, "commit", "-q", "-m", "5,000 files"], check=True)


def make_inputs(directory: Path, only: list[str]) -> None:
    """The inputs every side gets: wheels, a git repository of 5,000 files, a C project, and the round's
    script running the workloads in ``only``."""
    wheels = directory / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
                    "-d", str(wheels), *WHEELS], check=True)  # fmt: skip
    make_git_repo(directory / "repo")
    cproj = directory / "cproj"
    cproj.mkdir()
    for i in range(40):
        body = "\n".join(
            f"int f{i}_{j}(int x) {{ int s = 0; for (int k = 0; k < x; k++) s += (k * {j + 1}) ^ {i}; return s; }}"
            for j in range(100)
        )
        (cproj / f"m{i}.c").write_text(f"#include <stdio.h>\n{body}\n")
    (cproj / "main.c").write_text("int main(void) { return 0; }\n")
    objs = " ".join(f"m{i}.o" for i in range(40))
    (cproj / "Makefile").write_text(
        f"all: prog\nprog: main.o {objs}\n\tcc -o $@ $^\n%.o: %.c\n\tcc -O2 -c -o $@ $<\n"
        "clean:\n\trm -f prog *.o\n"
    )
    lines = [line for line in ROUND.splitlines() if not line.startswith("t ") or line.split(" ", 2)[1].strip('"') in
             {w.split()[0] for w in only}]  # fmt: skip
    (directory / "round.sh").write_text("\n".join(lines).replace("WHEEL_NAMES", " ".join(WHEELS)) + "\n")


def tar_of(directory: Path) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(directory, arcname="bench")
    return buffer.getvalue()


def parse(output: str, into: dict[str, list[float]]) -> None:
    for line in output.splitlines():
        name, _, micros = line.partition("\t")
        if name in WORKLOADS:
            if micros == "FAIL":
                raise RuntimeError(f"{name} failed:\n{output}")
            into[name].append(int(micros) / 1e6)


class HostSide:
    """The default image's root as a chroot on the host: an overlay (writable upper in ``workdir``), /proc,
    /dev and /tmp mounted in a private mount namespace of each round's shell."""

    def __init__(self, workdir: Path, image_root: Path, inputs: bytes) -> None:
        self.root = workdir / "root"
        for name in ("upper", "work", "root"):
            (workdir / name).mkdir()
        subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                        f"lowerdir={image_root},upperdir={workdir / 'upper'},workdir={workdir / 'work'}",
                        str(self.root)], check=True)  # fmt: skip
        with tarfile.open(fileobj=io.BytesIO(inputs)) as tar:
            tar.extractall(self.root / HOME.lstrip("/"), filter="fully_trusted")
        subprocess.run(["chown", "-R", "1000:1000", str(self.root / HOME.lstrip("/") / "bench")], check=True)

    def round(self) -> str:
        script = (
            f"mount -t proc proc {self.root}/proc && mount --rbind /dev {self.root}/dev && "
            f"mount -t tmpfs tmpfs {self.root}/tmp && "
            f"exec chroot --userspec=1000:1000 {self.root} /usr/bin/env -i HOME={HOME} PATH=/usr/bin:/bin "
            f"LANG=C.UTF-8 bash {HOME}/bench/round.sh"
        )
        done = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script],
                              capture_output=True, text=True, check=True)  # fmt: skip
        return done.stdout

    def close(self) -> None:
        subprocess.run(["umount", "-l", str(self.root)], check=False)


class SandboxSide:
    """One sandbox of ``server`` with ``cpus`` holding the inputs in HOME/bench."""

    def __init__(self, server: Sandboxd, cpus: int, inputs: bytes) -> None:
        self.server = server
        self.id = server.create(cpus=cpus, memory_mb=2048, disk_mb=4096)["id"]
        put = server.request("PUT", f"/v1/sandboxes/{self.id}/files?path={HOME}/bench.tar", body=inputs)
        assert put.status == 204, put.body
        unpacked = server.run(self.id, ["tar", "-xf", f"{HOME}/bench.tar", "-C", HOME])
        assert unpacked["exit_code"] == 0, unpacked

    def round(self) -> str:
        resp = self.server.request(
            "POST", f"/v1/sandboxes/{self.id}/run",
            {"argv": ["bash", f"{HOME}/bench/round.sh"], "timeout_secs": 600}, timeout=700,
        )  # fmt: skip
        assert resp.status == 200, resp.body
        return base64.b64decode(resp.json()["stdout"]).decode()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--platforms", default="systrap,ptrace")
    parser.add_argument("--cpus", default="1,2")
    parser.add_argument("--only", default="", help=f"comma-separated subset of: {', '.join(WORKLOADS)}")
    args = parser.parse_args()
    only = [w for w in args.only.split(",") if w] or list(WORKLOADS)
    platforms = args.platforms.split(",")
    cpus_list = [int(c) for c in args.cpus.split(",")]
    work = Path(tempfile.mkdtemp(prefix="sbx-bench-guest-", dir="/var/tmp"))
    with ExitStack() as stack:
        stack.callback(shutil.rmtree, work, True)
        make_inputs(work / "inputs", only)
        inputs = tar_of(work / "inputs")
        (work / "host").mkdir()
        host = HostSide(work / "host", default_rootfs(), inputs)
        stack.callback(host.close)
        sides: dict[str, HostSide | SandboxSide] = {"host": host}
        for platform in platforms:
            server, _ = stack.enter_context(
                bench_node(f"sbx-bench-{platform}-", f'[gvisor]\nplatform = "{platform}"\n')
            )
            for cpus in cpus_list:
                sides[f"{platform}, cpus {cpus}"] = SandboxSide(server, cpus, inputs)
        results: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in sides}
        print(
            f"# guest workloads vs host, {time.strftime('%Y-%m-%d %H:%M')} UTC, {args.rounds} rounds",
            flush=True,
        )
        for _ in range(args.rounds + 1):  # the first round warms caches and is not counted
            for name, side in sides.items():
                parse(side.round(), results[name])
        for workload in only:
            base = results["host"][workload][1:]
            for name in sides:
                samples = results[name][workload][1:]
                ratio = "" if name == "host" else f"   {pct(samples, 50) / pct(base, 50):7.1f}x host"
                print(
                    f"{workload:<10} {name:<18} p50 {pct(samples, 50):9.1f} ms   p95 {pct(samples, 95):9.1f} ms{ratio}"
                )
        print(json.dumps({n: {w: v[1:] for w, v in r.items()} for n, r in results.items()}), file=sys.stderr)


if __name__ == "__main__":
    main()

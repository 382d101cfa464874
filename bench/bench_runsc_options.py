"""Measure runsc's options on this host, raw (no sandboxd): what docs/backends.md chose and why.

    .venv/bin/python bench/bench_runsc_options.py [--rounds 10] [--variants name,...] [--small-root DIR]

Each variant boots the default image's root the way sandboxd does (an overlay whose upper is an ext4 image
of its own, 1 core of CPU quota) with some runsc flags, and runs one script that times, inside the sandbox
(``date +%s%N``): 400,000 one-byte syscalls (dd), ``find /usr``, reading the Python standard library,
writing 2,000 small files, 100 fork+exec of /bin/true. The boot (``runsc run`` until that script starts) is
timed from outside. Rounds alternate between variants. Variants:

- ``systrap``: sandboxd's arrangement before the EROFS /usr (``--platform=systrap --overlay2=none``, directfs on);
- ``ptrace``: the same on ptrace;
- ``no-directfs``: systrap with ``--directfs=false`` (the gofer opens every file);
- ``self-overlay``: systrap with runsc's default ``--overlay2=root:self`` (guest writes go to a file store of
  runsc's own in the root, not to the sandbox's layer: what sandboxd must avoid);
- ``erofs``: the root as an EROFS image read by the sentry itself (no gofer for the root), writes in an
  overlay in memory (needs mkfs.erofs, from erofs-utils; skipped without it);
- ``erofs-usr``: what sandboxd uses now: ``systrap`` with the image's /usr mounted read-only from an EROFS
  image of it (backends/usr_erofs.py; needs mkfs.erofs);
- ``one-cpu``: systrap with a cpuset of one CPU, so the guest sees 1 CPU (what ``cpus: 1`` would need);
- ``small-root``: systrap on ``--small-root`` (e.g. a debootstrap minbase root), for boot time against the
  default image's size.

Prints p50/p95 per variant and workload and the ratio to ``systrap`` at p50.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))

from bench_sandboxd import default_rootfs, pct

from sbx.backends.runsc import DEFAULT_RUNSC, inspect_runsc, release_roots_under

#: The runsc measured: the one sandboxd runs, or SBX_RUNSC.
RUNSC = os.environ.get("SBX_RUNSC", DEFAULT_RUNSC)

SCRIPT = r"""
t() { s=$(date +%s%N); "$@" >/dev/null 2>&1; e=$(date +%s%N); printf '%s %s\n' "$name" $(( (e - s) / 1000 )); }
name=syscalls t dd if=/dev/zero of=/dev/null bs=1 count=200000
name=find t find /usr
name=read t sh -c 'cat /usr/lib/python3*/*.py /usr/lib/python3*/*/*.py'
name=write t sh -c 'mkdir /w && cd /w && i=0; while [ $i -lt 2000 ]; do echo $i > f$i; i=$((i+1)); done'
name=spawn t sh -c 'i=0; while [ $i -lt 100 ]; do /bin/true; i=$((i+1)); done'
"""
WORKLOADS = ("boot", "syscalls", "find", "read", "write", "spawn")


@dataclass
class Variant:
    flags: list[str]
    root: str = "image"  # image | small | erofs
    annotations: dict[str, str] = field(default_factory=dict)
    mounts: list[dict[str, object]] = field(default_factory=list)
    cpuset: str | None = None
    #: After ``runsc create``, widen the sandbox's cpuset to every CPU again: the guest keeps the CPU count
    #: runsc read at creation, its threads may run anywhere.
    widen: bool = False


def variants(erofs_image: Path | None, usr_image: Path | None = None) -> dict[str, Variant]:
    overlay = ["--overlay2=none"] if "overlay2" in inspect_runsc(RUNSC).flags else []
    found = {
        "systrap": Variant(["--platform=systrap", *overlay]),
        "ptrace": Variant(["--platform=ptrace", *overlay]),
        "no-directfs": Variant(["--platform=systrap", *overlay, "--directfs=false"]),
        "self-overlay": Variant(["--platform=systrap", "--overlay2=root:self"]),
        "one-cpu": Variant(["--platform=systrap", *overlay], cpuset="0"),
        "one-cpu-wide": Variant(["--platform=systrap", *overlay], cpuset="0", widen=True),
        "small-root": Variant(["--platform=systrap", *overlay], root="small"),
    }
    if erofs_image is not None:
        found["erofs"] = Variant(["--platform=systrap"], root="erofs", annotations={
            "dev.gvisor.spec.rootfs.source": str(erofs_image), "dev.gvisor.spec.rootfs.type": "erofs",
            "dev.gvisor.spec.rootfs.overlay": "memory"})  # fmt: skip
    if usr_image is not None:
        found["erofs-usr"] = Variant(["--platform=systrap", *overlay], mounts=[
            {"destination": "/usr", "type": "erofs", "source": str(usr_image), "options": ["ro"]}])  # fmt: skip
    return found


def sh(*argv: str) -> None:
    subprocess.run(argv, check=True, capture_output=True)


class Runner:
    def __init__(self, work: Path, image_root: Path, small_root: Path | None) -> None:
        self.work = work
        self.image_root = image_root
        self.small_root = small_root
        self.runsc_root = work / "runsc-root"
        self.counter = 0

    def run(self, variant: Variant) -> dict[str, float]:
        """Boot ``variant`` once, run SCRIPT, tear down; seconds per workload."""
        self.counter += 1
        d = self.work / f"v{self.counter}"
        (d / "bundle").mkdir(parents=True)
        (d / "rootfs").mkdir()
        mounted = []
        try:
            if variant.root != "erofs":
                lower = self.image_root if variant.root == "image" else self.small_root
                assert lower is not None
                (d / "disk").mkdir()
                sh("truncate", "-s", "1G", str(d / "disk.img"))
                sh("mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", str(d / "disk.img"))
                sh("mount", "-o", "loop,nodev,nosuid", str(d / "disk.img"), str(d / "disk"))
                mounted.append(d / "disk")
                (d / "disk" / "upper").mkdir()
                (d / "disk" / "work").mkdir()
                sh("mount", "-t", "overlay", "overlay", "-o",
                   f"lowerdir={lower},upperdir={d}/disk/upper,workdir={d}/disk/work,nodev,nosuid", str(d / "rootfs"))  # fmt: skip
                mounted.append(d / "rootfs")
            resources: dict[str, object] = {
                "memory": {"limit": 1 << 30},
                "cpu": {"quota": 100000, "period": 100000},
            }
            if variant.cpuset is not None:
                resources["cpu"] = {"quota": 100000, "period": 100000, "cpus": variant.cpuset}
            spec = {
                "ociVersion": "1.0.0",
                "process": {"user": {"uid": 0, "gid": 0}, "args": ["/bin/sh", "-c", SCRIPT], "cwd": "/",
                            "env": ["PATH=/usr/bin:/bin"],
                            "capabilities": {k: ["CAP_DAC_OVERRIDE"] for k in ("bounding", "effective", "permitted")}},
                "root": {"path": str(d / "rootfs"), "readonly": False},
                "hostname": "bench", "annotations": variant.annotations,
                "mounts": [{"destination": "/proc", "type": "proc", "source": "proc"}, *variant.mounts],
                "linux": {"namespaces": [{"type": t} for t in ("pid", "network", "ipc", "uts", "mount")],
                          "cgroupsPath": f"/sbx-bench-options/v{self.counter}", "resources": resources},
            }  # fmt: skip
            (d / "bundle" / "config.json").write_text(json.dumps(spec))
            started = time.monotonic()
            if variant.widen:
                done = self._create_widen_start(variant, d)
            else:
                done = subprocess.run(
                    [RUNSC, "--root", str(self.runsc_root), "--network=none", *variant.flags, "run",
                     "--bundle", str(d / "bundle"), f"v{self.counter}"],
                    capture_output=True, text=True, check=False,
                )  # fmt: skip
            total = time.monotonic() - started
            if done.returncode != 0:
                raise RuntimeError(f"runsc failed ({variant.flags}): {done.stderr[-800:]}")
            times = {name: int(us) / 1e6 for name, us in (line.split() for line in done.stdout.splitlines())}
            times["boot"] = total - sum(times.values())
            return times
        finally:
            subprocess.run([RUNSC, "--root", str(self.runsc_root), "delete", "-force", f"v{self.counter}"],
                           capture_output=True, check=False)  # fmt: skip
            for mount_point in reversed(mounted):
                subprocess.run(["umount", "-l", str(mount_point)], check=False)
            shutil.rmtree(d, ignore_errors=True)
            for controller in Path("/sys/fs/cgroup").iterdir():
                for leftover in (controller / "sbx-bench-options").glob("v*"):
                    leftover.rmdir()  # runsc leaves empty cgroups behind on cgroup v1

    def _create_widen_start(self, variant: Variant, d: Path) -> subprocess.CompletedProcess[str]:
        """``runsc create``, then the cpuset widened to the parent's CPUs, then ``start`` and ``wait``."""
        name = f"v{self.counter}"
        base = [RUNSC, "--root", str(self.runsc_root), "--network=none", *variant.flags]
        with open(d / "out", "w") as out:  # the container's stdio: nothing here may wait for its end
            subprocess.run([*base, "create", "--bundle", str(d / "bundle"), name], stdout=out, stderr=out,
                           stdin=subprocess.DEVNULL, check=True)  # fmt: skip
        cpuset = Path("/sys/fs/cgroup/cpuset")
        (cpuset / "sbx-bench-options" / name / "cpuset.cpus").write_text((cpuset / "cpuset.cpus").read_text())
        subprocess.run([*base, "start", name], check=True, capture_output=True)
        subprocess.run([*base, "wait", name], check=True, capture_output=True)
        return subprocess.CompletedProcess([], 0, (d / "out").read_text(), "")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--variants", default="")
    parser.add_argument("--small-root", type=Path)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="sbx-bench-options-", dir="/var/tmp"))
    try:
        image_root = default_rootfs()
        erofs = None
        if shutil.which("mkfs.erofs"):
            erofs = work / "root.erofs"
            # Data not inlined in inodes: the sentry's EROFS reader of this release needs that (measured).
            sh("mkfs.erofs", "--quiet", "-E", "noinline_data", str(erofs), str(image_root))
            usr = work / "usr.erofs"
            sh("mkfs.erofs", "--quiet", "-E", "noinline_data", str(usr), str(image_root / "usr"))
        chosen = variants(erofs, usr if erofs else None)
        if args.small_root is None:
            chosen.pop("small-root")
        if args.variants:
            chosen = {k: v for k, v in chosen.items() if k in args.variants.split(",")}
        runner = Runner(work, image_root, args.small_root)
        results: dict[str, dict[str, list[float]]] = {name: defaultdict(list) for name in chosen}
        print(f"# runsc options, {time.strftime('%Y-%m-%d %H:%M')} UTC, runsc {inspect_runsc(RUNSC).version}, "
              f"{os.cpu_count()} cores, {args.rounds} rounds; erofs {'measured' if erofs else 'skipped (no mkfs.erofs)'}",
              flush=True)  # fmt: skip
        for _ in range(args.rounds):
            for name, variant in chosen.items():
                for workload, secs in runner.run(variant).items():
                    results[name][workload].append(secs)
        base = results.get("systrap")
        for workload in WORKLOADS:
            for name in chosen:
                samples = results[name][workload]
                ratio = (
                    f"   {pct(samples, 50) / pct(base[workload], 50):5.2f}x systrap"
                    if base and name != "systrap"
                    else ""
                )
                print(
                    f"{workload:<9} {name:<13} p50 {pct(samples, 50):8.1f} ms   p95 {pct(samples, 95):8.1f} ms{ratio}"
                )
    finally:
        release_roots_under(work)
        shutil.rmtree(work, ignore_errors=True)
        for controller in Path("/sys/fs/cgroup").iterdir():
            if (controller / "sbx-bench-options").is_dir():
                (controller / "sbx-bench-options").rmdir()


if __name__ == "__main__":
    main()

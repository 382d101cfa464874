"""Two builds of runsc against each other, raw, in one run: ``runsc run`` of `true`, and ``runsc restore`` of a
checkpoint of `sleep`, one sample of each build in turn.

    sudo .venv/bin/python bench/bench_runsc_builds.py --baseline /tmp/runsc-stock [--candidate PATH] [--samples 15]

``--candidate`` defaults to the runsc scripts/install.sh builds (``/var/lib/sandboxd/runsc/runsc``, whose
sentry seccomp programs are precompiled: docs/backends.md). A baseline without them is a plain build of the
same pin, from ``runsc/``:

    CGO_ENABLED=0 GOFLAGS=-mod=readonly go build -trimpath \\
        -ldflags "-X gvisor.dev/gvisor/runsc/version.version=$(sed -n 's|^// release: \\([^ ]*\\).*|\\1|p' go.mod)" \\
        -o /tmp/runsc-stock gvisor.dev/gvisor/runsc

Prints p50/p95 of each and the candidate's ratio to the baseline, with the load average. Results go in
docs/backends.md ("The sentry's seccomp filter, precompiled").
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench"))

from bench_sandboxd import RawRunsc, default_rootfs, summary

from sbx.backends.runsc import release_roots_under

INSTALLED = "/var/lib/sandboxd/runsc/runsc"


def raw_for(binary: str, workdir: Path) -> RawRunsc:
    """A raw runsc on the default image root running ``binary`` (RawRunsc reads it from SBX_RUNSC)."""
    os.environ["SBX_RUNSC"] = binary
    return RawRunsc(workdir, default_rootfs())


def restore_once(raw: RawRunsc, workdir: Path, name: str) -> float:
    """Seconds of one ``runsc restore`` of a checkpoint of `sleep` (the run and checkpoint untimed)."""
    raw.write_spec(["sleep", "1000000"])
    subprocess.run(raw.argv("run", "--detach", "--bundle", str(raw.bundle), name), check=True)
    image = workdir / f"image-{name}"
    subprocess.run(raw.argv("checkpoint", "--image-path", str(image), name), check=True)
    subprocess.run(raw.argv("delete", "--force", name), check=True)
    started = time.monotonic()
    subprocess.run(raw.argv("restore", "--detach", "--image-path", str(image), "--bundle", str(raw.bundle), name),
                   check=True)  # fmt: skip
    took = time.monotonic() - started
    raw.cleanup(name)
    shutil.rmtree(image, ignore_errors=True)
    return took


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--baseline", required=True, help="the runsc to compare against")
    parser.add_argument("--candidate", default=INSTALLED, help=f"the runsc measured (default {INSTALLED})")
    parser.add_argument("--samples", type=int, default=15, help="samples of each measurement (default 15)")
    args = parser.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="sbx-builds-", dir="/var/tmp"))
    load = os.getloadavg()
    try:
        raws = {"baseline": raw_for(args.baseline, workdir / "baseline"),
                "candidate": raw_for(args.candidate, workdir / "candidate")}  # fmt: skip
        runs: dict[str, list[float]] = {k: [] for k in raws}
        restores: dict[str, list[float]] = {k: [] for k in raws}
        for i in range(args.samples):
            for label, raw in raws.items():
                runs[label] += raw.run_samples(1)
                restores[label].append(restore_once(raw, workdir, f"b-{label}-{i}"))
    finally:
        release_roots_under(workdir)  # runsc's null-netns pins, else the tree cannot be removed
        shutil.rmtree(workdir, ignore_errors=True)
    print(f"# {time.strftime('%Y-%m-%d %H:%M')} UTC, {os.cpu_count()} cores, load average at start "
          f"{load[0]:.2f} {load[1]:.2f} {load[2]:.2f}, at end {' '.join(f'{v:.2f}' for v in os.getloadavg())}")  # fmt: skip
    print(f"# baseline {args.baseline}, candidate {args.candidate}")
    print(summary("runsc run (true), baseline", runs["baseline"]))
    print(summary("runsc run (true), candidate", runs["candidate"], runs["baseline"]))
    print(summary("runsc restore (sleep), baseline", restores["baseline"]))
    print(summary("runsc restore (sleep), candidate", restores["candidate"], restores["baseline"]))


if __name__ == "__main__":
    main()

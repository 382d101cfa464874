"""Benchmark suspend, resume and forks from a memory snapshot against raw runsc, in one run on one machine.

    sudo .venv/bin/python bench/bench_snapshots.py [--samples 15]

Starts sandboxd and times, per sample:

- suspend (POST .../suspend) and resume (POST .../resume, then a `true` run: back and answering),
- fork from a memory snapshot to the first run result (POST /v1/sandboxes with snapshot_id, then run `true`;
  the create and the first run are printed apart as well),

and, on the same image root, raw `runsc checkpoint` and `runsc restore` of a sandbox running `sleep`, one cycle
before each of sandboxd's samples.
Prints p50/p95 of each with ratios, and checks the target: fork to first result p50 under 300 ms.
Exit status 1 when the target is missed.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench"))

from bench_sandboxd import KeepAlive, RawRunsc, bench_node, default_rootfs, pct, summary, wait_torn_down

#: The target of the snapshots issue: fork from a memory snapshot to the first run result, p50.
TARGET_FORK_P50_MS = 300.0


class RawCycles:
    """A raw sandbox running `sleep` on the same image root, checkpointed and restored one cycle at a time, so
    that the raw samples are taken in turn with sandboxd's (a busy moment of this shared machine then weighs
    on both alike)."""

    name = "bench-ckpt"

    def __init__(self, raw: RawRunsc, workdir: Path) -> None:
        self.raw, self.workdir = raw, workdir
        self.checkpoints: list[float] = []
        self.restores: list[float] = []
        raw.write_spec(["sleep", "1000000"])
        raw.cleanup(self.name)
        subprocess.run(raw.argv("run", "--detach", "--bundle", str(raw.bundle), self.name), check=True)

    def once(self) -> None:
        """Time one `runsc checkpoint`, then (the sandbox deleted in between, untimed) one `runsc restore`."""
        image = self.workdir / f"raw-image-{len(self.checkpoints)}"
        started = time.monotonic()
        subprocess.run(self.raw.argv("checkpoint", "--image-path", str(image), self.name), check=True)
        self.checkpoints.append(time.monotonic() - started)
        subprocess.run(self.raw.argv("delete", "--force", self.name), check=True)
        started = time.monotonic()
        subprocess.run(self.raw.argv("restore", "--detach", "--image-path", str(image), "--bundle",
                                     str(self.raw.bundle), self.name), check=True)  # fmt: skip
        self.restores.append(time.monotonic() - started)
        shutil.rmtree(image, ignore_errors=True)

    def close(self) -> None:
        self.raw.cleanup(self.name)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=15, help="samples of each measurement (default 15)")
    args = parser.parse_args()
    with bench_node("sbx-bench-") as (server, workdir):
        client = KeepAlive(server)
        cycles = RawCycles(RawRunsc(workdir / "raw", default_rootfs()), workdir)
        ref = str(client.call("POST", "/v1/sandboxes", {})["id"])
        suspends, resumes = [], []
        for _ in range(args.samples):
            cycles.once()
            took, _ = client.timed("POST", f"/v1/sandboxes/{ref}/suspend")
            suspends.append(took)
            started = time.monotonic()
            client.call("POST", f"/v1/sandboxes/{ref}/resume")
            client.call("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]})
            resumes.append(time.monotonic() - started)
        # A sandbox with a little state: a background process and a file.
        script = "echo x > /sandbox/home/f; nohup sleep 1000000 >/dev/null 2>&1 &"
        client.call("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["sh", "-c", script]})
        took, snap = client.timed("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "memory"})
        snapshot_secs = [took]
        forks, fork_creates, fork_first_runs = [], [], []
        for _ in range(args.samples):
            cycles.once()
            started = time.monotonic()
            fork = client.call("POST", "/v1/sandboxes", {"snapshot_id": snap["id"]})
            created = time.monotonic()
            result = client.call("POST", f"/v1/sandboxes/{fork['id']}/run", {"argv": ["true"]})
            forks.append(time.monotonic() - started)
            fork_creates.append(created - started)
            fork_first_runs.append(forks[-1] - fork_creates[-1])
            assert result["exit_code"] == 0
            client.call("DELETE", f"/v1/sandboxes/{fork['id']}")
            wait_torn_down(server, fork["id"])
        for _ in range(3):
            snapshot_secs.append(
                client.timed("POST", f"/v1/sandboxes/{ref}/snapshots", {"kind": "memory"})[0]
            )
        client.call("DELETE", f"/v1/sandboxes/{ref}")
        client.close()
        cycles.close()
        raw_ckpt, raw_restore = cycles.checkpoints, cycles.restores
    print(summary("raw runsc checkpoint", raw_ckpt))
    print(summary("raw runsc restore", raw_restore))
    print(summary("suspend", suspends, raw_ckpt))
    print(summary("resume + first run", resumes, raw_restore))
    print(summary("memory snapshot", snapshot_secs))
    print(summary("fork (memory) + first run", forks, raw_restore))
    # Where a fork's time goes: the create (the restore and sandboxd's layer, bundle and reconnect), then the run.
    print(summary("  of which the create", fork_creates, raw_restore))
    print(summary("  of which the first run", fork_first_runs))
    fork_p50_ms = pct(forks, 50)
    verdict = "met" if fork_p50_ms < TARGET_FORK_P50_MS else "MISSED"
    print(
        f"target: fork to first result p50 under {TARGET_FORK_P50_MS:.0f} ms: {fork_p50_ms:.0f} ms, {verdict}"
    )
    sys.exit(0 if verdict == "met" else 1)


if __name__ == "__main__":
    main()

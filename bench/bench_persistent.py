"""Benchmark persistent sandboxes against raw runsc, in one run on one machine.

    sudo .venv/bin/python bench/bench_persistent.py [--samples 15] [--sleepers 1000]

Starts sandboxd and measures:

- **wake**: a run of `true` naming a suspended persistent sandbox (the wake: restore, reconnect, then the run),
  against raw `runsc restore` of the same sandbox's checkpoint (its bundle, root and flags) followed by
  `runsc exec true`, the two interleaved; target: p50 at most 1.1x;
- **start**: the same run naming a stopped one (booted from its disk), against raw `runsc run --detach` + exec;
- **idle suspend** of a default sandbox: from the end of its last request to the state suspended, less its
  `idle_timeout_secs`, and the bytes its checkpoint holds on disk (also what raw `runsc checkpoint` makes with
  each of its size options, for comparison);
- **many sleepers**: ``--sleepers`` suspended persistent sandboxes on the node (disk only), then the wake p50 of
  sandboxes picked among them, against the same with 10; target: the same p50 (at most 1.25x on this noisy
  machine) and free cpus and memory untouched by the sleepers.

Prints p50/p95 with ratios and each target's verdict; exit status 1 when one is missed.

``--lazy MB`` measures only gVisor's lazy restore (issue 30): a persistent sandbox whose daemon holds MB MiB of
touched memory is suspended, then its checkpoint is restored raw, plain and with ``--background`` (the pages
loaded after restore returns; the checkpoint is uncompressed, runsc's default), interleaved, each followed by
``runsc exec true``: p50 of each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))
sys.path.insert(0, str(REPO / "tests" / "integration"))
sys.path.insert(0, str(REPO / "bench"))

from bench_sandboxd import KeepAlive, RawRunsc, bench_node, default_rootfs, pct, summary

from sbx.backends.runsc import inspect_runsc

#: Wake + first run against raw restore + exec, p50.
TARGET_WAKE_RATIO = 1.1
#: Wake p50 among many sleepers against among 10 (1.0 is the target; this much noise is allowed here).
TARGET_MANY_RATIO = 1.25
IDLE_SECS = 1


def allocated(path: Path) -> int:
    """Bytes the file ``path``, or the files under the directory ``path``, take on disk (holes not counted)."""
    if path.is_file():
        return path.stat().st_blocks * 512
    total = 0
    for root, _dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except OSError:
                pass
    return total


def raw_checkpoint_sizes(raw: RawRunsc, workdir: Path) -> dict[str, int]:
    """The checkpoint of a raw sandbox running `sleep`, on disk, with each of runsc's size options."""
    raw.write_spec(["sleep", "1000000"])
    name = "bench-sizes"
    sizes: dict[str, int] = {}
    for variant, flags in (("none", []), ("exclude-zero-pages", ["--exclude-committed-zero-pages"]),
                           ("flate", ["--compression=flate-best-speed"])):  # fmt: skip
        raw.cleanup(name)
        subprocess.run(raw.argv("run", "--detach", "--bundle", str(raw.bundle), name), check=True,
                       stdin=subprocess.DEVNULL)  # fmt: skip
        time.sleep(0.5)
        image = workdir / f"raw-{variant}"
        subprocess.run(raw.argv("checkpoint", *flags, "--image-path", str(image), name), check=True)
        sizes[variant] = allocated(image)
        raw.cleanup(name)
        shutil.rmtree(image, ignore_errors=True)
    return sizes


def raw_runs(raw: RawRunsc, samples: int) -> list[float]:
    """Raw `runsc run --detach` + `runsc exec true` of a sandbox running `sleep` on the image root."""
    raw.write_spec(["sleep", "1000000"])
    name = "bench-run"
    runs = []
    for _ in range(samples):
        raw.cleanup(name)
        started = time.monotonic()
        subprocess.run(raw.argv("run", "--detach", "--bundle", str(raw.bundle), name), check=True,
                       stdin=subprocess.DEVNULL)  # fmt: skip
        subprocess.run(raw.argv("exec", name, "true"), check=True, stdout=subprocess.DEVNULL)
        runs.append(time.monotonic() - started)
    raw.cleanup(name)
    return runs


class SameSandboxRaw:
    """Raw runsc on the very sandbox sandboxd suspended: ``runsc restore`` of a copy of its checkpoint with its
    bundle, root and the flags sandboxd starts it with (read from the node's log), then ``runsc exec true``;
    then killed again, so that sandboxd finds it suspended as it left it."""

    def __init__(self, server: Any, sandbox_id: str, workdir: Path) -> None:
        runtime = next(
            json.loads(line) for line in server.log_text().splitlines() if '"gVisor runtime"' in line
        )
        self.info = inspect_runsc(runtime["runsc_path"])
        self.flags = self.info.start_flags(runtime["platform"], int(runtime.get("dentry_cache") or 0))
        self.root = server.state_dir / "gvisor" / "runsc"
        self.directory = server.state_dir / "gvisor" / sandbox_id
        self.image = server.state_dir / "sandboxes" / sandbox_id / "suspend-image"
        self.copy = workdir / "same-sandbox-image"
        self.id = sandbox_id

    def argv(self, *args: str) -> list[str]:
        return [self.info.path, "--root", str(self.root), *args]

    def wake(self, background: bool = False) -> float:
        """Seconds to restore (``--background``: lazily) and run ``true``."""
        shutil.rmtree(self.copy, ignore_errors=True)
        shutil.copytree(self.image, self.copy)
        (self.root / f"runsc-{self.id}.sock").unlink(missing_ok=True)
        (self.directory / "ctl" / "wake").touch()  # the restored agent ends its quiesce, as sandboxd has it
        started = time.monotonic()
        subprocess.run(self.argv(*self.flags, "--host-uds=create", "--cpu-num-from-quota", "--network=none",
                                 "restore", *(["--background"] if background else []), "--image-path",
                                 str(self.copy), "--detach", "--bundle",
                                 str(self.directory / "bundle"), self.id),
                       check=True, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)  # fmt: skip
        subprocess.run(self.argv("exec", self.id, "true"), check=True, stdout=subprocess.DEVNULL)
        took = time.monotonic() - started
        for args in (("kill", self.id, "KILL"), ("delete", "--force", self.id)):
            subprocess.run(self.argv(*args), capture_output=True, check=False)
        (self.root / f"runsc-{self.id}.sock").unlink(missing_ok=True)
        return took


def lazy_restore(mb: int, samples: int) -> None:
    config = "[capacity]\nmax_sandboxes = 8\ndisk_mb = 200000\n"
    with bench_node("sbx-bench-lazy-", config) as (server, workdir):
        client = KeepAlive(server)
        body = {"name": "lazy", "persistent": True, "memory_mb": max(512, mb * 3)}
        ref = str(client.call("POST", "/v1/sandboxes", body)["id"])
        hold = (f"x = bytearray({mb} << 20); x[::4096] = b'a' * len(x[::4096]); open('/tmp/held', 'w').close(); "
                "import time; time.sleep(1e9)")  # fmt: skip
        client.call("POST", f"/v1/sandboxes/{ref}/run",
                    {"argv": ["sh", "-c", 'nohup python3 -c "$1" >/dev/null 2>&1 &', "sh", hold]})  # fmt: skip
        while client.call("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["test", "-e", "/tmp/held"]})[
            "exit_code"
        ]:
            time.sleep(0.1)
        same = SameSandboxRaw(server, ref, workdir)
        client.call("POST", f"/v1/sandboxes/{ref}/suspend")
        image_mib = allocated(same.image) / 2**20
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range(samples):
            for background in (False, True):
                times[background].append(same.wake(background))
        client.call("DELETE", f"/v1/sandboxes/{ref}")
        client.close()
    print(f"load average at the end: {os.getloadavg()[0]:.2f}; checkpoint {image_mib:.0f} MiB")
    print(summary("raw restore + exec", times[False]))
    print(summary("raw restore --background + exec", times[True], times[False]))


def listed_state(client: KeepAlive, ref: str) -> str:
    """The state as the listing shows it (a request that does not name the sandbox: no activity)."""
    sandboxes = client.call("GET", "/v1/sandboxes")["sandboxes"]
    return str(next(s["state"] for s in sandboxes if s["id"] == ref))


def wake_once(client: KeepAlive, ref: str, action: str) -> float:
    """Put ``ref`` to sleep with ``action`` (suspend, stop), then time a run naming it."""
    client.call("POST", f"/v1/sandboxes/{ref}/{action}")
    took, result = client.timed("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]})
    assert result["exit_code"] == 0, result
    return took


def make_sleepers(client: KeepAlive, count: int, prefix: str) -> list[str]:
    refs = []
    for i in range(count):
        ref = str(client.call("POST", "/v1/sandboxes", {"name": f"{prefix}-{i}", "persistent": True})["id"])
        client.call("POST", f"/v1/sandboxes/{ref}/suspend")
        refs.append(ref)
    return refs


def wakes_among(client: KeepAlive, refs: list[str], samples: int) -> list[float]:
    """Wake ``samples`` sandboxes picked among ``refs`` (each suspended again after)."""
    picked = random.Random(7).sample(refs, min(samples, len(refs)))
    times = []
    for ref in picked:
        took, _ = client.timed("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]})
        times.append(took)
        client.call("POST", f"/v1/sandboxes/{ref}/suspend")
    return times


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=15, help="samples of each measurement (default 15)")
    parser.add_argument("--sleepers", type=int, default=1000, help="suspended sandboxes held at once (1000)")
    parser.add_argument("--lazy", type=int, metavar="MB", help="only lazy restore, of a guest holding MB MiB")
    args = parser.parse_args()
    if args.lazy is not None:
        lazy_restore(args.lazy, args.samples)
        return
    config = f"[capacity]\nmax_sandboxes = 8\ndisk_mb = {max(200_000, (args.sleepers + 20) * 2048)}\n"
    results: dict[str, Any] = {}
    with bench_node("sbx-bench-persist-", config) as (server, workdir):
        client = KeepAlive(server)
        ref = str(client.call("POST", "/v1/sandboxes", {"name": "bench", "persistent": True})["id"])
        client.call("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]})
        same = SameSandboxRaw(server, ref, workdir)
        results["wake"], results["raw_wake"] = [], []
        for _ in range(args.samples):  # interleaved, on the same sandbox: the raw wake, then sandboxd's
            client.call("POST", f"/v1/sandboxes/{ref}/suspend")
            results["raw_wake"].append(same.wake())
            took, result = client.timed("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]})
            assert result["exit_code"] == 0, result
            results["wake"].append(took)
        results["start"] = [wake_once(client, ref, "stop") for _ in range(args.samples)]
        # The idle suspend: from the end of the last request to the state suspended, less the timeout.
        idle = []
        client.call("PATCH", f"/v1/sandboxes/{ref}", {"idle_timeout_secs": IDLE_SECS})
        for _ in range(5):
            client.call("POST", f"/v1/sandboxes/{ref}/run", {"argv": ["true"]})
            last = time.monotonic()
            while listed_state(client, ref) != "suspended":
                time.sleep(0.01)
            idle.append(time.monotonic() - last - IDLE_SECS)
        results["idle"] = idle
        results["bytes"] = allocated(server.state_dir / "sandboxes" / ref / "suspend-image")
        results["layer_bytes"] = allocated(server.state_dir / "gvisor" / ref / "layer" / "disk.img")
        client.call("DELETE", f"/v1/sandboxes/{ref}")
        free_before = client.call("GET", "/v1/node")["free"]
        few = make_sleepers(client, 10, "few")
        results["few"] = wakes_among(client, few, args.samples)
        started = time.monotonic()
        many = few + make_sleepers(client, args.sleepers - len(few), "many")
        results["made_secs"] = time.monotonic() - started
        free_after = client.call("GET", "/v1/node")["free"]
        results["free"] = (free_before, free_after)
        results["many"] = wakes_among(client, many, args.samples)
        # The sandbox's own directory and its backend's but the overlay mount (the image's files, shared).
        results["sleeper_bytes"] = sum(
            allocated(server.state_dir / "sandboxes" / r)
            + sum(allocated(p) for p in (server.state_dir / "gvisor" / r).iterdir() if p.name != "layer")
            + allocated(server.state_dir / "gvisor" / r / "layer" / "disk.img")
            for r in many
        ) / len(many)
        client.close()
        raw = RawRunsc(workdir / "raw", default_rootfs())
        sizes = raw_checkpoint_sizes(raw, workdir)
        raw_run = raw_runs(raw, args.samples)
        raw_restore = results["raw_wake"]
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(summary("raw runsc restore + exec, same sandbox", raw_restore))
    print(summary("raw runsc run + exec (image root)", raw_run))
    print(summary("wake (suspended) + first run", results["wake"], raw_restore))
    print(summary("start (stopped) + first run", results["start"], raw_run))
    print(summary(f"idle suspend (after its {IDLE_SECS} s timeout)", results["idle"]))
    print(f"suspended default sandbox on disk: checkpoint {results['bytes'] / 2**20:.1f} MiB, "
          f"layer {results['layer_bytes'] / 2**20:.1f} MiB")  # fmt: skip
    print("raw runsc checkpoint of a sleeping sandbox: " + ", ".join(
        f"{k} {v / 2**20:.1f} MiB" for k, v in sizes.items()))  # fmt: skip
    print(summary("wake among 10 sleepers", results["few"]))
    print(summary(f"wake among {len(many)} sleepers", results["many"], results["few"]))
    print(f"{len(many)} sleepers made in {results['made_secs']:.0f} s; on disk {results['sleeper_bytes'] / 2**20:.1f} "
          f"MiB each; free before {results['free'][0]}, with them {results['free'][1]}")  # fmt: skip
    wake_ratio = pct(results["wake"], 50) / pct(raw_restore, 50)
    many_ratio = pct(results["many"], 50) / pct(results["few"], 50)
    before, after = results["free"]
    verdicts = [
        (f"wake + first run p50 at most {TARGET_WAKE_RATIO}x raw restore + exec: {wake_ratio:.2f}x",
         wake_ratio <= TARGET_WAKE_RATIO),
        (f"wake p50 among {len(many)} at most {TARGET_MANY_RATIO}x among 10: {many_ratio:.2f}x",
         many_ratio <= TARGET_MANY_RATIO),
        ("sleepers hold no cpus or memory",
         (before["cpus"], before["memory_mb"]) == (after["cpus"], after["memory_mb"])),
    ]  # fmt: skip
    for text, ok in verdicts:
        print(f"target: {text}: {'met' if ok else 'MISSED'}")
    sys.exit(0 if all(ok for _, ok in verdicts) else 1)


if __name__ == "__main__":
    main()
